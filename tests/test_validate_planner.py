"""tools/validate_planner.py's run settings (the validation itself trains for minutes: a
benchmark, recorded in docs/benchmarks.md): the device and precision reach every run, and
on GPUs the two-rank configurations need two devices."""

import importlib.util
import os

import torch

from megatron_snake.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "validate_planner", os.path.join(ROOT, "tools", "validate_planner.py"))
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _options(*argv):
    a = type("A", (), {})()
    a.hidden, a.seq, a.host_memory, a.dir = 256, 256, "2GiB", "/tmp/v"
    a.device, a.bf16 = "cpu", False
    for key, value in zip(argv[::2], argv[1::2]):
        setattr(a, key, value)
    return a


def test_the_device_and_bf16_reach_every_run():
    args = parse_args([*tool.base_flags(_options("device", "cuda", "bf16", True)),
                       "--num-layers", "4", "--global-batch-size", "8"])
    assert args.device == "cuda" and args.bf16
    plain = parse_args([*tool.base_flags(_options()), "--num-layers", "4",
                        "--global-batch-size", "8"])
    assert plain.device == "cpu" and not plain.bf16


def test_two_rank_configurations_run_on_the_cpu_and_need_two_gpus():
    assert tool.worlds("cpu") == (1, 2)
    expected = (1, 2) if torch.cuda.device_count() >= 2 else (1,)
    assert tool.worlds("cuda") == expected
    assert {world for _, world, _, _ in tool.CONFIGS} == {1, 2}


def test_each_configuration_is_also_predicted_from_the_rates_timed_alone():
    from megatron_snake.planner import load_profile

    hw = load_profile("h100_4x_gen4").with_(gpus_per_node=1)   # one rank: DP 1
    flags = ["--num-layers", "4", "--global-batch-size", "8"]
    same = tool.predictions(_options(), hw, flags)
    assert same[0] == same[1]   # no *_alone rates: one prediction
    slower_alone = hw.with_(device_tflops_alone=hw.device_tflops / 4,
                            head_tflops_alone=hw.output_layer_tflops / 4)
    in_step, alone = tool.predictions(_options(), slower_alone, flags)
    assert in_step == same[0] and alone > in_step
