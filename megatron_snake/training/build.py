"""Assemble one run from validated flags: the model, its optimizer and learning-rate
schedule, the step function and, with offloading, the tensor store and the offloaded state.

``pretrain`` and the benchmarks in ``tools/`` build their runs here, so a benchmark measures
the run users train. Without ``--snake-offload``: Megatron's DDP, optimizer and schedule
(or ZenFlow's split AdamW with ``--snake-zenflow``). With it: the unit weights, gradients
and AdamW state in the store, and the vertical schedule.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.transformer.module import Float16Module

import megatron_snake.timeline as timeline
from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.offload.initial_weights import InitialWeights
from megatron_snake.optim import host_kernel
from megatron_snake.optim.adamw import HostAdamW
from megatron_snake.optim.cpu_threads import usable_cores
from megatron_snake.training import offloaded_state
from megatron_snake.training.model import build_gpt_model, wrap_ddp
from megatron_snake.training.optimizer import (build_optimizer, build_scheduler,
                                               build_zenflow_optimizer)
from megatron_snake.schedule.loss import microbatch_call
from megatron_snake.training.step import check_activation_plan_path, make_forward_backward


@dataclass
class StepOutcome:
    """One training step: what the loss function reported per micro-batch (on the last
    pipeline stage), the offloaded activations' peak bytes, and what the optimizer did."""

    reports: list
    activation_peak: dict
    update_successful: bool   # False: fp16 found an overflow and skipped the update
    grad_norm: float | None


@dataclass
class Run:
    """Everything one training run steps, built once by ``build_run``."""

    args: argparse.Namespace
    device: torch.device
    model: torch.nn.Module        # what the step function takes (DDP-wrapped without offload)
    optimizer: object
    scheduler: object
    forward_backward: Callable[..., list]   # Megatron's forward_backward_func signature
    tensor_store: object | None = None
    offloaded: offloaded_state.OffloadedState | None = None
    n_params: int = 0             # this rank's parameters, counted before any offloading

    def step(self, microbatches: list[dict]) -> StepOutcome:
        """Zero the gradients, run forward and backward over ``microbatches`` with
        pretrain_gpt's forward step, update, and advance the learning-rate schedule by the
        global batch when the update was made (Megatron-LM's ``train_step``)."""
        if hasattr(self.model, "zero_grad_buffer"):   # Megatron's DDP gradient buffers
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # named ranges for --snake-trace and torch.profiler (next to nothing otherwise)
        with timeline.span("forward_backward", "step"):
            reports = self.forward_backward(**microbatch_call(self.model, microbatches))
        with timeline.span("optimizer step", "step boundary"):
            update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.args.global_batch_size)
        return StepOutcome(reports, getattr(self.forward_backward, "activation_peak", {}),
                           update_successful, grad_norm)

    def evaluate(self, microbatches: list[dict]) -> list:
        """Forward only over ``microbatches``: what the loss function reports."""
        return self.forward_backward(**microbatch_call(self.model, microbatches),
                                     forward_only=True)

    def finish(self) -> None:
        """Apply pending updates and stop the optimizer's worker."""
        if isinstance(self.optimizer, HostAdamW):  # Megatron's own needs neither
            self.optimizer.flush()
            self.optimizer.close()


def whole_model_parameters(gpt: torch.nn.Module, device: torch.device) -> int:
    """The model's parameter count summed over its tensor and pipeline shards: a weight
    every tensor-parallel rank holds whole (a norm, a bias) counts once, and so does the
    tied output weight the last stage keeps a copy of."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    first_stage = getattr(gpt, "pre_process", True)
    mine = sum(p.numel() for p in gpt.parameters()
               if (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
               and not (getattr(p, "shared_embedding", False) and not first_stage))
    total = torch.tensor([mine], dtype=torch.long, device=device)
    group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return int(total.item())


def schedule_name(args: argparse.Namespace) -> str:
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


ModelBuilder = Callable[[Callable[[torch.nn.Module], None] | None], torch.nn.Module]


@contextmanager
def build_run(args: argparse.Namespace, device: torch.device, vocab_size: int, *,
              rank: int = 0, log: Callable[[str], None] = print,
              build_model: ModelBuilder | None = None,
              make_scheduler: Callable | None = None) -> Iterator[Run]:
    """The run ``args`` describe, on ``device`` (Megatron's parallel state initialized).
    On exit the optimizer's pending updates land and the store's files are removed.

    ``build_model(on_built)``: the GPTModel of this pipeline stage, on ``device``, calling
    ``on_built(layer)`` with each decoder layer as soon as it is built and
    ``on_built(model)`` at the end (default: ``build_gpt_model`` from the flags; the
    Megatron-LM plug-in builds through the user's model provider).
    ``make_scheduler(optimizer)``: the offloaded optimizer's learning-rate schedule
    (default: ``build_scheduler`` from the flags; the plug-in uses Megatron-LM's)."""
    if build_model is None:
        def build_model(on_built):
            return build_gpt_model(args, vocab_size, device, on_built=on_built)
    with offloaded_state.open_store(args, device, rank) as tensor_store:
        # before the model and its offloaded state are built, not once they are
        check_activation_plan_path(args, tensor_store)
        # offloaded: each layer's values go to the store as soon as Megatron initialises
        # them, so the model is never whole in memory
        initial = InitialWeights(tensor_store) if args.snake_offload else None
        gpt = build_model(initial.spill if initial else None)
        n_params = sum(p.numel() for p in gpt.parameters())
        log(f"> megatron_snake: {n_params / 1e6:.2f}M parameters on this rank, "
            f"{whole_model_parameters(gpt, device) / 1e6:.2f}M in the whole model, device "
            f"{device}, schedule "
            f"{schedule_name(args)}, {args.num_microbatches} micro-batches of "
            f"{args.micro_batch_size} x {args.seq_length} tokens per step")
        if args.bf16 or args.fp16:
            gpt = Float16Module(gpt.config, gpt)
        config = unwrap_model(gpt).config
        state = None
        if args.snake_offload:
            state = offloaded_state.build_offloaded_state(args, unwrap_model(gpt), tensor_store,
                                                          device, initial=initial)
            log(state.summary(args))
            paths = ", ".join(d.path for d in tensor_store.dirs)
            log(f"> offload director{'ies' if len(tensor_store.dirs) > 1 else 'y'} {paths}, "
                f"I/O engine {tensor_store.engine.name}; the optimizer's update "
                f"{host_kernel.implementation()} on {state.optimizer.threads} CPU thread(s) "
                f"of {usable_cores()} (--snake-optimizer-threads)")
            model, optimizer = gpt, state.optimizer
            scheduler = (make_scheduler or (lambda o: build_scheduler(args, o)))(optimizer)
            config.grad_scale_func = optimizer.scale_loss if args.fp16 else None
            forward_backward = make_forward_backward(args, tensor_store, device, state.weights,
                                                     state.units)
        else:
            # Megatron-LM's DDP config: gradients accumulate in fp32 unless --main-grads-dtype
            # bf16 turns that off (its validate_args), and the distributed optimizer's
            # reduce-scatter with --use-distributed-optimizer
            model = wrap_ddp(gpt, use_distributed_optimizer=args.use_distributed_optimizer,
                             grad_reduce_in_fp32=args.main_grads_dtype == torch.float32)
            if args.snake_zenflow:  # approximate: says so at start and in every log line
                optimizer, scheduler = build_zenflow_optimizer(args, model)
                log(optimizer.summary())
                config.grad_scale_func = None  # fp32 / bf16 only: no loss scale
            else:
                optimizer, scheduler = build_optimizer(args, model)
                config.grad_scale_func = optimizer.scale_loss
            config.no_sync_func = model.no_sync
            config.finalize_model_grads_func = finalize_model_grads
            forward_backward = make_forward_backward(args, tensor_store, device)
        run = Run(args, device, model, optimizer, scheduler, forward_backward, tensor_store,
                  state, n_params)
        try:
            yield run
        finally:
            run.finish()
