"""One training step's forward and backward, the three ways a run can take, behind one
signature: Megatron-Core's own schedule (``forward_backward_no_pipelining``, or 1F1B across
pipeline stages) with pretrain_gpt's forward step and loss; the same with the tensors
autograd saves offloaded (``--snake-activation-offload``); and megatron_snake's snake
schedule over the tiered store (``--snake-offload``). Each takes the model and a list of
micro-batch dicts and returns a StepResult: the per-micro-batch masked-mean losses and the
step's telemetry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
import os
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining, forward_backward_pipelining_without_interleaving)

from megatron_snake.offload.activation_plan import (ActivationPlanner, PlanPathError,
                                                    check_plan_path)
from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
from megatron_snake.offload.saved_tensors import SavedTensorOffloader, offloaded_forward_step
from megatron_snake.schedule.loss import masked_loss_sum
from megatron_snake.schedule.unit_store import CombinedStore, InMemoryStore
from megatron_snake.schedule.vertical import (horizontal_forward_backward,
                                              vertical_forward_backward)
from megatron_snake.training.distributed import raise_unless_all_ranks_ok
from megatron_snake.training.offloaded_state import forward_window, unit_working_set_bytes

@dataclass
class StepResult:
    """What one step function call gives back: the per-micro-batch losses (on the last
    pipeline stage; empty elsewhere), and for the log line the most bytes each kind of
    offloaded activation held per tier during the step ("unit inputs",
    "saved tensors"; empty when nothing was offloaded or in evaluation)."""

    losses: list
    activation_peak: dict = field(default_factory=dict)


StepFn = Callable[..., StepResult]


def pretrain_gpt_forward_step(data_iterator, model):
    """Megatron-LM pretrain_gpt's ``forward_step``: the model's per-token loss, and a loss
    function returning (loss sum, token count, reporting values)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(output_tensor):
        loss, num_tokens = masked_loss_sum(output_tensor, batch["loss_mask"])
        report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
        return loss, num_tokens, {"lm loss": report}

    return output, loss_func


def megatron_forward_backward(model, microbatches, *, forward_only: bool = False,
                              forward_step=pretrain_gpt_forward_step):
    """Megatron-Core's schedule for this run: ``forward_backward_no_pipelining``, or its
    1F1B ``forward_backward_pipelining_without_interleaving`` across pipeline stages (the
    losses then come back on the last stage only), with pretrain_gpt's forward step (or
    ``forward_step``, e.g. one whose saved tensors are offloaded)."""
    tokens = microbatches[0]["tokens"]
    schedule = forward_backward_no_pipelining
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        schedule = forward_backward_pipelining_without_interleaving
    store = schedule(
        forward_step_func=forward_step, data_iterator=iter(microbatches),
        model=model, num_microbatches=len(microbatches), seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0], forward_only=forward_only)
    return [(r["lm loss"][0] / r["lm loss"][1].clamp(min=1)).detach() for r in store]


def activation_offload_forward_backward(model, microbatches, *, offloader,
                                       forward_only: bool = False):
    """Megatron's schedule with the tensors autograd saves offloaded by ``offloader``
    (SSDTrain); every write has landed when it returns."""
    for m in (model if isinstance(model, list) else [model]):
        offloader.add_parameters(m.parameters())  # weights are never offloaded as activations
    losses = megatron_forward_backward(
        model, microbatches, forward_only=forward_only,
        forward_step=offloaded_forward_step(pretrain_gpt_forward_step, offloader))
    offloader.synchronize()
    return losses


def activation_planner(args, tensor_store, device, weights) -> ActivationPlanner:
    """The planner for ``--snake-activation-tier auto``: the GPU budget for checkpoints is
    ``--snake-gpu-memory-limit`` less the largest unit's working set and the pinned units."""
    gpu_budget = None
    if args.snake_gpu_memory_limit is not None and weights is not None:
        gpu_budget = args.snake_gpu_memory_limit - \
            unit_working_set_bytes(args, weights.params)[0] - weights.pinned_bytes()
    path, default_in = activation_plan_path(args, tensor_store)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return ActivationPlanner(tensor_store, device, profile_iters=args.snake_profile_iters,
                             gpu_budget_bytes=gpu_budget,
                             host_budget_bytes=args.snake_host_memory_limit // 2,
                             plan_path=path, log=print if rank0 else (lambda *a: None),
                             keep_for_next_unit=forward_window(args),
                             plan_default_in=default_in)


def activation_plan_path(args, tensor_store) -> tuple[str | None, str | None]:
    """Where ``--snake-activation-tier auto`` writes its plan, and the offload directory
    that path was made in when it is the default (None when --snake-plan-json gives it):
    beside this rank's directory (the flag may be a per-rank template); no file without
    either flag."""
    if args.snake_plan_json is not None or not args.snake_offload_dir:
        return args.snake_plan_json, None
    root = tensor_store.dir.root
    return os.path.join(root, f"activation_plan_rank{tensor_store.dir.rank}.json"), root


def check_activation_plan_path(args, tensor_store) -> None:
    """The plan's path, checked on every rank before any work (the planner checks it again
    when it is made, after the model and its offloaded state are built)."""
    if not (args.snake_offload and args.snake_activation_tier == "auto"):
        return
    error = None
    try:
        path, default_in = activation_plan_path(args, tensor_store)
        if path:
            check_plan_path(path, default_in)
    except PlanPathError as exc:
        error = exc
    raise_unless_all_ranks_ok(error, "activation plan path check")


def make_forward_backward(args, tensor_store=None, device=None, weights=None,
                          units=None) -> StepFn:
    """The step function the flags ask for. With ``--snake-offload``, unit inputs go
    to ``--snake-activation-tier`` through ``tensor_store``, unit weights come from
    ``weights`` (an OffloadedUnits) and the unit partition is ``units`` (a GPTUnits made
    once for the run), when given."""
    if args.snake_activation_offload and not args.snake_offload:
        offloader = SavedTensorOffloader(tensor_store, args.snake_activation_tier,
                                         min_bytes=args.snake_activation_offload_min_bytes)

        def offloaded_megatron_step(model, microbatches, *, forward_only=False):
            offloader.reset_peak()
            losses = activation_offload_forward_backward(
                model, microbatches, forward_only=forward_only, offloader=offloader)
            return StepResult(losses, {} if forward_only else
                              {"saved tensors": dict(offloader.peak)})

        return offloaded_megatron_step
    if not args.snake_offload:
        def megatron_step(model, microbatches, *, forward_only=False):
            return StepResult(megatron_forward_backward(model, microbatches,
                                                        forward_only=forward_only))

        return megatron_step
    schedule = horizontal_forward_backward if args.snake_schedule == "horizontal" \
        else functools.partial(vertical_forward_backward, group_size=args.snake_group_size)

    planner = None
    if args.snake_activation_tier == "auto":
        planner = activation_planner(args, tensor_store, device, weights)
    saved = None
    if args.snake_activation_offload:  # inside each unit's recompute
        saved = SavedTensorOffloader(
            tensor_store, "host" if args.snake_activation_tier == "host" else "nvme",
            min_bytes=args.snake_activation_offload_min_bytes)

    def snake_step(model, microbatches, *, forward_only: bool = False):
        checkpoints = InMemoryStore()
        if planner is not None:
            checkpoints = planner.step_store(len(microbatches), forward_only=forward_only)
        elif args.snake_activation_tier != "device":
            checkpoints = OffloadedUnitInputs(tensor_store, args.snake_activation_tier,
                                               len(microbatches), device,
                                               keep_for_next_unit=forward_window(args))
        if saved is not None:
            saved.add_parameters(model.parameters())  # never offload weights as activations
            saved.reset_peak()
        store = CombinedStore(checkpoints, weights if weights is not None else InMemoryStore(),
                              saved)
        losses = schedule(model, microbatches, checkpoint_interval=args.snake_checkpoint_interval,
                          forward_only=forward_only, store=store, units=units)
        peaks = {}
        if not forward_only:
            if isinstance(checkpoints, OffloadedUnitInputs):
                peaks["unit inputs"] = dict(checkpoints.peak)
            if saved is not None:
                peaks["saved tensors"] = dict(saved.peak)
        if planner is not None and not forward_only:
            planner.after_step(checkpoints)
        elif isinstance(checkpoints, OffloadedUnitInputs):
            checkpoints.finish_step()
        return StepResult(losses, peaks)

    return snake_step
