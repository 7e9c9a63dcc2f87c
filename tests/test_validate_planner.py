"""tools/validate_planner.py's run settings (the validation itself trains for minutes: a
benchmark, recorded in docs/benchmarks.md): the device and precision reach every run, and
on GPUs the two-rank configurations need two devices."""

import importlib.util
import os

import pytest
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


def test_a_missing_dir_is_refused_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--dir", str(tmp_path / "typo")])
    assert exc.value.code == 2
    assert f"--dir {tmp_path / 'typo'} does not exist" in capsys.readouterr().err


def test_a_failing_calibration_reports_its_own_error(tmp_path):
    """The calibration's error (here: its offload directory is missing) reaches the user,
    not only its exit status."""
    a = _options("dir", str(tmp_path / "gone"))
    with pytest.raises(RuntimeError, match="--snake-offload-dir .*gone does not exist"):
        tool.calibrate(a, 1)


def test_a_configurations_error_pairs_each_run_with_its_own_rounds_profile():
    """Two rounds are predicted exactly; in the third the machine slowed down after its
    calibration (1.0 s predicted, 2.0 s measured). Paired round by round the error is 0;
    the medians (1.0 s predicted, 1.4 s measured) would report -29% from one round."""
    runs = [(1.0, 1.0, 0.9), (1.4, 1.4, 1.26), (2.0, 1.0, 0.9)]
    assert tool.paired_error(runs, 1) == 0.0
    assert tool.paired_error(runs, 2) == pytest.approx(-0.1)
