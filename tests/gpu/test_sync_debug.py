"""Host-device synchronizations of one steady offloaded training step.

The offloaded step is meant to keep the GPU fed: weights, checkpoints and gradients move on
the tensor store's copy streams (ordered by events), the optimizer runs on CPU threads, and
the host waits for the device only at the step boundary. Here one steady step (after two
warm-up steps) runs under ``torch.cuda.set_sync_debug_mode("warn")``, which makes torch warn
at every implicit synchronization (``.item()``, a blocking device-to-host copy, ...). Each
warning is attributed to the innermost frame of megatron_snake/ or megatron/ on its stack
(the call site), counted, written to ``$SNAKE_GPU_REPORT_DIR/sync_debug.json`` (or a
temporary directory) and printed; every site must be in ALLOWED, and the total must stay within
a bound that grows with the number of units, not with micro-batches x units.

The state is built the way training builds it (training/build.py's build_run:
open_store, build_offloaded_state, make_forward_backward from pretrain_gpt flags with
--snake-offload), and the step is the training loop's: forward_backward, optimizer.step(),
then the logged loss (loop._lm_loss).
"""

from __future__ import annotations

import json
import os
import threading
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import VOCAB
from gpu_helpers import DEVICE, gpu_world, requires_cuda, requires_device, sync  # noqa: F401

pytestmark = requires_device

# Synchronizing call sites allowed in a steady step, as (file under the package roots,
# function). Only the step-boundary ones the design names; the JSON report lists every site
# seen, with its line and thread. On an H200 (2026-11-26, 5 units, 8 micro-batches) a
# steady step synchronized twice with bf16 (the norm, the logged loss) and four times with
# fp16 (also the overflow flag and the loss scale): none per unit.
ALLOWED = {
    # the global gradient norm as a number (OffloadedAdamW.step: total.to("cpu")); with
    # --fp16 also the overflow flag read there (bool(found[0] > 0)) before the update
    ("megatron_snake/optim/offloaded_adamw.py", "step"),
    # the logged lm loss (loop._lm_loss: .item())
    ("megatron_snake/training/loop.py", "_lm_loss"),
    # with --fp16, the loss scale the next step's shards are unscaled by, read once after
    # the scaler's update in step() (OffloadedAdamW._read_loss_scale)
    ("megatron_snake/optim/offloaded_adamw.py", "_read_loss_scale"),
}

# Bound on the step's synchronizations: at most this many per unit (a unit's gradient handed
# to the optimizer, its weights acquired) plus a few at the step boundary. Never one per
# (unit, micro-batch).
SYNCS_PER_UNIT = 2
STEP_BOUNDARY_SYNCS = 4

SYNC_MESSAGE = "synchronizing CUDA operation"   # torch's sync-debug warning text
NUM_LAYERS, NUM_MICROBATCHES, MICRO_BATCH = 5, 8, 2
WARMUP_STEPS = 2


def _package_roots() -> dict[str, str]:
    """Directory -> the name a site's file is reported under (megatron_snake/..., megatron/...)."""
    import megatron
    import megatron_snake

    roots = {}
    for pkg in (megatron_snake, megatron):
        for path in getattr(pkg, "__path__", []):
            roots[str(Path(path).resolve())] = Path(path).name
    return roots


def site_of(stack: list[traceback.FrameSummary], roots: dict[str, str]):
    """(file relative to its package's parent, function, line) of the innermost frame of
    ``stack`` (outermost first) inside one of ``roots``; None when there is none. A frame of
    a generator expression or lambda is named after the frame that runs it when that is in
    the same file (``_lm_loss.<genexpr>``)."""
    for i in range(len(stack) - 1, -1, -1):
        frame = stack[i]
        path = str(Path(frame.filename).resolve())
        for root, name in roots.items():
            if path.startswith(root + os.sep):
                rel = f"{name}/" + os.path.relpath(path, root).replace(os.sep, "/")
                function = frame.name
                if function.startswith("<") and i > 0 and stack[i - 1].filename == frame.filename:
                    function = f"{stack[i - 1].name}.{function}"
                return rel, function, frame.lineno
    return None


def allowed(file: str, function: str) -> bool:
    return any(file == f and (function == fn or function.startswith(fn + "."))
               for f, fn in ALLOWED)


class SyncRecorder:
    """Collects torch's sync-debug warnings by call site while active (from any thread:
    the warnings machinery is process-wide)."""

    def __init__(self):
        self.roots = _package_roots()
        self.sites: Counter = Counter()       # (file, function, line) -> count
        self.threads: dict = {}               # (file, function, line) -> thread names
        self.unattributed: list[str] = []     # stacks with no library frame
        self._lock = threading.Lock()

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE not in str(message):
            return
        stack = traceback.extract_stack()
        site = site_of(stack, self.roots)
        with self._lock:
            if site is None:
                self.unattributed.append("".join(traceback.format_list(stack[-8:])))
                return
            self.sites[site] += 1
            self.threads.setdefault(site, set()).add(threading.current_thread().name)

    def report(self) -> list[dict]:
        return [{"file": f, "function": fn, "line": ln, "count": n,
                 "threads": sorted(self.threads[(f, fn, ln)])}
                for (f, fn, ln), n in sorted(self.sites.items())]


@contextmanager
def record_syncs():
    """Yields a SyncRecorder that sees every sync-debug warning (of any thread) raised in the
    body; on a CUDA DEVICE torch's sync debug mode is "warn" meanwhile."""
    recorder = SyncRecorder()
    previous = torch.cuda.get_sync_debug_mode() if DEVICE.type == "cuda" else None
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        warnings.showwarning = recorder.showwarning   # catch_warnings restores it
        if previous is not None:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield recorder
        finally:
            if previous is not None:
                torch.cuda.set_sync_debug_mode(previous)


def _steady_step(offload_dir, precision: str) -> tuple[SyncRecorder, float, int]:
    """Two warm-up steps, then one step with its synchronizations recorded. Returns the
    recorder, the step's lm loss and the number of units. ``precision``: bf16, or fp16 with
    Megatron's dynamic loss scaler (started low enough that no step overflows)."""
    from megatron_snake.training import loop
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run
    from megatron_snake.training.data import random_microbatches
    from megatron_snake.training.distributed import set_seed

    args = parse_args([
        "--num-layers", str(NUM_LAYERS), "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(MICRO_BATCH * NUM_MICROBATCHES),
        *(["--bf16"] if precision == "bf16" else ["--fp16", "--initial-loss-scale", "1024"]),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
        "--snake-offload", "--snake-offload-dir", str(offload_dir),
        "--snake-checkpoint-interval", "1", "--snake-host-memory-limit", "256MiB"])
    assert args.num_microbatches == NUM_MICROBATCHES
    set_seed(7)
    with build_run(args, DEVICE, VOCAB, log=lambda line: None) as run:  # as pretrain builds it
        units = len(run.offloaded.weights.params.units)
        batches = [random_microbatches(NUM_MICROBATCHES, MICRO_BATCH, args.seq_length, VOCAB,
                                       seed=step, device=DEVICE)
                   for step in range(WARMUP_STEPS + 1)]
        for mbs in batches[:WARMUP_STEPS]:
            run.step(mbs)
        sync()
        mbs = batches[-1]
        with record_syncs() as recorder:
            step = run.step(mbs)
            lm_loss = loop._lm_loss(step.reports, DEVICE)
            run.tensor_store.synchronize()   # the step's store work, on the store's threads
        update_successful, grad_norm = step.update_successful, step.grad_norm
    assert update_successful and grad_norm is not None and grad_norm > 0
    assert torch.isfinite(torch.tensor(lm_loss)) and lm_loss > 0
    return recorder, lm_loss, units


def _write_report(recorder: SyncRecorder, units: int, precision: str, default_dir: Path) -> Path:
    out = Path(os.environ.get("SNAKE_GPU_REPORT_DIR") or default_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("sync_debug.json" if precision == "bf16" else f"sync_debug_{precision}.json")
    report = {"device": str(DEVICE), "precision": precision, "units": units,
              "micro_batches": NUM_MICROBATCHES,
              "total": sum(recorder.sites.values()), "sites": recorder.report(),
              "unattributed": recorder.unattributed,
              "allowed": [f"{f}::{fn}" for f, fn in sorted(ALLOWED)]}
    path.write_text(json.dumps(report, indent=1))
    print(f"sync_debug: {report['total']} synchronizations in one steady {precision} step "
          f"({units} units, {NUM_MICROBATCHES} micro-batches) -> {path}")
    for site in report["sites"]:
        print(f"  {site['count']:4d}  {site['file']}:{site['line']} ({site['function']}) "
              f"[{', '.join(site['threads'])}]")
    return path


@pytest.fixture(scope="module", params=["bf16", "fp16"])
def steady_step(gpu_world, tmp_path_factory, request):
    """One recorded steady step per precision for the module's tests, and its report."""
    offload_dir = tmp_path_factory.mktemp("offload")
    recorder, lm_loss, units = _steady_step(offload_dir, request.param)
    path = _write_report(recorder, units, request.param, tmp_path_factory.mktemp("report"))
    return recorder, lm_loss, units, path


def test_site_is_innermost_library_frame():
    """The attribution: the innermost frame inside the packages, not torch's or the test's."""
    import megatron.core
    import megatron_snake

    roots = _package_roots()
    snake = Path(megatron_snake.__file__).parent
    core = Path(megatron.core.__file__).parent
    stack = [traceback.FrameSummary(__file__, 10, "test"),
             traceback.FrameSummary(str(snake / "training" / "loop.py"), 40, "train"),
             traceback.FrameSummary(str(core / "pipeline_parallel" / "schedules.py"), 7, "f"),
             traceback.FrameSummary(str(snake / "training" / "loop.py"), 51, "_lm_loss"),
             traceback.FrameSummary(torch.__file__, 3, "item"),
             traceback.FrameSummary(__file__, 99, "showwarning")]
    assert site_of(stack, roots) == ("megatron_snake/training/loop.py", "_lm_loss", 51)
    assert site_of(stack[:3], roots) == \
        ("megatron/core/pipeline_parallel/schedules.py", "f", 7)
    assert site_of([stack[0], stack[4]], roots) is None
    genexpr = traceback.FrameSummary(str(snake / "training" / "loop.py"), 45, "<genexpr>")
    assert site_of(stack[:4] + [genexpr], roots) == \
        ("megatron_snake/training/loop.py", "_lm_loss.<genexpr>", 45)
    assert allowed("megatron_snake/training/loop.py", "_lm_loss.<genexpr>")
    assert not allowed("megatron_snake/training/loop.py", "train")


def test_recorder_attributes_warnings_to_library_call_sites(gpu_world):
    """End to end through the warnings machinery, with torch's warning simulated: every
    ``Tensor.item()`` warns as sync debug mode would, from the loop's _lm_loss (on the main
    thread) and from a worker thread; both land on _lm_loss's line, counted per call. On a
    CUDA DEVICE torch's own warning for the same .item() comes on top of each."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.overrides import TorchFunctionMode

    from megatron_snake.training import loop

    class ItemWarns(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.item:
                warnings.warn(f"called a {SYNC_MESSAGE}", UserWarning)
            return func(*args, **(kwargs or {}))

    # each micro-batch's (loss sum, token count): 8 tokens at mean losses 1, 2 and 3
    reports = [{"lm loss": torch.tensor([8.0 * (i + 1), 8.0], device=DEVICE)}
               for i in range(3)]

    def lm_loss():
        with ItemWarns():
            return loop._lm_loss(reports, DEVICE)

    with record_syncs() as recorder:
        assert lm_loss() == 2.0
        warnings.warn("an unrelated warning")      # not a sync: not counted
        with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
            assert pool.submit(lm_loss).result() == 2.0
    assert not recorder.unattributed
    [(site, count)] = recorder.sites.items()
    per_call = 2 if DEVICE.type == "cuda" else 1   # simulated (+ torch's own on CUDA)
    assert site[:2] == ("megatron_snake/training/loop.py", "_lm_loss"), site
    assert count == 2 * per_call, (site, count)
    assert len(recorder.threads[site]) == 2 and allowed(*site[:2])


def test_steady_step_report(steady_step):
    """The step runs under the recorder and its report is written (on the CPU: no sync
    warnings at all, torch has nothing to synchronize)."""
    recorder, _, units, path = steady_step
    report = json.loads(path.read_text())
    assert report["units"] == units == NUM_LAYERS
    assert report["total"] == sum(s["count"] for s in report["sites"]) == \
        sum(recorder.sites.values())
    if DEVICE.type != "cuda":
        assert report["total"] == 0 and not report["unattributed"], report


@requires_cuda
def test_steady_step_syncs_only_at_allowed_sites(steady_step):
    recorder, _, units, _ = steady_step
    assert not recorder.unattributed, \
        "synchronizations outside megatron_snake/ and megatron/:\n" + \
        "\n".join(recorder.unattributed)
    unexpected = {f"{f}:{ln} ({fn})": n for (f, fn, ln), n in recorder.sites.items()
                  if not allowed(f, fn)}
    assert not unexpected, f"synchronizing calls outside ALLOWED: {unexpected}"
    bound = SYNCS_PER_UNIT * units + STEP_BOUNDARY_SYNCS
    assert bound < NUM_MICROBATCHES * units, "the bound must not allow one per (unit, mb)"
    total = sum(recorder.sites.values())
    assert total <= bound, f"{total} synchronizations in one step (bound {bound})"
