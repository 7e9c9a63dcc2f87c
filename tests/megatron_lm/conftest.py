"""Run Megatron-LM's own pretrain_gpt.py through ``python -m megatron_snake.megatron_lm``
and read its log.

These tests need a Megatron-LM checkout at a supported release (``megatron_snake.releases``)
and skip without one::

    MEGATRON_LM_DIR=/path/to/Megatron-LM python -m pytest -q tests/megatron_lm

The runs use this interpreter (``sys.executable``) and this repository's megatron_snake (its
root goes first on their PYTHONPATH). triton is not needed (the runner stubs the modules that
import it); psutil is needed for a ``torch_dist`` save (megatron-core's checkpoint writer;
without it the save hangs), so the tests that save skip without it. Where the installed
megatron-core is of another release series than the checkout, the runner imports the
checkout's own megatron/core, whose dataset helpers Megatron-LM builds with make (pybind11).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from megatron_snake import releases
from megatron_snake.megatron_lm.version import SUPPORTED, checkout_version

ENV = "MEGATRON_LM_DIR"
RUN_TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parents[2]   # the megatron_snake the runs import

# A tiny GPT that trains on the CPU in seconds; the last four flags are what the CPU needs
# (on a GPU without Transformer Engine or Apex the last three too; NCCL there).
TINY_FLAGS = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10", "--lr", "1e-3",
    "--eval-interval", "5", "--eval-iters", "1", "--log-interval", "1",
    "--distributed-backend", "nccl" if torch.cuda.is_available() else "gloo",
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
]

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|(.*)")
_LM_LOSS = re.compile(r"\blm loss: ([-+0-9.Ee]+) \|")
_GRAD_NORM = re.compile(r"\bgrad norm: ([-+0-9.Ee]+) \|")
_VALIDATION = re.compile(r"validation loss at iteration (\d+)(?: on (\w+) set)? \| lm loss value: ([-+0-9.Ee]+)")


@dataclass
class Run:
    """One pretrain_gpt.py run: its exit status, its output and what its log says."""

    returncode: int
    output: str
    losses: dict[int, float] = field(default_factory=dict)      # iteration -> printed lm loss
    grad_norms: dict[int, float] = field(default_factory=dict)  # iteration -> grad norm
    # (iteration, "") for the evaluation during training; (iteration, "validation" | "test")
    # for the final evaluation.
    validation: dict[tuple[int, str], float] = field(default_factory=dict)

    def check(self) -> "Run":
        assert self.returncode == 0, f"pretrain_gpt.py exited {self.returncode}:\n{self.output[-6000:]}"
        return self


def parse_log(output: str) -> tuple[dict, dict, dict]:
    """Megatron-LM's training_log and evaluate_and_print_results lines."""
    losses, grad_norms, validation = {}, {}, {}
    for line in output.splitlines():
        if m := _ITERATION.search(line):
            iteration, rest = int(m.group(1)), m.group(2)
            if loss := _LM_LOSS.search(rest):
                losses[iteration] = float(loss.group(1))
            if norm := _GRAD_NORM.search(rest):
                grad_norms[iteration] = float(norm.group(1))
        elif m := _VALIDATION.search(line):
            validation[(int(m.group(1)), m.group(2) or "")] = float(m.group(3))
    return losses, grad_norms, validation


@pytest.fixture(scope="session")
def megatron_lm_dir() -> Path:
    """The checkout named by MEGATRON_LM_DIR; skips unless it is at a supported release."""
    path = os.environ.get(ENV)
    if not path:
        pytest.skip(f"set {ENV} to a Megatron-LM checkout ({SUPPORTED}) to run these")
    checkout = Path(path).resolve()
    found = checkout_version(checkout)
    if not (checkout / "pretrain_gpt.py").is_file() or releases.release_of(found or "") is None:
        pytest.skip(f"{ENV}={path} is not a Megatron-LM checkout of {SUPPORTED} "
                    f"(megatron/core/package_info.py: {found})")
    return checkout


@pytest.fixture(scope="session")
def release(megatron_lm_dir) -> releases.Release:
    """The release of the checkout (what differs between releases: ``megatron_snake.releases``)."""
    return releases.release_of(checkout_version(megatron_lm_dir))


@pytest.fixture
def needs_psutil():
    if importlib.util.find_spec("psutil") is None:
        pytest.skip(f"psutil is not installed for {sys.executable}: megatron-core's torch_dist "
                    "checkpoint writer needs it (without it the save hangs)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(command: list[str], env: dict, cwd: Path, log: Path) -> Run:
    """Run ``command`` in its own process group; kill the group on timeout."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"pretrain_gpt.py ran past {RUN_TIMEOUT_S} s; log: {log}")
    output = log.read_text()
    return Run(returncode, output, *parse_log(output))


def _base_env(pythonpath: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SNAKE_DEBUG", "CUDA_DEVICE_MAX_CONNECTIONS")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (ROOT, pythonpath) if p is not None)
    return env


@pytest.fixture
def pretrain_gpt(megatron_lm_dir, tmp_path):
    """``pretrain_gpt(*flags, cwd=...)``: one process, ``python -m megatron_snake.megatron_lm
    $MEGATRON_LM_DIR/pretrain_gpt.py *flags`` (torch.distributed's env:// variables set).
    ``script=`` runs another entry script; ``runner=False`` runs it as ``python SCRIPT``."""
    count = iter(range(1000))

    def run(*flags: str, cwd: Path | None = None, script: Path | None = None,
            runner: bool = True) -> Run:
        env = _base_env()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0")
        script = script or megatron_lm_dir / "pretrain_gpt.py"
        command = [sys.executable, *(["-m", "megatron_snake.megatron_lm"] if runner else []),
                   str(script), *flags]
        return _launch(command, env, cwd or tmp_path, tmp_path / f"run{next(count)}.log")

    return run


@pytest.fixture
def torchrun_pretrain_gpt(megatron_lm_dir, tmp_path):
    """``torchrun_pretrain_gpt(*flags, nproc=2, cwd=...)``: ``torchrun --nproc-per-node N -m
    megatron_snake.megatron_lm $MEGATRON_LM_DIR/pretrain_gpt.py *flags``."""
    count = iter(range(1000))

    def run(*flags: str, nproc: int = 2, cwd: Path | None = None) -> Run:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                   "-m", "megatron_snake.megatron_lm", str(megatron_lm_dir / "pretrain_gpt.py"),
                   *flags]
        return _launch(command, _base_env(), cwd or tmp_path, tmp_path / f"torchrun{next(count)}.log")

    return run


def assert_trained(run: Run, iterations: int = 10) -> None:
    """Every iteration logged a finite loss and grad norm, the loss went down, and the
    evaluations at the eval interval and at the end ran."""
    run.check()
    assert sorted(run.losses) == list(range(1, iterations + 1)), run.output[-4000:]
    assert sorted(run.grad_norms) == sorted(run.losses)
    assert all(math.isfinite(v) for v in [*run.losses.values(), *run.grad_norms.values()])
    assert run.losses[iterations] < run.losses[1]
    assert {(5, ""), (10, ""), (10, "validation"), (10, "test")} <= set(run.validation)


def launch_pretrain_gpt(megatron_lm_dir: Path, log: Path, *flags: str, nproc: int = 1,
                        script: Path | None = None, pythonpath: Path | None = None,
                        cwd: Path | None = None) -> Run:
    """``python -m megatron_snake.megatron_lm SCRIPT *flags`` in one process (torch.distributed's
    env:// variables set), or under ``torchrun --nproc-per-node nproc``; its output goes to
    ``log``. SCRIPT: the checkout's pretrain_gpt.py unless given; ``pythonpath``: PYTHONPATH
    for the run (a script outside the checkout finds ``megatron.training`` through it; the
    runner moves a checkout there after site-packages). Usable from fixtures of any scope
    (``pretrain_gpt`` and ``torchrun_pretrain_gpt`` are tied to one test's tmp_path)."""
    env = _base_env(pythonpath)
    runner = ["-m", "megatron_snake.megatron_lm",
              str(script or megatron_lm_dir / "pretrain_gpt.py")]
    if nproc == 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0")
        command = [sys.executable, *runner, *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                   *runner, *flags]
    return _launch(command, env, cwd or log.parent, log)


def refuse_pretrain_gpt(megatron_lm_dir: Path, cwd: Path,
                        *flags: str) -> subprocess.CompletedProcess:
    """A one-process run expected to be refused before it trains: its exit status, and its
    stdout and stderr apart (a refusal is one line on stderr)."""
    env = _base_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    return subprocess.run([sys.executable, "-m", "megatron_snake.megatron_lm",
                           str(megatron_lm_dir / "pretrain_gpt.py"), *flags],
                          cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
