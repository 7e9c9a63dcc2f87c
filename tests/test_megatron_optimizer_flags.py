"""The run without --snake-offload takes Megatron-LM's optimizer flags: the distributed
optimizer, the optimizer's CPU offload and the precision-aware optimizer, with Megatron-LM's
names, defaults and rules (core_v0.16.1), and passes them to Megatron-Core as Megatron-LM's
training.py does. The CPU offload itself needs CUDA (Megatron-Core's HybridDeviceOptimizer):
here its flags are checked, and its config is built by Megatron-Core's own OptimizerConfig.
"""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, expect_flag_error, make_microbatches

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--hidden-dropout", "0", "--attention-dropout", "0"]
OFFLOAD = ["--use-distributed-optimizer", "--optimizer-cpu-offload",
           "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]


def test_megatron_lms_names_and_defaults():
    from megatron_snake.training.arguments import parse_args

    args = parse_args(TINY)
    assert (args.use_distributed_optimizer, args.optimizer_cpu_offload,
            args.optimizer_offload_fraction, args.overlap_cpu_optimizer_d2h_h2d) == \
        (False, False, 1.0, False)


@pytest.mark.parametrize("flags,named", [
    # Megatron-LM's validate_args
    (["--optimizer-cpu-offload", "--use-distributed-optimizer"], "--optimizer-cpu-offload"),
    # Megatron-Core's OptimizerConfig
    (["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
     "--use-precision-aware-optimizer"),
    # without the offload: Transformer Engine's FusedAdam, not installed here
    (["--use-precision-aware-optimizer", "--use-distributed-optimizer"],
     "--use-precision-aware-optimizer"),
    # dtypes the hybrid optimizer would ignore
    ([*OFFLOAD, "--exp-avg-dtype", "bf16"], "--exp-avg-dtype"),
    ([*OFFLOAD, "--bf16", "--main-params-dtype", "fp16"], "--main-params-dtype"),
    (["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d"),
    (["--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction"),
    (["--snake-offload", "--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
    (["--snake-zenflow", "--use-distributed-optimizer"], "--use-distributed-optimizer"),
    # HybridDeviceOptimizer needs CUDA
    ([*OFFLOAD, "--device", "cpu"], "--optimizer-cpu-offload"),
])
def test_refused_with_one_line_naming_the_flag(capsys, flags, named):
    err = expect_flag_error(capsys, [*TINY, *flags], named)
    assert "Traceback" not in err


def test_cpu_offload_on_a_gpu_reaches_megatrons_config(monkeypatch):
    """On a GPU the four flags pass, and Megatron-Core's OptimizerConfig (whose
    __post_init__ asserts the precision-aware optimizer's rules) takes what they set."""
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.optimizer import optimizer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parse_args([*TINY, "--bf16", *OFFLOAD, "--main-grads-dtype", "bf16",
                       "--optimizer-offload-fraction", "0.5"])
    config = optimizer_config(args)
    assert config.use_distributed_optimizer and config.optimizer_cpu_offload
    assert config.overlap_cpu_optimizer_d2h_h2d and config.optimizer_offload_fraction == 0.5
    assert config.use_precision_aware_optimizer
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8   # decoupled gradients
    assert config.main_grads_dtype == torch.bfloat16
    assert config.exp_avg_dtype == config.main_params_dtype == torch.float32


def test_the_transformer_engine_version_check_stands_in_its_place():
    """Without Transformer Engine the config is built as for one older than 2.1
    (``_transformer_engine_older_than_2_1``): the check it stands in for is still where
    Megatron-Core asks it."""
    import inspect

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import optimizer_config as module

    assert 'is_te_min_version("2.1.0")' in inspect.getsource(OptimizerConfig.__post_init__)
    assert hasattr(module, "is_te_min_version")


def _losses(megatron_world, extra: list[str]) -> list[float]:
    from megatron_snake.schedule.loss import report_losses
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run
    from megatron_snake.training.distributed import set_seed

    args = parse_args([*TINY, "--micro-batch-size", "2", "--global-batch-size", "4",
                       "--lr", "3e-3", "--device", "cpu", *extra])
    set_seed(args.seed)
    losses = []
    with build_run(args, megatron_world, VOCAB, log=lambda line: None) as run:
        for step in range(3):
            out = run.step(make_microbatches(2, seed=step))
            losses.append(float(torch.stack(report_losses(out.reports)).mean()))
        ddp = run.model.ddp_config
    assert ddp.use_distributed_optimizer == ("--use-distributed-optimizer" in extra)
    return losses


def test_distributed_optimizer_trains_as_megatrons_plain_one(megatron_world):
    """On one rank Megatron's distributed optimizer owns every element: the same losses as
    its plain optimizer, step for step."""
    plain = _losses(megatron_world, [])
    distributed = _losses(megatron_world, ["--use-distributed-optimizer"])
    assert plain[-1] < plain[0]
    assert distributed == pytest.approx(plain, rel=1e-6)
