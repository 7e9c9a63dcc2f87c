"""Faults a user can give a run at start or meet during training, and what happens: a bad
flag value is refused naming the flag; a plan that cannot fit host memory or the drive is
refused before the first step with the total it needs; a NaN or Inf loss stops training
before it is logged as progress or saved. (Checkpoint, symlink, swap-file and rank faults
have their own modules; docs/reliability.md lists them all.)"""

from __future__ import annotations

import os
import re

import pytest

from conftest import expect_flag_error

SMALL = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode"]


@pytest.mark.parametrize("flags,flag_named,says", [
    (["--global-batch-size", "0"], "--global-batch-size", "must be >= 1"),
    (["--global-batch-size", "-8"], "--global-batch-size", "must be >= 1"),
    (["--log-interval", "0"], "--log-interval", "must be >= 1"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size", "must be >= 1"),
    (["--exit-interval", "-1"], "--exit-interval", "must be >= 1"),
    (["--train-iters", "0"], "--train-iters", "must be >= 1"),
    (["--snake-offload", "--snake-offload-dir", ""], "--snake-offload-dir", "empty path"),
    (["--save", ""], "--save", "empty path"),
    (["--snake-offload", "--snake-checkpoint-interval", "1000"], "--snake-checkpoint-interval",
     "more than the 4 layers"),
    (["--snake-offload", "--snake-host-memory-limit", "0"], "--snake-host-memory-limit",
     "at least 16MiB"),
    (["--snake-offload", "--clip-grad", "-1"], "--clip-grad", "must be >= 0"),
    (["--clip-grad", "-0.5"], "--clip-grad", "must be >= 0"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout", "between 0 and 1"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes", "must be > 0"),
    # NaN passed every `value < 0` check; these ended in torch errors or bare AssertionErrors
    (["--lr", "nan"], "--lr", "must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr", "must be a finite number >= 0, got inf"),
    (["--min-lr", "nan"], "--min-lr", "must be a finite number >= 0, got nan"),
    (["--weight-decay", "nan"], "--weight-decay", "must be a finite number >= 0, got nan"),
    (["--distributed-timeout-minutes", "nan"], "--distributed-timeout-minutes", "finite"),
    (["--adam-eps", "nan"], "--adam-eps", "must be a finite number > 0, got nan"),
    (["--adam-eps", "-1"], "--adam-eps", "must be > 0, got -1.0"),
    (["--adam-eps", "0"], "--adam-eps", "must be > 0, got 0.0"),
    (["--adam-beta1", "1.0"], "--adam-beta1", "must be in [0, 1), got 1.0"),
    (["--adam-beta1", "nan"], "--adam-beta1", "must be a finite number in [0, 1), got nan"),
    (["--adam-beta1", "-1"], "--adam-beta1", "must be in [0, 1), got -1.0"),
    (["--adam-beta2", "1.5"], "--adam-beta2", "must be in [0, 1), got 1.5"),
    (["--rotary-percent", "0"], "--rotary-percent", "must be in (0, 1], got 0.0"),
    (["--seed", "-1"], "--seed", "must be between 0 and 4294967295"),
    (["--seed", str(2 ** 32)], "--seed", "must be between 0 and 4294967295"),
    (["--seed", "1e20"], "--seed", "invalid int value: '1e20'"),   # argparse's own
    (["--lr-warmup-init", "1"], "--lr-warmup-init", "1.0 is larger than --lr 0.001"),
    (["--fp16", "--min-loss-scale", "1e10"], "--min-loss-scale",
     "is larger than --initial-loss-scale"),
    (["--snake-activation-offload", "--snake-activation-offload-min-bytes", "0"],
     "--snake-activation-offload-min-bytes", "must be >= 1, got 0"),
    # accepted before, and meaningless
    (["--clip-grad", "inf"], "--clip-grad", "must be >= 0 and finite"),
    (["--snake-offload", "--snake-host-memory-limit", "99999999999GiB"],
     "--snake-host-memory-limit", "99999999999.00 GiB is more than this machine's physical "
     "memory ("),
    (["--snake-trace", "trace.json", "--snake-trace-iteration", "21"], "--snake-trace-iteration",
     "21 is never reached in a run of --train-iters 20; give 1 to 20"),
    (["--snake-trace-iteration", "3"], "--snake-trace-iteration", "add --snake-trace FILE"),
])
def test_bad_flag_value_is_refused_naming_the_flag(capsys, flags, flag_named, says):
    """Each of these crashed deep inside (ZeroDivisionError, a bare AssertionError, a torch
    error), was silently misread (--exit-interval -1 stopped after one step, an empty offload
    directory became a temporary one, --clip-grad -1 trained uphill, a host pool larger than
    the machine bounded nothing), or was blamed on another flag."""
    err = expect_flag_error(capsys, flags, flag_named)
    assert says in err, err


def test_negative_clip_grad_is_refused_by_the_optimizer_too():
    """A library caller gets the command line's rule: a negative bound would flip the sign
    of every update (measured: loss 5.99 -> 7.19 where Megatron's path went to 4.82)."""
    from megatron_snake.optim.zenflow import ZenFlowAdamW

    with pytest.raises(ValueError, match="--clip-grad must be >= 0"):
        ZenFlowAdamW([], lr=1e-3, weight_decay=0.0, clip_grad=-1.0)


def test_a_host_pool_larger_than_the_machine_is_refused_where_it_is_made(monkeypatch):
    """The rule lives with the pool, so a library caller gets it too; a world the caller
    plans (tools/plan.py, for a hardware profile's machine) is not held to this one's
    memory."""
    from megatron_snake.storage import host_pool
    from megatron_snake.storage.errors import HostMemoryError
    from megatron_snake.training.arguments import parse_args

    monkeypatch.setattr(host_pool, "physical_memory_bytes", lambda: 1 << 30)
    with pytest.raises(HostMemoryError, match=r"--snake-host-memory-limit 2.00 GiB is more "
                       r"than this machine's physical memory \(1.00 GiB\)"):
        host_pool.HostBufferPool(2 << 30)
    planned = parse_args(["--snake-offload", "--snake-host-memory-limit", "99999999999GiB"],
                         world_size=1)
    assert planned.snake_host_memory_limit == 99999999999 << 30


def test_host_tiers_larger_than_the_limit_are_refused_at_start(megatron_world, tmp_path, capfd):
    """Host-tier weights and optimizer state that cannot fit --snake-host-memory-limit are
    refused while the state is built, with the total needed, before any step."""
    from megatron_snake.storage.errors import HostMemoryError
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    args = parse_args([*SMALL, "--train-iters", "2", "--snake-offload",
                       "--snake-offload-dir", str(tmp_path), "--snake-param-tier", "host",
                       "--snake-optimizer-tier", "host", "--snake-host-memory-limit", "64MiB"])
    with pytest.raises(HostMemoryError) as exc:
        pretrain(args)
    message = str(exc.value)
    # the pool: what the limit leaves after the optimizer's update outside it
    assert re.search(r"--snake-host-memory-limit 64\.0 MiB holds [78] host buffers", message), \
        message
    assert "raise --snake-host-memory-limit to at least" in message, message
    assert "iteration" not in capfd.readouterr().out


def test_a_host_limit_below_what_lives_outside_the_pool_is_one_line(megatron_world, tmp_path):
    """--snake-host-memory-limit bounds the pool and what the run holds outside it (the
    optimizer update's copies): a limit that leaves the pool fewer than its 2 buffers is
    refused at the pre-flight in one line naming the flag and the least value (the flag
    bounded the pool alone, and 16MiB ran with the update on top), and that value runs."""
    from megatron_snake.errors import UserError
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    flags = [*SMALL, "--train-iters", "1", "--snake-offload", "--snake-offload-dir",
             str(tmp_path)]
    with pytest.raises(UserError) as exc:
        pretrain(parse_args([*flags, "--snake-host-memory-limit", "16MiB"]))
    message = str(exc.value)
    assert "\n" not in message, message
    least = re.search(r"^--snake-host-memory-limit 16\.0 MiB cannot hold what the run keeps "
                      r"in host memory outside its pool, the optimizer's update .*: give at "
                      r"least --snake-host-memory-limit (\d+MiB)", message)
    assert least, message
    assert not os.path.exists(tmp_path / "rank0"), "refused before the store was made"
    assert len(pretrain(parse_args([*flags, "--snake-host-memory-limit", least.group(1)]))) == 1


def test_capacity_check_counts_checkpoints_saved_to_the_same_drive(megatron_world, tmp_path,
                                                                  monkeypatch):
    """--save on the offload drive: the start check adds every checkpoint the run will keep,
    so a drive that holds the offloaded state but not the checkpoints is refused at start
    instead of failing at a save hours later."""
    from megatron_snake.storage import directory
    from megatron_snake.storage.errors import CapacityError
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    monkeypatch.setattr(directory, "disk_free_bytes", lambda path: 300 << 20)
    offload = tmp_path / "offload"
    offload.mkdir()
    flags = [*SMALL, "--train-iters", "2000", "--snake-offload", "--snake-offload-dir",
             str(offload)]
    with pytest.raises(CapacityError, match="of --save checkpoints on the same file system"):
        pretrain(parse_args([*flags, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]))
    assert not (tmp_path / "ckpt").exists(), "refused before the first save"
    # without --save the same plan fits: the offloaded state alone is far below 300 MiB
    assert len(pretrain(parse_args([*flags, "--train-iters", "1"]))) == 1


def test_nan_loss_stops_training_before_it_is_saved(megatron_world, tmp_path):
    """A learning rate that blows the weights up: the run stops at the first NaN/Inf loss
    or gradient norm (Megatron-LM's default), naming the iteration and the way out, and that
    iteration is not saved; --no-check-for-nan-in-loss-and-grad trains on."""
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    flags = [*SMALL, "--train-iters", "6", "--lr", "1e12", "--clip-grad", "0",
             "--snake-offload", "--snake-offload-dir", str(tmp_path)]
    with pytest.raises(FloatingPointError) as exc:
        pretrain(parse_args([*flags, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]))
    message = str(exc.value)
    assert "--no-check-for-nan-in-loss-and-grad" in message and "iteration" in message
    stopped = int(message.split()[1].rstrip(":"))
    saved = sorted(os.listdir(tmp_path / "ckpt")) if (tmp_path / "ckpt").exists() else []
    assert f"iter_{stopped:07d}" not in saved
    assert all(int(name[5:]) < stopped for name in saved if name.startswith("iter_"))
    losses = pretrain(parse_args([*flags, "--no-check-for-nan-in-loss-and-grad"]))
    assert len(losses) == 6 and not all(map(lambda x: x == x and abs(x) < float("inf"),
                                            losses))
