"""The training loop: build, (resume), step, log, evaluate, save.

Megatron-LM's ``pretrain`` reduced to the parts a GPT pretraining run needs. Without
``--snake-offload``: Megatron's DDP, optimizer and schedule. With it: the offloaded state
(unit weights, gradients and AdamW states in the tensor store) and the vertical schedule.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.transformer.module import Float16Module

from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.optim.adamw import HostAdamW
from megatron_snake.training import checkpointing, distributed, offloaded_state
from megatron_snake.training.data import build_gpt_datasets, micro_batches, num_samples_for
from megatron_snake.training.model import build_gpt_model, wrap_ddp
from megatron_snake.training.optimizer import (build_optimizer, build_scheduler,
                                               build_zenflow_optimizer)
from megatron_snake.training.step import make_forward_backward
from megatron_snake.training.tokenizer import build_tokenizer, padded_vocab_size
from megatron_snake.training.train_log import TrainLog


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
            for k, v in batch.items()}


def _lm_loss(losses, microbatches) -> float:
    """Token-weighted mean over the step's micro-batches and data-parallel ranks, the way
    Megatron-LM averages ``lm loss``; under pipeline parallelism the last stage's figure,
    on every stage."""
    # stays zero on a stage before the last; on the batch's device, which NCCL needs
    totals = torch.zeros(2, dtype=torch.double, device=microbatches[0]["loss_mask"].device)
    if losses:
        tokens = [mb["loss_mask"].sum() for mb in microbatches]
        totals = torch.stack([sum(l.float() * n for l, n in zip(losses, tokens)),
                              sum(tokens).float()]).double()
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
    return (totals[0] / totals[1].clamp(min=1)).item()


def _next_microbatches(iterator, count: int, device: torch.device) -> list[dict]:
    return [_to_device(next(iterator), device) for _ in range(count)]


def evaluate(args, model, forward_backward, valid_ds, device) -> float:
    """``--eval-iters`` forward-only steps over the validation set, from its start."""
    model.eval()
    it = micro_batches(valid_ds, micro_batch_size=args.micro_batch_size,
                       data_parallel_rank=parallel_state.get_data_parallel_rank(),
                       data_parallel_size=parallel_state.get_data_parallel_world_size(),
                       consumed_samples=0)
    total = 0.0
    with torch.no_grad():
        for _ in range(args.eval_iters):
            mbs = _next_microbatches(it, args.num_microbatches, device)
            total += _lm_loss(forward_backward(model, mbs, forward_only=True).losses, mbs)
    model.train()
    return total / max(args.eval_iters, 1)


@dataclass
class Run:
    """Everything one training run steps, built once by ``pretrain``."""

    args: argparse.Namespace
    device: torch.device
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    log: TrainLog
    forward_backward: Callable
    tensor_store: object | None = None
    offloaded: offloaded_state.OffloadedState | None = None

    def state_for_checkpoint(self) -> dict:
        gpt = unwrap_model(self.model)
        model_state = self.offloaded.weights.model_state_dict(gpt) if self.offloaded \
            else gpt.state_dict()
        return dict(model_state=model_state, optimizer_state=self.optimizer.state_dict(),
                    scheduler_state=self.scheduler.state_dict())

    def restore(self, state: dict) -> None:
        gpt = unwrap_model(self.model)
        if self.offloaded:
            self.offloaded.weights.load_model_state_dict(gpt, state["model"])
        else:
            gpt.load_state_dict(state["model"])
        if not self.args.no_load_optim:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["opt_param_scheduler"])
        elif self.offloaded:
            # A fresh optimizer copied its master weights before the load: take the loaded
            # weights instead (what Megatron-LM does with --no-load-optim).
            self.offloaded.weights.reload_master_weights()
        else:
            self.optimizer.reload_model_params()
        if not self.args.no_load_rng:
            checkpointing.set_rng_state(state["rng_state"])

    def finish(self) -> None:
        """Apply pending updates and stop the optimizer's worker."""
        if isinstance(self.optimizer, HostAdamW):  # Megatron's own needs neither
            self.optimizer.flush()
            self.optimizer.close()


def pretrain(args: argparse.Namespace) -> list[float]:
    """Train as the flags say. Returns the lm loss of every iteration run here."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if args.deterministic_mode:
        # cuBLAS is deterministic only with a fixed workspace; torch refuses its matmuls
        # under deterministic algorithms without it (the setting Megatron-LM documents)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(args.deterministic_mode or was_deterministic)
    try:
        return _pretrain(args)
    finally:  # a process that trains more than once (tests, notebooks) gets its mode back
        torch.use_deterministic_algorithms(was_deterministic)


def _schedule_name(args) -> str:
    pp = args.pipeline_model_parallel_size
    if not args.snake_offload:
        return "megatron (" + ("forward_backward_pipelining_without_interleaving, "
                               f"{pp} stages)" if pp > 1 else "forward_backward_no_pipelining)")
    if args.snake_schedule == "horizontal":
        return f"horizontal (ablation), checkpoint interval {args.snake_checkpoint_interval}"
    groups = args.num_microbatches // args.snake_group_size
    bubble = (pp - 1) / (groups + pp - 1)
    return (f"vertical (snake), checkpoint interval {args.snake_checkpoint_interval}, "
            f"{groups} snake group(s) of {args.snake_group_size} over {pp} stage(s) "
            f"(expected bubble {bubble:.0%})")


def _pretrain(args: argparse.Namespace) -> list[float]:
    device = distributed.resolve_device(args.device)
    distributed.initialize(device=device,
                           tensor_model_parallel_size=args.tensor_model_parallel_size,
                           pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                           seed=args.seed, timeout_minutes=args.distributed_timeout_minutes)
    rank = dist.get_rank()
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    log = TrainLog(args, vocab, device, rank=rank)

    gpt = build_gpt_model(args, vocab, device)
    n_params = sum(p.numel() for p in gpt.parameters())
    schedule = _schedule_name(args)
    log.print(f"> megatron_snake: {n_params / 1e6:.2f}M parameters, device {device}, "
              f"schedule {schedule}, {args.num_microbatches} micro-batches of "
              f"{args.micro_batch_size} x {args.seq_length} tokens per step")
    if args.bf16 or args.fp16:
        gpt = Float16Module(gpt.config, gpt)

    train_ds, valid_ds, _ = build_gpt_datasets(
        mock=args.mock_data, data_path=args.data_path, split=args.split,
        seq_length=args.seq_length, seed=args.seed, tokenizer=tokenizer,
        data_cache_path=args.data_cache_path,
        num_samples=num_samples_for(args.train_iters, args.global_batch_size,
                                    args.eval_interval, args.eval_iters))

    with offloaded_state.open_store(args, device, rank) as tensor_store:
        if args.snake_offload:
            state = offloaded_state.build_offloaded_state(args, unwrap_model(gpt), tensor_store,
                                                          device)
            log.print(state.summary(args))
            log.print(f"> offload directory {tensor_store.dir.path}, I/O engine "
                      f"{tensor_store.engine.name}")
            model, optimizer = gpt, state.optimizer
            scheduler = build_scheduler(args, optimizer)
            unwrap_model(gpt).config.grad_scale_func = optimizer.scale_loss if args.fp16 \
                else None
            forward_backward = make_forward_backward(args, tensor_store, device, state.weights,
                                                     state.units)
        else:
            state = None
            model = wrap_ddp(gpt)
            config = unwrap_model(gpt).config
            if args.snake_zenflow:  # approximate: says so at start and in every log line
                optimizer, scheduler = build_zenflow_optimizer(args, model)
                log.print(optimizer.summary())
                config.grad_scale_func = None  # fp32 / bf16 only: no loss scale
            else:
                optimizer, scheduler = build_optimizer(args, model)
                config.grad_scale_func = optimizer.scale_loss
            config.no_sync_func = model.no_sync
            config.finalize_model_grads_func = finalize_model_grads
            forward_backward = make_forward_backward(args, tensor_store, device)
        run = Run(args, device, model, optimizer, scheduler, log, forward_backward,
                  tensor_store, state)

        iteration, consumed = 0, 0
        if args.load:
            saved = checkpointing.load_checkpoint(args.load, args=args)
            run.restore(saved)
            iteration, consumed = saved["iteration"], saved["consumed_samples"]
            log.print(f"> loaded checkpoint from {args.load} at iteration {iteration}")
        train_iter = micro_batches(
            train_ds, micro_batch_size=args.micro_batch_size,
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
            consumed_samples=consumed)
        try:
            return train(run, train_iter, valid_ds, iteration, consumed)
        except RuntimeError as exc:
            if dist.get_world_size() > 1 and distributed.is_lost_peer(exc):
                raise RuntimeError(
                    f"rank {rank}: lost contact with another rank during training ({exc}). "
                    "A rank died or hung: its own log has the cause; the others stop here "
                    "(--distributed-timeout-minutes bounds the wait)") from exc
            raise
        finally:
            run.finish()


def _log_extra(run: Run, activation_peak: dict) -> str:
    """Store traffic (offloaded runs) and ZenFlow's fields, for the log line."""
    parts = [offloaded_state.traffic(run.tensor_store, activation_peak)]
    if run.args.snake_zenflow:
        parts.append(run.optimizer.log_fields())
    return " | ".join(p for p in parts if p)


def train(run: Run, train_iter, valid_ds, iteration: int, consumed: int) -> list[float]:
    """Step from ``iteration`` to ``--train-iters`` (or ``--exit-interval``)."""
    args, model, optimizer = run.args, run.model, run.optimizer
    model.train()
    history = []
    run.log.start_interval()
    while iteration < args.train_iters:
        mbs = _next_microbatches(train_iter, args.num_microbatches, run.device)
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        optimizer.zero_grad()
        result = run.forward_backward(model, mbs)
        losses = result.losses
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            run.scheduler.step(increment=args.global_batch_size)
        iteration += 1
        consumed += args.global_batch_size
        lm_loss = _lm_loss(losses, mbs)
        history.append(lm_loss)
        run.log.step(iteration=iteration, consumed_samples=consumed, lm_loss=lm_loss,
                     lr=optimizer.param_groups[0]["lr"], grad_norm=grad_norm,
                     loss_scale=optimizer.get_loss_scale().item(),
                     skipped=not update_successful,
                     extra=_log_extra(run, result.activation_peak))
        if valid_ds is not None and args.eval_interval and iteration % args.eval_interval == 0:
            run.log.validation(iteration, evaluate(args, model, run.forward_backward, valid_ds,
                                                   run.device))
        exiting = bool(args.exit_interval) and iteration % args.exit_interval == 0
        periodic = bool(args.save_interval) and iteration % args.save_interval == 0
        if args.save and (periodic or exiting or iteration == args.train_iters):
            checkpointing.save_checkpoint(args.save, iteration=iteration,
                                          consumed_samples=consumed, args=args,
                                          **run.state_for_checkpoint())
            run.log.print(f"> saved checkpoint at iteration {iteration} to {args.save}")
        if exiting:
            run.log.print(f"> exiting at iteration {iteration} "
                          f"(--exit-interval {args.exit_interval})")
            break
    return history
