"""Experiment tracking and the log a Megatron-LM user reads: TensorBoard scalars under
Megatron's names, wandb offline files, a --profile trace, per-interval figures that add up
to the run's totals, and one clear error for each tracking flag that cannot work."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from conftest import expect_flag_error
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cpu",
         "--train-iters", "4", "--log-interval", "2"]


def _scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_megatron_scalars_and_the_stores(megatron_world, tmp_path):
    tb = tmp_path / "tb"
    losses = pretrain(parse_args([*SMALL, "--snake-offload", "--tensorboard-dir", str(tb)]))
    scalars = _scalars(tb)
    # every iteration: Megatron-LM's names
    assert [step for step, _ in scalars["lm loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["lm loss"]] == pytest.approx(losses, rel=1e-6)
    for tag in ("learning-rate", "grad-norm", "batch-size"):
        assert len(scalars[tag]) == 4, tag
    # every log interval: throughput, memory, and the store's bytes and waits
    for tag in ("iteration-time", "throughput", "tokens-per-sec", "mem-peak-rss-bytes",
                "snake/nvme-read-bytes", "snake/nvme-write-bytes",
                "snake/other-io-wait-seconds", "snake/io-overlap-fraction"):
        assert [step for step, _ in scalars[tag]] == [2, 4], tag
    assert all(v > 0 for _, v in scalars["snake/nvme-read-bytes"])
    assert all(0.0 <= v <= 1.0 for _, v in scalars["snake/io-overlap-fraction"])
    assert oct(os.stat(tb).st_mode & 0o777) == "0o755"


def test_wandb_offline_writes_its_run_files(megatron_world, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save_dir = tmp_path / "wb"
    pretrain(parse_args([*SMALL, "--wandb-project", "snake-test", "--wandb-exp-name", "t1",
                         "--wandb-save-dir", str(save_dir)]))
    runs = glob.glob(str(save_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1, os.listdir(save_dir)
    assert glob.glob(os.path.join(runs[0], "run-*.wandb")), os.listdir(runs[0])


def test_profile_writes_a_trace_of_the_asked_iterations(megatron_world, tmp_path):
    pretrain(parse_args([*SMALL, "--snake-offload", "--tensorboard-dir", str(tmp_path),
                         "--profile", "--profile-step-start", "1", "--profile-step-end", "3"]))
    path = tmp_path / "rank0.iter1-3.pt.trace.json"
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    # the step's named ranges appear, once per profiled iteration
    steps = [e for e in trace["traceEvents"] if e.get("name") == "snake/forward_backward"]
    assert len(steps) == 2, sorted(n for n in names if n)[:50]
    assert not list(tmp_path.glob("*.part"))


def test_log_lines_are_per_interval_and_add_up_to_the_run_total(megatron_world, tmp_path,
                                                                capsys):
    pretrain(parse_args([*SMALL, "--snake-offload", "--train-iters", "6", "--snake-param-tier",
                         "nvme", "--snake-activation-tier", "host", "--snake-log-details"]))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "| lm loss:" in line]
    assert len(lines) == 3
    reads = [float(m) for m in re.findall(r"nvme r/w \(interval\) ([0-9.]+) MiB/", out)]
    assert len(reads) == 3 and all(r > 0 for r in reads)
    total = re.search(r"store traffic \(whole run\): nvme r/w ([0-9.]+) (MiB|GiB)/", out)
    total_mib = float(total.group(1)) * (1024 if total.group(2) == "GiB" else 1)
    # the intervals cover the training steps; the total also has the set-up's traffic
    assert sum(reads) <= total_mib + 0.2
    assert sum(reads) > 0.5 * total_mib
    assert "(cumulative) " not in out.replace("host pool peak (cumulative)", "")
    assert re.search(r"M parameters on this rank, [0-9.]+M in the whole model", out)
    assert "Unable to save MockGPTDataset indexes" not in out + capsys.readouterr().err


def test_megatron_defaults_for_log_interval_and_eval_iters():
    args = parse_args([])
    assert (args.log_interval, args.eval_iters) == (100, 100)


@pytest.mark.parametrize("flags, named", [
    (["--profile", "--train-iters", "20"], "--profile"),
    (["--profile", "--tensorboard-dir", "tb", "--profile-step-start", "5",
      "--profile-step-end", "5"], "--profile-step-end"),
    (["--profile", "--tensorboard-dir", "tb", "--profile-ranks", "1", "--train-iters", "20"],
     "--profile-ranks"),
    (["--wandb-exp-name", "x"], "--wandb-exp-name"),
    (["--wandb-save-dir", "x"], "--wandb-save-dir"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins"),
])
def test_tracking_flags_that_cannot_work_are_refused(capsys, flags, named):
    expect_flag_error(capsys, flags, named)


def test_a_tracking_directory_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    expect_flag_error(capsys, ["--tensorboard-dir", str(tmp_path / "f")], "--tensorboard-dir")


def test_a_tracking_directory_that_is_a_link_is_refused(capsys, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    expect_flag_error(capsys, ["--tensorboard-dir", str(tmp_path / "link")], "--tensorboard-dir")


def test_a_missing_tracking_library_is_named(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    err = expect_flag_error(capsys, ["--wandb-project", "p"], "--wandb-project")
    assert "pip install wandb" in err


def test_saving_and_evaluating_stay_out_of_the_interval(megatron_world, tmp_path, capsys,
                                                        monkeypatch):
    """A save (made slow here) after iteration 2 is not charged to iterations 3-4."""
    import time

    from megatron_snake.training.loop import Trainer

    real_save = Trainer.save

    def slow_save(self):
        time.sleep(1.5)
        real_save(self)

    monkeypatch.setattr(Trainer, "save", slow_save)
    pretrain(parse_args([*SMALL, "--snake-offload", "--save", str(tmp_path),
                         "--save-interval", "2"]))
    times = [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                          capsys.readouterr().out)]
    assert len(times) == 2 and times[1] < 700, times


def test_a_world_writable_tracking_directory_is_refused(megatron_world, tmp_path):
    from megatron_snake.training.tracking import own_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="writable by every user"):
        own_dir(str(shared), "--tensorboard-dir")
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, 0o775)
    own_dir(str(team), "--tensorboard-dir")          # a group directory is taken as it is
    assert oct(os.stat(team).st_mode & 0o777) == "0o775"
