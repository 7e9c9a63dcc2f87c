"""Preemption: SIGTERM with --exit-signal-handler saves, leaves no offload files and resumes
exactly; --exit-duration-in-mins stops the same way; a run killed outright leaves its
temporary offload directory, and the next start removes it (and only what it can prove
dead)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys

from megatron_snake.storage.temp_dirs import PREFIX, _host, sweep_dead_temp_offload_dirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
         "--device", "cpu", "--snake-offload", "--train-iters", "8", "--log-interval", "1"]


def _env(tmp_path) -> dict:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TMPDIR=str(tmp))


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]


def _run(tmp_path, *extra) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, SCRIPT, *FLAGS, *extra], capture_output=True,
                          text=True, env=_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _start_and_signal(tmp_path, sig, *extra, after_iteration=2):
    """Start a run and send ``sig`` to its whole process group (as torchrun and Slurm do:
    the DataLoader's worker processes get it too) once it has logged ``after_iteration``."""
    proc = subprocess.Popen([sys.executable, SCRIPT, *FLAGS, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(tmp_path),
                            start_new_session=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if re.search(rf"iteration +{after_iteration}/", line):
            os.killpg(proc.pid, sig)
            break
    rest, err = proc.communicate(timeout=600)
    return proc.returncode, "".join(out) + rest, err


def _offload_dirs(tmp_path) -> list[str]:
    return sorted(p for p in os.listdir(tmp_path / "tmp") if p.startswith(PREFIX))


def test_sigterm_saves_cleans_up_and_resumes_exactly(tmp_path):
    """With --num-workers' default of 2 DataLoader workers, which get the signal too."""
    full = _losses(_run(tmp_path).stdout)
    ckpt = tmp_path / "ckpt"
    code, out, err = _start_and_signal(tmp_path, signal.SIGTERM, "--exit-signal-handler",
                                       "--save", str(ckpt))
    assert code == 0, err[-3000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 8, out[-2000:]
    assert f"exiting at iteration {saved}: SIGTERM received" in out
    assert _offload_dirs(tmp_path) == [], "the offload files are removed on the way out"
    resumed = _losses(_run(tmp_path, "--load", str(ckpt)).stdout)
    assert resumed == full[saved:]


def test_sigterm_without_the_handler_still_kills(tmp_path):
    """Without --exit-signal-handler SIGTERM keeps its default meaning."""
    code, out, _ = _start_and_signal(tmp_path, signal.SIGTERM)
    assert code == -signal.SIGTERM
    assert "exiting at iteration" not in out


def test_exit_duration_stops_and_saves(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _run(tmp_path, "--exit-duration-in-mins", "1e-6", "--save", str(ckpt)).stdout
    assert "exiting at iteration 1: --exit-duration-in-mins" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_a_killed_runs_temporary_directory_is_removed_by_the_next_start(tmp_path):
    code, _, err = _start_and_signal(tmp_path, signal.SIGKILL, after_iteration=1)
    assert code == -signal.SIGKILL
    left = _offload_dirs(tmp_path)
    assert len(left) == 1 and os.listdir(tmp_path / "tmp" / left[0] / "rank0"), left
    proc = _run(tmp_path, "--train-iters", "1")
    assert _offload_dirs(tmp_path) == []
    assert left[0] in proc.stderr     # said what it removed


def test_the_sweep_removes_only_what_it_can_prove_dead(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = _host()
        made = {}
        for label, name in [("dead", f"{PREFIX}{host}_{dead.pid}_a"),
                            ("alive", f"{PREFIX}{host}_{alive.pid}_b"),
                            ("other host", f"{PREFIX}not-{host}_{dead.pid}_c"),
                            ("not ours", f"other_{host}_{dead.pid}_d")]:
            (tmp_path / name).mkdir()
            (tmp_path / name / "x.swap").write_bytes(b"x")
            made[label] = tmp_path / name
        target = tmp_path / "precious"
        target.mkdir()
        (target / "keep").write_text("keep")
        os.symlink(target, tmp_path / f"{PREFIX}{host}_{dead.pid}_link")
        # a "dead" pid whose store still holds its lock (another pid namespace) stays
        held = tmp_path / f"{PREFIX}{host}_{dead.pid}_held"
        (held / "rank0").mkdir(parents=True)
        lock_fd = os.open(held / "rank0" / "LOCK", os.O_RDWR | os.O_CREAT)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        removed = sweep_dead_temp_offload_dirs(str(tmp_path))
        os.close(lock_fd)
        assert held.exists()
        assert removed == [str(made["dead"])]
        assert not made["dead"].exists()
        assert all(made[k].exists() for k in ("alive", "other host", "not ours"))
        assert (target / "keep").read_text() == "keep"   # a link is never followed
        assert (tmp_path / f"{PREFIX}{host}_{dead.pid}_link").is_symlink()
    finally:
        alive.kill()
        alive.wait()
