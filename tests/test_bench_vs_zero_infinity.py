"""tools/bench_vs_zero_infinity.py without DeepSpeed: the run both systems train, the
ZeRO-Infinity settings it derives, and its errors. (The comparison itself needs DeepSpeed
and its ops build, minutes long: it is a benchmark, recorded in docs/benchmarks.md.)"""

import importlib.util
import os
import sys

import pytest
import torch

from megatron_snake.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    path = os.path.join(ROOT, "tools", "bench_vs_zero_infinity.py")
    spec = importlib.util.spec_from_file_location("bench_vs_zero_infinity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _tool()


def _args(*extra):
    return tool.parser().parse_args(list(extra))


def test_both_systems_train_the_same_model_batch_and_optimizer(tmp_path):
    a = _args("--layers", "2", "--hidden", "64", "--heads", "2", "--micro-batch", "2")
    ours = parse_args(tool.ours_flags(a, 4, str(tmp_path)))
    theirs = parse_args(tool.model_flags(a, 4))
    assert ours.snake_offload and not theirs.snake_offload
    assert (ours.snake_param_tier, ours.snake_optimizer_tier) == ("nvme", "nvme")
    for name in ("num_layers", "hidden_size", "seq_length", "micro_batch_size",
                 "global_batch_size", "num_microbatches", "lr", "weight_decay", "adam_beta1",
                 "adam_beta2", "adam_eps", "clip_grad", "seed", "bf16", "fp16"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert theirs.num_microbatches == 4 and not (theirs.bf16 or theirs.fp16)


def test_zero_infinity_gets_a_swap_buffer_for_each_large_parameter_and_the_runs_settings():
    a = _args("--aio", "262144,32")
    args = parse_args(tool.model_flags(a, 16))
    large = tool.MiB // 4                     # 1 MiB of fp32: DeepSpeed keeps it resident
    numels = [25_000_000, 2_000_000, large + 1, large, 100] + [3_000_000] * 6
    config = tool.ds_config(args, a, numels, "/nvme")
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["buffer_count"] == 9      # the parameters over 1 MiB
    assert zero["offload_param"]["buffer_size"] == 25_000_000
    assert config["gradient_accumulation_steps"] == 16
    assert config["train_micro_batch_size_per_gpu"] == args.micro_batch_size
    assert config["gradient_clipping"] == args.clip_grad
    adam = config["optimizer"]["params"]
    assert adam["lr"] == args.lr and adam["betas"] == [args.adam_beta1, args.adam_beta2]
    assert adam["weight_decay"] == args.weight_decay
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert (config["aio"]["block_size"], config["aio"]["queue_depth"]) == (262144, 32)


def test_bf16_and_the_device_reach_both_systems(tmp_path):
    """The GPU comparison (tools/gpu_check.sh): both in bf16 on the device asked for."""
    a = _args("--device", "cuda", "--bf16", "--layers", "2", "--hidden", "64", "--heads", "2",
              "--aio", "1048576,8")
    ours = parse_args(tool.ours_flags(a, 4, str(tmp_path)))
    theirs = parse_args(tool.model_flags(a, 4))
    assert ours.bf16 and theirs.bf16 and ours.device == theirs.device == "cuda"
    config = tool.ds_config(theirs, a, [25_000_000], "/nvme")
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    child = tool._child_argv(a)
    assert child[child.index("--device") + 1] == "cuda" and "--bf16" in child
    assert tool.parser().parse_args(child).bf16


def test_zero_infinity_gets_megatrons_weight_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, plain = tool._megatron_param_groups(model)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0


@pytest.mark.parametrize("value", ["1MiB", "0,8", "1048576,-1", "1000,8"])
def test_a_bad_aio_setting_is_refused_by_name(capsys, value):
    with pytest.raises(SystemExit):
        tool.parser().parse_args(["--aio", value])
    assert "--aio takes BLOCK_BYTES,QUEUE_DEPTH" in capsys.readouterr().err


def test_without_deepspeed_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)     # import deepspeed fails
    with pytest.raises(SystemExit, match="needs DeepSpeed: DS_ACCELERATOR=cpu pip install"):
        tool.main(["--micro-batches", "1"])


def test_a_childs_bytes_come_from_the_os(tmp_path):
    before = tool._proc_io(os.getpid())
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    after = tool._proc_io(os.getpid())
    assert after["wchar"] - before["wchar"] >= 1 << 20
    assert {"read_bytes", "write_bytes"} <= set(after)
