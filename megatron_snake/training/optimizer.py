"""Megatron-Core's optimizer and learning-rate scheduler, configured from the flags.

Both schedules (Megatron's and the vertical one) step the same optimizer, so a run with and
without ``--snake-offload`` differs only in the order of the forward/backward work.
"""

from __future__ import annotations

import argparse

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.optim.dp_shards import DataParallel
from megatron_snake.optim.zenflow import ZenFlowAdamW


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
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
        use_distributed_optimizer=False,
    )


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
