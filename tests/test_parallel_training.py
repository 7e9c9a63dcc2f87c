"""pretrain_gpt's loop under TP x PP (spawn, gloo) with --snake-offload: the numbers of
Megatron's own run, per-rank offload directories, one start-up error for a bad rank, and a
clear failure when a rank dies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import expect_flag_error
from megatron_snake.training.distributed import free_port, local_rank_env

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "3e-3", "--lr-warmup-iters", "1", "--device", "cpu",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
         "--disable-bias-linear"]


def _pretrain_main(rank, world, port, root, parallel, snake_flags):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(local_rank_env(rank, world, port))
    torch.set_num_threads(1)
    from megatron_snake.training import distributed
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    from megatron_snake.training import loop

    flags = [*FLAGS, *parallel, "--train-iters", "3"]
    megatron = pretrain(parse_args(flags))
    files = {}
    real_train = loop.Trainer.train

    def train_then_list_files(trainer):  # the store removes its files when it closes
        out = real_train(trainer)
        store = trainer.run.tensor_store
        files["dir"] = store.dir.path
        files["paths"] = sorted({path for key in store.keys()
                                 for path, _, _ in store.location(key)})
        return out

    loop.Trainer.train = train_then_list_files
    snake = pretrain(parse_args([*flags, "--snake-offload", "--snake-offload-dir",
                                 os.path.join(root, "{rank}"), "--save",
                                 os.path.join(root, "ckpt"), *snake_flags]))
    with open(os.path.join(root, f"losses{rank}.json"), "w") as f:
        json.dump({"megatron": megatron, "snake": snake, "files": files}, f)
    distributed.shutdown()


@pytest.mark.parametrize("name,world,parallel,snake_flags", [
    ("tp2xpp2", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--clip-grad", "0.5", "--untie-embeddings-and-output-weights"],
     ["--snake-group-size", "2"]),
    # tied: the embedding's two copies (first and last stage) get one summed gradient, and
    # the clipping norm counts it once
    ("pp2xdp2-tied", 4, ["--pipeline-model-parallel-size", "2", "--clip-grad", "0.3"],
     ["--snake-group-size", "1", "--snake-activation-tier", "auto", "--snake-profile-iters", "1"]),
])
def test_pretrain_parallel_snake_matches_megatron(tmp_path, name, world, parallel, snake_flags):
    for rank in range(world):
        (tmp_path / str(rank)).mkdir()
    mp.spawn(_pretrain_main, args=(world, free_port(), str(tmp_path), parallel, snake_flags),
             nprocs=world, join=True)
    runs = [json.loads((tmp_path / f"losses{r}.json").read_text()) for r in range(world)]
    for run in runs:
        assert run["megatron"] == runs[0]["megatron"], "every rank logs the last stage's loss"
        assert run["snake"] == runs[0]["snake"]
    for a, b in zip(runs[0]["megatron"], runs[0]["snake"]):
        assert abs(a - b) <= 1e-5 * abs(a), runs[0]
    for rank, run in enumerate(runs):  # {rank} in the template: each rank's files its own
        mine = str(tmp_path / str(rank) / f"rank{rank}")
        assert run["files"]["dir"] == mine
        assert run["files"]["paths"], "the offloaded state is in files"
        assert all(os.path.dirname(p) == mine for p in run["files"]["paths"]), run["files"]
    # Megatron's torch_dist files: every rank writes its own share (its TP / PP shard, and
    # under DP its element range of each unit)
    saved = sorted(os.listdir(tmp_path / "ckpt" / "iter_0000003"))
    assert saved == [".metadata", *[f"__{r}_0.distcp" for r in range(world)], "common.pt",
                     "metadata.json"]


def _launch(rank, world, port, extra, log_dir):
    env = {**os.environ, **local_rank_env(rank, world, port), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    log = open(log_dir / f"rank{rank}.log", "w")
    return subprocess.Popen([sys.executable, str(REPO / "examples" / "pretrain_gpt.py"),
                             *FLAGS, *extra], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO)


def _wait_all(procs, timeout):
    deadline = time.time() + timeout
    for p in procs:
        p.wait(timeout=max(deadline - time.time(), 1))
    return [p.returncode for p in procs]


def test_unwritable_rank_directory_fails_every_rank_at_start(tmp_path):
    """Rank 1's directory is missing: both ranks stop before the first step with exit
    status 1; rank 0 prints the one line naming rank 1 and the path, rank 1 (whose refusal
    is the same) prints nothing more, and neither prints a traceback."""
    (tmp_path / "0").mkdir()
    port = free_port()
    extra = ["--pipeline-model-parallel-size", "2", "--train-iters", "2", "--snake-offload",
             "--snake-offload-dir", str(tmp_path / "{rank}")]
    procs = [_launch(r, 2, port, extra, tmp_path) for r in range(2)]
    assert _wait_all(procs, 240) == [1, 1]
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(2)]
    refusal = [line for line in logs[0].splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(refusal) == 1, logs[0][-3000:]
    assert "--snake-offload-dir check failed on 1 of 2 ranks" in refusal[0]
    assert "rank 1:" in refusal[0] and str(tmp_path / "1") in refusal[0], refusal
    assert "error:" not in logs[1], logs[1][-3000:]
    for out in logs:
        assert "Traceback" not in out, out[-3000:]
        assert not re.search(r"iteration\s+\d+/", out), "no step may run"


def _wait_for_iteration_2(proc, log) -> None:
    """Until rank 0 has logged iteration 2 (training runs), failing if it exits first."""
    deadline = time.time() + 240
    while "iteration        2" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def test_killed_rank_makes_the_others_fail_clearly(tmp_path):
    """SIGKILL one pipeline stage mid-run: the other exits with an error naming the lost
    rank's peers, within the timeout, instead of hanging."""
    port = free_port()
    extra = ["--pipeline-model-parallel-size", "2", "--train-iters", "100000",
             "--log-interval", "1", "--snake-offload", "--distributed-timeout-minutes", "1"]
    procs = [_launch(r, 2, port, extra, tmp_path) for r in range(2)]
    log0 = tmp_path / "rank0.log"
    _wait_for_iteration_2(procs[0], log0)
    procs[1].send_signal(signal.SIGKILL)
    start = time.time()
    try:
        procs[0].wait(timeout=120)
    finally:
        procs[0].kill()
    assert procs[0].returncode not in (0, None)
    assert time.time() - start < 120
    out = log0.read_text()
    assert "lost contact with another rank" in out, out[-3000:]


def test_stalled_rank_fails_the_others_within_the_timeout(tmp_path):
    """SIGSTOP one tensor-parallel rank mid-run (alive, silent): its peer's next collective
    in Megatron's TP group gives up after --distributed-timeout-minutes, not Megatron's
    default 30 minutes, and says a rank was lost."""
    port = free_port()
    extra = ["--tensor-model-parallel-size", "2", "--train-iters", "100000",
             "--log-interval", "1", "--snake-offload", "--distributed-timeout-minutes", "0.5"]
    procs = [_launch(r, 2, port, extra, tmp_path) for r in range(2)]
    log0 = tmp_path / "rank0.log"
    try:
        _wait_for_iteration_2(procs[0], log0)
        procs[1].send_signal(signal.SIGSTOP)
        start = time.time()
        procs[0].wait(timeout=150)
        waited = time.time() - start
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode not in (0, None)
    # 30 s, plus start-up slack on a loaded 2-core machine (Megatron's default: 1800 s)
    assert waited < 120, f"rank 0 waited {waited:.0f} s for a 30 s timeout"
    out = log0.read_text()
    assert "lost contact with another rank" in out, out[-3000:]


@pytest.mark.parametrize("world,flags,flag_named,says", [
    (1, ["--snake-offload", "--global-batch-size", "8", "--snake-group-size", "3"],
     "--snake-group-size", "must divide the 4 micro-batches"),
    (2, ["--snake-offload", "--pipeline-model-parallel-size", "2", "--num-layers", "3",
         "--untie-embeddings-and-output-weights"],
     "--pipeline-model-parallel-size", "--num-layers 3 is not divisible by 2 stages"),
    (1, ["--snake-group-size", "2"], "--snake-group-size", "add --snake-offload"),
    (1, ["--snake-offload", "--snake-schedule", "horizontal", "--snake-group-size", "2"],
     "--snake-group-size", "horizontal"),
    (2, ["--sequence-parallel", "--tensor-model-parallel-size", "2"], "--sequence-parallel",
     "transformer_engine"),
    (1, ["--sequence-parallel"], "--sequence-parallel", "needs --tensor-model-parallel-size"),
    (2, ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--transformer-impl",
         "transformer_engine", "--snake-offload"], "--sequence-parallel",
     "not supported with --snake-offload"),
    (2, ["--snake-activation-offload", "--snake-activation-tier", "nvme",
         "--pipeline-model-parallel-size", "2"], "--snake-activation-offload",
     "no-pipelining schedule"),
])
def test_bad_parallel_flags_fail_naming_the_flag(monkeypatch, capsys, world, flags, flag_named,
                                                 says):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    err = expect_flag_error(capsys, flags, flag_named)
    assert f"error: {flag_named}" in err and says in err, err


@pytest.mark.parametrize("micro_batches,stages,expected", [(8, 1, 8), (8, 2, 2), (16, 2, 4),
                                                           (6, 3, 1), (32, 4, 2)])
def test_default_group_size_keeps_at_least_4_groups_per_extra_stage(micro_batches, stages,
                                                                    expected):
    from megatron_snake.schedule.pipeline import default_group_size

    assert default_group_size(micro_batches, stages) == expected


def test_offload_dir_template_fields(monkeypatch):
    from megatron_snake.training.offloaded_state import offload_dirs_for_rank

    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert offload_dirs_for_rank("/nvme/{node}/{local_rank}/r{rank}", 13) == ["/nvme/3/1/r13"]
    assert offload_dirs_for_rank("/plain/dir", 5) == ["/plain/dir"]
    with pytest.raises(ValueError, match=r"--snake-offload-dir.*\{node\}"):
        offload_dirs_for_rank("/nvme/{nodes}", 0)
