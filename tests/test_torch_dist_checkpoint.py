"""--ckpt-format torch_dist (the default): Megatron-Core's distributed format. A run resumes
exactly; a checkpoint saved with one layout loads into another, and one saved with
--snake-offload loads into a plain Megatron-Core run and back: the next losses are those of
the saved run going on (weights and optimizer state resharded, both schedules); nothing
stored in the files is run; what cannot work is refused naming the flag."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

from conftest import expect_flag_error
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--deterministic-mode", "--device", "cpu", "--lr", "3e-3", "--seed", "11",
         "--lr-decay-style", "constant", "--num-workers", "0", "--log-interval", "1"]
DIST = ["--ckpt-format", "torch_dist"]


def _losses(*flags: str, nproc: int = 1) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-port", str(29700 + os.getpid() % 200)]
    proc = subprocess.run([*launcher, SCRIPT, *flags], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)]


def test_resume_is_exact(megatron_world, tmp_path):
    """Dropout on: the RNG streams, the data position, the optimizer all come back."""
    flags = [*FLAGS, "--train-iters", "6", *DIST]
    full = pretrain(parse_args(flags))
    pretrain(parse_args([*flags, "--exit-interval", "3", "--save", str(tmp_path)]))
    assert (tmp_path / "iter_0000003" / "metadata.json").is_file()   # Megatron's layout
    assert (tmp_path / "iter_0000003" / "common.pt").is_file()
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path)]))
    assert resumed == full[3:]


TP2, PP2, SNAKE = (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                   ["--snake-offload"])


@pytest.mark.parametrize("saved_with, loaded_with, tolerance", [
    (TP2, [], 1e-5),
    (PP2, [], 1e-5),
    # offloaded -> plain Megatron-Core and back, the layout changing too
    ([*TP2, *SNAKE], [], 1e-5),
    (TP2, SNAKE, 1e-5),
    ([*PP2, *SNAKE], SNAKE, 1e-5),
    # data parallel 2 (each rank wrote its shard of every unit) with updates deferred into
    # the next forward sweep, into a plain run; another unit partition
    ([*SNAKE, "--snake-alpha", "0.3", "--clip-grad", "0.5"], ["--clip-grad", "0.5"], 1e-5),
    ([*TP2, *SNAKE], [*SNAKE, "--snake-checkpoint-interval", "2"], 1e-5),
    # SwiGLU's fc1 weight: Megatron saves its gate and up halves as separate boxes
    ([*TP2, *SNAKE, "--swiglu"], ["--swiglu"], 1e-5),
    # bf16: master weights as Megatron's fp32_param; two layouts round bf16 apart (measured
    # up to 1.1e-5 relative)
    ([*TP2, *SNAKE, "--bf16"], ["--bf16"], 5e-5),
])
def test_a_checkpoint_loads_into_another_layout_and_kind_of_run(tmp_path, saved_with,
                                                                loaded_with, tolerance):
    """Saved by two ranks, loaded by one: the next losses equal those of the saved run
    going on from the same checkpoint. (The vocabulary, 512, is padded alike for TP 1 and 2:
    the loss runs over the padded logits.)"""
    flags = [*FLAGS, "--hidden-dropout", "0", "--attention-dropout", "0",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "511"]
    ckpt = str(tmp_path / "ckpt")
    _losses(*flags, *saved_with, "--train-iters", "4", "--save", ckpt, nproc=2)
    same = _losses(*flags, *saved_with, "--train-iters", "7", "--load", ckpt,
                   "--use-checkpoint-opt_param-scheduler", nproc=2)
    one = _losses(*flags, *loaded_with, "--train-iters", "7", "--load", ckpt,
                  "--use-checkpoint-opt_param-scheduler")
    assert len(same) == len(one) == 3
    for a, b in zip(same, one):
        assert abs(a - b) <= tolerance * abs(a), (same, one)


def test_a_padded_vocabulary_that_changes_with_tp_loads_into_both_kinds_of_run(tmp_path):
    """Vocabulary 600: padded to 768 rows at TP = 2, 640 at TP = 1 (Megatron's
    allow_shape_mismatch: the rows both have are read). Saved offloaded at TP = 2, loaded
    at TP = 1 with and without --snake-offload: the two read the same values (their losses
    agree) and train on."""
    flags = [*FLAGS, "--hidden-dropout", "0", "--attention-dropout", "0",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "600"]
    ckpt = str(tmp_path / "ckpt")
    _losses(*flags, *TP2, *SNAKE, "--train-iters", "4", "--save", ckpt, nproc=2)
    keep = "--use-checkpoint-opt_param-scheduler"
    plain = _losses(*flags, "--train-iters", "6", "--load", ckpt, keep)
    snake = _losses(*flags, *SNAKE, "--train-iters", "6", "--load", ckpt, keep)
    assert len(plain) == len(snake) == 2
    for a, b in zip(plain, snake):
        assert abs(a - b) <= 1e-5 * abs(a), (plain, snake)


def test_a_tensor_this_model_has_and_the_checkpoint_lacks_is_named(megatron_world, tmp_path):
    """RMSNorm saved (no norm biases), LayerNorm loaded: the missing key, and no advice to
    drop the optimizer state."""
    root = tmp_path / "rms"
    pretrain(parse_args([*FLAGS, "--train-iters", "2", "--save", str(root),
                         "--normalization", "RMSNorm"]))
    with pytest.raises(ValueError, match=r"lacks decoder\.\S+_bias: is it a checkpoint of "
                                         r"this model\?$") as caught:
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", str(root)]))
    assert len(str(caught.value)) < 500, "not every key of the checkpoint"


def test_torch_dist_is_the_default_except_under_zenflow():
    assert parse_args([]).ckpt_format == "torch_dist"
    assert parse_args(["--snake-offload"]).ckpt_format == "torch_dist"
    assert parse_args(["--snake-zenflow"]).ckpt_format == "torch"


def _saved(tmp_path) -> str:
    root = tmp_path / "ckpt"
    pretrain(parse_args([*FLAGS, "--train-iters", "2", *DIST, "--save", str(root)]))
    return str(root)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/snake_pwned_by_checkpoint",))


@pytest.mark.parametrize("target", ["common.pt", ".metadata"])
def test_a_pickled_payload_is_refused_and_never_runs(megatron_world, tmp_path, target):
    from megatron_snake.training.checkpointing import UnsafeCheckpointError

    root = _saved(tmp_path)
    path = os.path.join(root, "iter_0000002", target)
    if target == "common.pt":
        common = torch.load(path, weights_only=False)
        common["payload"] = _Payload()
        torch.save(common, path)
    else:
        with open(path, "rb") as f:
            metadata = pickle.load(f)
        metadata.payload = _Payload()
        with open(path, "wb") as f:
            pickle.dump(metadata, f)
    if os.path.exists("/tmp/snake_pwned_by_checkpoint"):
        os.unlink("/tmp/snake_pwned_by_checkpoint")
    with pytest.raises(UnsafeCheckpointError, match="refused"):
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", root]))
    assert not os.path.exists("/tmp/snake_pwned_by_checkpoint")


def test_zenflow_takes_only_the_weights_of_a_torch_dist_checkpoint(megatron_world, tmp_path):
    root = _saved(tmp_path)
    with pytest.raises(ValueError, match="torch_dist.*--snake-zenflow.*--no-load-optim"):
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", root, "--snake-zenflow"]))
    went_on = pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", root,
                                   "--snake-zenflow", "--no-load-optim"]))
    assert len(went_on) == 2


def test_another_model_is_refused_naming_the_flag(megatron_world, tmp_path):
    root = _saved(tmp_path)
    with pytest.raises(ValueError, match="--hidden-size saved 32 now 64"):
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", root,
                             "--hidden-size", "64"]))


def test_torch_dist_is_refused_where_it_is_not_written(capsys):
    expect_flag_error(capsys, [*DIST, "--snake-zenflow"], "--ckpt-format")


def test_a_format_this_run_cannot_read_is_named(megatron_world, tmp_path):
    root = _saved(tmp_path)
    (tmp_path / "ckpt" / "iter_0000002" / "metadata.json").write_text(
        '{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    with pytest.raises(ValueError, match="'zarr' checkpoint; this run reads torch_dist"):
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", root]))


def test_a_payload_in_a_sharded_object_is_refused_and_never_runs(megatron_world, tmp_path,
                                                                  monkeypatch):
    """The RNG state travels as a ShardedObject, which Megatron's planner would load with
    weights_only=False."""
    from megatron_snake.training import torch_dist
    from megatron_snake.training.checkpointing import UnsafeCheckpointError

    with monkeypatch.context() as m:
        m.setattr(torch_dist.ckpt, "rng_state", lambda: {"payload": _Payload()})
        root = _saved(tmp_path)
    if os.path.exists("/tmp/snake_pwned_by_checkpoint"):
        os.unlink("/tmp/snake_pwned_by_checkpoint")
    with pytest.raises(UnsafeCheckpointError, match="refused.*posix.system|posix.system.*"):
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", root]))
    assert not os.path.exists("/tmp/snake_pwned_by_checkpoint")


def test_no_save_optim_and_rng_need_their_load_flags(megatron_world, tmp_path):
    root = tmp_path / "lean"
    pretrain(parse_args([*FLAGS, "--train-iters", "2", *DIST, "--save", str(root),
                         "--no-save-optim", "--no-save-rng"]))
    with pytest.raises(ValueError, match="--no-save-optim.*--no-load-optim"):
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", str(root)]))
    with pytest.raises(ValueError, match="--no-save-rng.*--no-load-rng"):
        pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", str(root),
                             "--no-load-optim"]))
    went_on = pretrain(parse_args([*FLAGS, "--train-iters", "4", "--load", str(root),
                                   "--no-load-optim", "--no-load-rng"]))
    assert len(went_on) == 2


@pytest.mark.parametrize("lo, hi", [(0, 60), (7, 53), (5, 6), (20, 40), (19, 41), (0, 1),
                                    (59, 60), (4, 16)])
def test_a_flat_range_is_cut_into_boxes_that_cover_it_in_order(lo, hi):
    """An offloaded run's data-parallel shard of a parameter is a flat element range; its
    boxes, read from the parameter in order, are exactly that range."""
    from megatron_snake.training.dcp_stream import flat_range_boxes

    shape = (3, 4, 5)
    full = torch.arange(60).reshape(shape)
    boxes = flat_range_boxes(shape, lo, hi)
    pieces = [full[tuple(slice(o, o + n) for o, n in zip(offset, size))].reshape(-1)
              for offset, size in boxes]
    assert torch.equal(torch.cat(pieces), torch.arange(lo, hi))
    assert len(boxes) <= 2 * len(shape) - 1


def test_the_streaming_writer_still_matches_torchs_writer():
    """It relies on private pieces of torch's FileSystemWriter: a torch that changed them
    fails here, not in a user's save."""
    from megatron_snake.training.dcp_stream import check_torch_sites

    check_torch_sites()
