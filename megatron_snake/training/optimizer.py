"""Megatron-Core's optimizer and learning-rate scheduler, configured from the flags.

Both schedules (Megatron's and the vertical one) step the same optimizer, so a run with and
without ``--snake-offload`` differs only in the order of the forward/backward work.

Without ``--snake-offload`` the optimizer is Megatron-LM's: ``--use-distributed-optimizer``,
``--optimizer-cpu-offload`` (Megatron-Core's ``HybridDeviceOptimizer``) and the
precision-aware flags reach ``OptimizerConfig`` as Megatron-LM's
``get_megatron_optimizer_config`` passes them (every flag whose name is a field).
"""

from __future__ import annotations

import argparse
import importlib.util
from contextlib import contextmanager
from unittest import mock

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import optimizer_config as optimizer_config_module
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_snake.errors import FlagError
from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.optim.dp_shards import DataParallel
from megatron_snake.optim.zenflow import ZenFlowAdamW

def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    if args.use_precision_aware_optimizer and \
            importlib.util.find_spec("transformer_engine") is None:
        with _transformer_engine_older_than_2_1():
            return _optimizer_config(args)
    return _optimizer_config(args)


@contextmanager
def _transformer_engine_older_than_2_1():
    """Megatron-Core 0.16.1's ``OptimizerConfig.__post_init__`` asks
    ``is_te_min_version("2.1.0")`` under --use-precision-aware-optimizer, which raises a
    TypeError (None >= Version) where Transformer Engine is not installed, although the
    CPU offload that Megatron-LM requires the flag for runs no Transformer Engine code. So
    without it the config is built as with a Transformer Engine older than 2.1: the only
    effect is ``store_param_remainders = False``, which the hybrid optimizer's update never
    reads (it keeps fp32 masters on the host). tests/test_megatron_optimizer_flags.py checks
    that the call is still there."""
    with mock.patch.object(optimizer_config_module, "is_te_min_version",
                           lambda *a, **k: False):
        yield


def _optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=args.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        main_grads_dtype=args.main_grads_dtype,
        main_params_dtype=args.main_params_dtype,
        exp_avg_dtype=args.exp_avg_dtype,
        exp_avg_sq_dtype=args.exp_avg_sq_dtype,
    )


def check_cpu_offload_device(device_type: str) -> None:
    """--optimizer-cpu-offload runs on a GPU only. Megatron-Core 0.16.1's
    ``HybridDeviceOptimizer`` takes ``torch.cuda.current_stream()`` in its constructor
    (torch without CUDA raises there), copies only CUDA parameters to pinned host memory,
    and looks each host parameter's CUDA original up at every step: on a CPU device nothing
    is offloaded and the step fails. There the optimizer is on the host already."""
    if device_type != "cuda":
        raise FlagError("--optimizer-cpu-offload: Megatron-Core's HybridDeviceOptimizer "
                        "moves CUDA parameters to the host on CUDA streams, and this run's "
                        f"device is the {device_type.upper()} (its optimizer is on the host "
                        "already); drop the flag or run on a GPU")


def build_optimizer(args: argparse.Namespace, model):
    """Megatron's optimizer (no weight decay on biases and norms) and its LR schedule."""
    optimizer = get_megatron_optimizer(optimizer_config(args), [model])
    return optimizer, build_scheduler(args, optimizer)


def build_zenflow_optimizer(args: argparse.Namespace, model):
    """--snake-zenflow: ZenFlow's split AdamW over ``model``'s parameters (Megatron's DDP
    accumulates and all-reduces their gradients in ``main_grad``) and the LR schedule."""
    optimizer = ZenFlowAdamW(unwrap_model(model).named_parameters(), lr=args.lr,
                             weight_decay=args.weight_decay, beta1=args.adam_beta1,
                             beta2=args.adam_beta2, eps=args.adam_eps,
                             clip_grad=args.clip_grad, settings=args.zenflow,
                             dp=DataParallel.from_megatron(),
                             threads=args.snake_optimizer_threads)
    return optimizer, build_scheduler(args, optimizer)


def build_scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Megatron's learning-rate and weight-decay schedule over ``optimizer.param_groups``."""
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * args.lr_decay_iters)
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=None,
        lr_wsd_decay_style=None,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
