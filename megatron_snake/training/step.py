"""One training step's forward and backward, the three ways a run can take, behind one
signature, Megatron's ``forward_backward_func``: Megatron-Core's own schedule
(``forward_backward_no_pipelining``, or 1F1B across pipeline stages); the same with the
tensors autograd saves offloaded (``--snake-activation-offload``); and megatron_snake's
snake schedule over the tiered store (``--snake-offload``). Each takes a forward step
function, a data iterator and the model, and returns what the forward step's loss function
reports, one per micro-batch: this project's loop and Megatron-LM's ``train_step`` call
them alike. ``activation_peak`` is the telemetry of the last call (the most bytes each kind
of offloaded activation held per tier: "unit inputs", "saved tensors"; empty when nothing
was offloaded or in evaluation).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining, forward_backward_pipelining_without_interleaving)

from megatron_snake.errors import UserError
from megatron_snake.offload.adaptive import AdaptiveOffloader
from megatron_snake.offload.activation_plan import (ActivationPlanner, PlanPathError,
                                                    check_plan_path)
from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
from megatron_snake.offload.saved_tensors import SavedTensorOffloader, offloaded_forward_step
from megatron_snake.schedule.loss import microbatch_call, report_losses
from megatron_snake.schedule.pipeline import snake_forward_backward
from megatron_snake.schedule.unit_store import CombinedStore, InMemoryStore
from megatron_snake.training.distributed import raise_unless_all_ranks_ok
from megatron_snake.training.offloaded_state import forward_window, unit_working_set_bytes


def megatron_schedule():
    """Megatron-Core's schedule for this run's pipeline: 1F1B across stages, else
    ``forward_backward_no_pipelining``."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def megatron_forward_backward(model, microbatches, *, forward_only: bool = False):
    """Megatron-Core's schedule over a list of batch dicts with pretrain_gpt's forward
    step: the per-micro-batch losses (on the last pipeline stage; empty elsewhere). The
    reference the snake is compared with."""
    return report_losses(megatron_schedule()(**microbatch_call(model, microbatches),
                                             forward_only=forward_only))


def activation_offload_forward_backward(model, microbatches, *, offloader,
                                       forward_only: bool = False):
    """``megatron_forward_backward`` with the tensors autograd saves offloaded by
    ``offloader`` (SSDTrain); every write has landed when it returns."""
    step = ActivationOffloadStep(offloader)
    return report_losses(step(**microbatch_call(model, microbatches),
                              forward_only=forward_only))


class ProfileOutOfMemory(UserError, MemoryError):
    """The adaptive policy's profiled iteration (nothing offloaded) did not fit."""


class ActivationOffloadStep:
    """Megatron's schedule with the tensors autograd saves in the user's forward step
    offloaded (``--snake-activation-offload`` without ``--snake-offload``)."""

    def __init__(self, offloader: SavedTensorOffloader):
        self.offloader, self.activation_peak = offloader, {}

    def __call__(self, *, forward_step_func, model, forward_only: bool = False, **kwargs):
        self.offloader.reset_peak()
        for m in (model if isinstance(model, list) else [model]):
            self.offloader.add_parameters(m.parameters())  # weights are never offloaded
        self.offloader.begin_step(forward_only)
        # a plan that offloads nothing costs nothing: the user's forward step runs bare
        step_func = forward_step_func if self.offloader.leaves_all else \
            offloaded_forward_step(forward_step_func, self.offloader)
        try:
            reports = megatron_schedule()(forward_step_func=step_func, model=model,
                                          forward_only=forward_only, **kwargs)
        except torch.OutOfMemoryError as exc:
            if self.offloader.profiling:
                raise ProfileOutOfMemory(
                    "--snake-activation-offload-policy adaptive: out of device memory in a "
                    "profiled iteration, which keeps every saved tensor to time it; use "
                    "--snake-activation-offload-policy all (every saved tensor over "
                    "--snake-activation-offload-min-bytes goes), or a smaller "
                    "--micro-batch-size") from exc
            raise
        self.offloader.end_step()
        self.offloader.synchronize()
        self.activation_peak = {} if forward_only else {"saved tensors":
                                                       dict(self.offloader.peak)}
        return reports


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


def make_forward_backward(args, tensor_store=None, device=None, weights=None, units=None):
    """The ``forward_backward_func`` the flags ask for. With ``--snake-offload``, unit inputs
    go to ``--snake-activation-tier`` through ``tensor_store``, unit weights come from
    ``weights`` (an OffloadedUnits, which then owns the gradients) and the unit partition is
    ``units`` (a GPTUnits made once for the run), when given."""
    if args.snake_activation_offload and not args.snake_offload:
        return ActivationOffloadStep(saved_tensor_offloader(args, tensor_store))
    if not args.snake_offload:
        return megatron_schedule()
    return SnakeStep(args, tensor_store, device, weights, units)


def saved_tensor_offloader(args, tensor_store) -> SavedTensorOffloader:
    """The offloader of ``--snake-activation-offload`` on Megatron's schedule: every save
    over the minimum (policy all), or those the profiled plan hides (adaptive; its plan is
    written beside this rank's offload directory when there is one)."""
    if args.snake_activation_offload_policy == "all":
        return SavedTensorOffloader(tensor_store, args.snake_activation_tier,
                                    min_bytes=args.snake_activation_offload_min_bytes)
    path = None
    if args.snake_offload_dir:
        path = os.path.join(tensor_store.dir.root,
                            f"saved_tensor_plan_rank{tensor_store.dir.rank}.json")
        if os.path.isdir(path) and not os.path.islink(path):   # refused now, not when written
            raise PlanPathError(
                f"the saved-tensor offload plan's path {path} (in --snake-offload-dir "
                f"{tensor_store.dir.root}) is a directory this run did not make; remove it")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return AdaptiveOffloader(tensor_store, args.snake_activation_tier,
                             min_bytes=args.snake_activation_offload_min_bytes,
                             profile_iters=args.snake_profile_iters, plan_path=path,
                             log=print if rank0 else (lambda *a: None))


class SnakeStep:
    """The snake schedule over the run's store (``--snake-offload``), with Megatron's
    ``forward_backward_func`` signature: a fresh checkpoint store per step (placed by the
    activation plan, or on ``--snake-activation-tier``), the unit weights, and the saved
    tensors of each unit's recompute when ``--snake-activation-offload`` is given too."""

    def __init__(self, args, tensor_store, device, weights, units):
        self.args, self.tensor_store, self.device = args, tensor_store, device
        self.weights, self.units = weights, units
        self.group_size = 1 if args.snake_schedule == "horizontal" else args.snake_group_size
        self.planner = None
        if args.snake_activation_tier == "auto":
            self.planner = activation_planner(args, tensor_store, device, weights)
        self.saved = None
        if args.snake_activation_offload:  # inside each unit's recompute
            self.saved = SavedTensorOffloader(
                tensor_store, "host" if args.snake_activation_tier == "host" else "nvme",
                min_bytes=args.snake_activation_offload_min_bytes)
        self.activation_peak: dict = {}

    def _checkpoint_store(self, num_microbatches: int, forward_only: bool):
        args = self.args
        if self.planner is not None:
            return self.planner.step_store(num_microbatches, forward_only=forward_only)
        if args.snake_activation_tier != "device":
            return OffloadedUnitInputs(self.tensor_store, args.snake_activation_tier,
                                       num_microbatches, self.device,
                                       keep_for_next_unit=forward_window(args))
        return InMemoryStore()

    def __call__(self, *, model, num_microbatches: int, forward_only: bool = False,
                 **megatron_kwargs):
        checkpoints = self._checkpoint_store(num_microbatches, forward_only)
        if self.saved is not None:
            chunk = model[0] if isinstance(model, (list, tuple)) else model
            self.saved.add_parameters(chunk.parameters())  # never offload weights
            self.saved.reset_peak()
        store = CombinedStore(checkpoints, self.weights if self.weights is not None
                              else InMemoryStore(), self.saved)
        reports = snake_forward_backward(
            model=model, num_microbatches=num_microbatches, forward_only=forward_only,
            **megatron_kwargs, group_size=self.group_size,
            checkpoint_interval=self.args.snake_checkpoint_interval, store=store,
            units=self.units, finalize_grads=self.weights is None)
        peaks = {}
        if not forward_only:
            if isinstance(checkpoints, OffloadedUnitInputs):
                peaks["unit inputs"] = dict(checkpoints.peak)
            if self.saved is not None:
                peaks["saved tensors"] = dict(self.saved.peak)
        if self.planner is not None and not forward_only:
            self.planner.after_step(checkpoints)
        elif isinstance(checkpoints, OffloadedUnitInputs):
            checkpoints.finish_step()
        self.activation_peak = peaks
        return reports
