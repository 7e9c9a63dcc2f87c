"""Megatron-LM's checkpoint options: --finetune, --pretrained-checkpoint, --no-save-optim,
--no-save-rng, a global batch size changed on resume, and a load into another parallel
layout that says which setting differs. Snake and Megatron's own schedule are held to the
same losses wherever both run."""

from __future__ import annotations

import os
import shutil

import pytest

from megatron_snake.training.arguments import parse_args
from megatron_snake.training.checkpoint_dir import CheckpointChoiceError
from megatron_snake.training.checkpointing import CheckpointMismatchError
from megatron_snake.training.loop import pretrain

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
         "--device", "cpu", "--lr", "3e-3", "--lr-decay-style", "constant", "--seed", "3",
         "--num-workers", "0"]
SNAKE = ["--snake-offload"]


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and a, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


@pytest.fixture(scope="module")
def trained(megatron_world, tmp_path_factory):
    """A 4-iteration snake checkpoint, and one saved without optimizer and RNG state."""
    root = tmp_path_factory.mktemp("ckpt")
    full = pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "4", "--save",
                                str(root / "full")]))
    pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "4", "--save", str(root / "lean"),
                         "--no-save-optim", "--no-save-rng"]))
    pretrain(parse_args([*FLAGS, "--train-iters", "4", "--save", str(root / "plain")]))
    return root, full


@pytest.mark.parametrize("snake", [True, False])
def test_finetune_takes_the_weights_and_starts_at_iteration_zero(trained, snake):
    root, _ = trained
    extra = SNAKE if snake else []
    tuned = pretrain(parse_args([*FLAGS, *extra, "--train-iters", "3", "--load",
                                 str(root / "full"), "--finetune"]))
    assert len(tuned) == 3           # iterations 1..3 of a new run, not 5..7
    # the same as a fresh optimizer on the loaded weights, whichever schedule runs it
    other = pretrain(parse_args([*FLAGS, *([] if snake else SNAKE), "--train-iters", "3",
                                 "--load", str(root / "lean"), "--finetune"]))
    _close(tuned, other)


def test_pretrained_checkpoint_is_used_when_load_has_none(trained, tmp_path):
    root, _ = trained
    new = tmp_path / "new"          # --load and --save: the usual job script, first run
    flags = [*FLAGS, *SNAKE, "--train-iters", "3", "--load", str(new), "--save", str(new),
             "--pretrained-checkpoint", str(root / "full")]
    first = pretrain(parse_args([*flags, "--exit-interval", "2"]))
    tuned = pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "3", "--load",
                                 str(root / "full"), "--finetune"]))
    assert first == tuned[:2]
    # the next start finds its own checkpoint in --load and resumes it instead
    again = pretrain(parse_args(flags))
    assert again == tuned[2:]


def test_no_save_optim_needs_no_load_optim(trained, capsys):
    root, _ = trained
    with pytest.raises(ValueError, match="--no-save-optim.*--no-load-optim"):
        pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "6", "--load",
                             str(root / "lean"), "--no-load-rng"]))
    with pytest.raises(ValueError, match="--no-save-rng.*--no-load-rng"):
        pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "6", "--load",
                             str(root / "lean"), "--no-load-optim"]))
    went_on = pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "6", "--load",
                                   str(root / "lean"), "--no-load-optim", "--no-load-rng"]))
    assert len(went_on) == 2
    lean = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root / "lean")
               for f in fs)
    full = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root / "full")
               for f in fs)
    assert lean < full / 2, (lean, full)   # no master weights, no moments


def test_global_batch_size_may_change_on_resume(trained):
    """As in Megatron-LM: the data goes on from the consumed samples, and the schedule (in
    samples) needs one of the scheduler flags. Snake resumed from its checkpoint trains as
    Megatron's schedule resumed from its own."""
    root, _ = trained
    base = [*FLAGS, "--train-iters", "6", "--global-batch-size", "8"]
    with pytest.raises(ValueError, match="--use-checkpoint-opt_param-scheduler"):
        pretrain(parse_args([*base, *SNAKE, "--load", str(root / "full")]))
    keep = "--use-checkpoint-opt_param-scheduler"
    snake = pretrain(parse_args([*base, *SNAKE, keep, "--load", str(root / "full")]))
    megatron = pretrain(parse_args([*base, keep, "--load", str(root / "plain")]))
    _close(snake, megatron)


@pytest.mark.parametrize("renamed, says", [
    (["mp_rank_00_dp000", "mp_rank_00_dp001"], "data-parallel shards 2 there, 1 here"),
    (["mp_rank_00_000", "mp_rank_00_001"], "pipeline-model-parallel-size 2 there, 1 here"),
])
def test_another_parallel_layout_is_named(megatron_world, tmp_path, renamed, says):
    """The torch format loads into the layout it was saved with only: rank directories as a
    DP = 2 offloaded run or a PP = 2 run names them (a TP change finds its file and is
    refused by the saved flags)."""
    copy = tmp_path / "copy"
    pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "4", "--save", str(copy),
                         "--ckpt-format", "torch"]))
    it = copy / "iter_0000004"
    for name in renamed:
        shutil.copytree(it / "mp_rank_00", it / name)
    shutil.rmtree(it / "mp_rank_00")
    with pytest.raises(CheckpointMismatchError) as caught:
        pretrain(parse_args([*FLAGS, *SNAKE, "--train-iters", "6", "--load", str(copy)]))
    assert says in str(caught.value), caught.value


@pytest.mark.parametrize("flags, named", [
    (["--finetune"], "--finetune"),
    (["--pretrained-checkpoint", "/no/such/dir"], "--pretrained-checkpoint"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "--override-opt_param-scheduler"),
])
def test_bad_checkpoint_flags(capsys, flags, named):
    from conftest import expect_flag_error

    expect_flag_error(capsys, flags, named)


def test_an_empty_load_directory_starts_from_scratch_unless_refused(megatron_world, tmp_path,
                                                                    capsys):
    flags = [*FLAGS, *SNAKE, "--train-iters", "2"]
    fresh = pretrain(parse_args(flags))
    (tmp_path / "empty").mkdir()
    assert pretrain(parse_args([*flags, "--load", str(tmp_path / "empty")])) == fresh
    assert "holds no checkpoint yet: training starts from scratch" in capsys.readouterr().out
    with pytest.raises(CheckpointChoiceError, match="--exit-on-missing-checkpoint"):
        pretrain(parse_args([*flags, "--load", str(tmp_path / "empty"),
                             "--exit-on-missing-checkpoint"]))
