"""A user's mistakes, each run as ``examples/pretrain_gpt.py`` would be: one message on one
line naming the flag or path, no traceback, exit status 2 for a refused command line and 1
for a run refused at start (flags, paths, permissions, space, pre-flight, checkpoints, data).
``SNAKE_DEBUG=1`` brings the traceback back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_data import corpus  # noqa: F401  (the module's fixture: a preprocessed corpus)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--device", "cpu", "--num-workers", "0"]


@pytest.fixture(scope="module")
def saved_format():
    return "torch"


@pytest.fixture(scope="module")
def places(tmp_path_factory, saved, corpus):  # noqa: F811
    """Paths the mistakes refer to, made once: a real checkpoint (iteration 2, from
    conftest's ``saved``), a directory of saved iterations without a tracker, a dataset
    whose .bin is one byte short, a file where a directory is expected."""
    d = tmp_path_factory.mktemp("places")
    untracked = d / "untracked"
    shutil.copytree(saved, untracked)
    (untracked / "latest_checkpointed_iteration.txt").unlink()
    flipped = d / "flipped"
    shutil.copytree(saved, flipped)
    state = flipped / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x10
    state.write_bytes(bytes(data))
    short = str(d / "short_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(corpus["txt_prefix"] + suffix, short + suffix)
    os.truncate(short + ".bin", os.path.getsize(short + ".bin") - 1)
    a_file = d / "a_file"
    a_file.write_text("not a directory")
    return {"saved": str(saved), "untracked": str(untracked), "flipped": str(flipped),
            "short": short, "file": str(a_file), "dir": str(d)}


# (name, flags (a function of the paths), exit status, what the message must name)
MISTAKES = [
    ("batch not divisible", lambda p: ["--global-batch-size", "7"], 2, "--global-batch-size"),
    ("unknown flag", lambda p: ["--snake-ofload"], 2, "--snake-ofload"),
    ("lr nan", lambda p: ["--lr", "nan"], 2, "--lr"),
    ("adam beta1 1.0", lambda p: ["--adam-beta1", "1.0"], 2, "--adam-beta1"),
    ("negative seed", lambda p: ["--seed", "-1"], 2, "--seed"),
    ("min bytes 0", lambda p: ["--snake-activation-offload-min-bytes", "0"], 2,
     "--snake-activation-offload-min-bytes"),
    ("tensor parallel beyond the world", lambda p: ["--tensor-model-parallel-size", "2"], 2,
     "--tensor-model-parallel-size"),
    ("unit larger than the stage", lambda p: ["--snake-offload",
                                             "--snake-checkpoint-interval", "3"], 2,
     "--snake-checkpoint-interval"),
    ("snake flag without --snake-offload", lambda p: ["--snake-alpha", "0.3"], 2,
     "--snake-alpha"),
    ("host pool below two buffers", lambda p: ["--snake-offload",
                                              "--snake-host-memory-limit", "1KiB"], 2,
     "--snake-host-memory-limit"),
    ("host pool beyond the machine", lambda p: ["--snake-offload", "--snake-host-memory-limit",
                                               "99999999999GiB"], 2,
     "--snake-host-memory-limit"),
    ("GPT-2 tokenizer without its files", lambda p: ["--tokenizer-type", "GPT2BPETokenizer"],
     2, "--vocab-file"),
    ("unknown hardware profile", lambda p: ["--snake-offload", "--snake-dry-run",
                                           "--snake-hardware", "no_such_profile"], 2,
     "--snake-hardware"),
    ("trace into a missing directory", lambda p: ["--snake-trace", "/nonexistent/t.json"], 2,
     "--snake-trace"),
    ("missing --load directory", lambda p: ["--load", "/nonexistent/ckpt"], 2, "--load"),
    ("empty --save", lambda p: ["--save", ""], 2, "--save"),
    ("--ckpt-step without --load", lambda p: ["--ckpt-step", "2"], 2, "--ckpt-step"),
    ("missing dataset", lambda p: ["--data-path", "/nonexistent/corpus_text_document"], 1,
     "/nonexistent/corpus_text_document"),
    ("dataset .bin one byte short", lambda p: ["--data-path", p["short"]], 1,
     "short_text_document.bin"),
    ("missing offload directory", lambda p: ["--snake-offload", "--snake-offload-dir",
                                            "/nonexistent/nvme"], 1, "/nonexistent/nvme"),
    ("offload directory is a file", lambda p: ["--snake-offload", "--snake-offload-dir",
                                              p["file"]], 1, "a_file"),
    ("GPU memory limit below a unit", lambda p: ["--snake-offload",
                                                "--snake-gpu-memory-limit", "1KiB"], 1,
     "--snake-gpu-memory-limit"),
    ("dry run that does not fit", lambda p: ["--snake-offload", "--snake-dry-run",
                                            "--num-layers", "80", "--hidden-size", "8192",
                                            "--num-attention-heads", "64",
                                            "--snake-offload-dir", p["dir"]], 1,
     "does not fit: --snake-offload-dir"),
    ("iterations without a tracker", lambda p: ["--load", p["untracked"], "--save",
                                               p["untracked"]], 1, "--ckpt-step 2"),
    ("--save over another run's iteration", lambda p: ["--save", p["saved"]], 1,
     "already holds iteration 2"),
    ("a checkpoint with a flipped byte", lambda p: ["--load", p["flipped"]], 1,
     "checksum mismatch"),
    ("--ckpt-step of a missing iteration", lambda p: ["--load", p["saved"], "--ckpt-step",
                                                     "3"], 1, "iter_0000003 does not exist"),
    ("a checkpoint of another model", lambda p: ["--load", p["saved"], "--hidden-size", "64",
                                                "--train-iters", "4"], 1,
     "--hidden-size saved 32 now 64"),
]


def _run(flags, tmp_path, **env):
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, SCRIPT, *TINY, *flags], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                                   TMPDIR=str(tmp), **env))


@pytest.mark.parametrize("name, flags, status, named", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_is_one_line_naming_it(places, tmp_path, name, flags, status, named):
    proc = _run(flags(places), tmp_path)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == status, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("pretrain_gpt.py: error: "), \
        proc.stderr[-3000:]
    assert named in errors[0], errors[0]


def test_there_are_at_least_25_of_them():
    assert len(MISTAKES) >= 25


def test_snake_debug_shows_the_traceback(places, tmp_path):
    proc = _run(["--data-path", places["short"]], tmp_path, SNAKE_DEBUG="1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "DataError" in proc.stderr, proc.stderr[-2000:]
