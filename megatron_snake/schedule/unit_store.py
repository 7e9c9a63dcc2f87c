"""What the vertical schedule asks of storage: unit-input checkpoints and unit weights.

The schedule never knows where a tensor lives. It saves a checkpoint and loads it back
later; it acquires a unit's weights before computing the unit (naming the unit it will
need next, so a store can prefetch it) and releases them after. ``InMemoryStore`` keeps
everything where it is; the offloading stores of megatron_snake.offload implement the same
methods over GPU, host memory and NVMe.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

import torch


def compute_event(store, sweep: str, unit: int, microbatch: int):
    """The optional ``compute_event`` context of a store (a profiler times the schedule's
    work through it), or nothing."""
    hook = getattr(store, "compute_event", None)
    return hook(sweep, unit, microbatch) if hook is not None else nullcontext()


class UnitStore(Protocol):
    def save_checkpoint(self, unit: int, microbatch: int, hidden: torch.Tensor) -> None: ...

    def load_checkpoint(self, unit: int, microbatch: int) -> torch.Tensor: ...

    def drop_checkpoint(self, unit: int, microbatch: int) -> None: ...

    def acquire_unit(self, unit: int, *, next_unit: int | None, for_backward: bool) -> None: ...

    def release_unit(self, unit: int, *, gradients_final: bool) -> None: ...


class InMemoryStore:
    """Checkpoints stay on the compute device; weights stay in the model."""

    def __init__(self):
        self._checkpoints: dict[tuple[int, int], torch.Tensor] = {}

    def save_checkpoint(self, unit, microbatch, hidden):
        key = (unit, microbatch)
        if key in self._checkpoints:
            raise KeyError(f"checkpoint for unit {unit}, micro-batch {microbatch} saved twice")
        self._checkpoints[key] = hidden

    def load_checkpoint(self, unit, microbatch):
        try:
            return self._checkpoints[(unit, microbatch)]
        except KeyError:
            raise KeyError(f"no checkpoint for unit {unit}, micro-batch {microbatch}") from None

    def drop_checkpoint(self, unit, microbatch):
        del self._checkpoints[(unit, microbatch)]

    def acquire_unit(self, unit, *, next_unit, for_backward):
        pass

    def release_unit(self, unit, *, gradients_final):
        pass


def begin_group(store, group: list[int]) -> None:
    """Tell a store with a ``begin_group`` hook which micro-batches the next sweep visits
    (a snake group), so it reads ahead within them only."""
    hook = getattr(store, "begin_group", None)
    if hook is not None:
        hook(group)


def saved_tensors(store):
    """The store's optional context for the tensors autograd saves while a unit is
    recomputed (an SSDTrain offloader), or nothing."""
    hook = getattr(store, "saved_tensors", None)
    return hook() if hook is not None else nullcontext()


class CombinedStore:
    """Checkpoints from one store, unit weights from another, and optionally an offloader
    for the tensors autograd saves inside each unit's recompute."""

    def __init__(self, checkpoints, weights, saved=None):
        self.checkpoints, self.weights, self.saved = checkpoints, weights, saved

    def saved_tensors(self):
        return self.saved if self.saved is not None else nullcontext()

    def save_checkpoint(self, unit, microbatch, hidden):
        self.checkpoints.save_checkpoint(unit, microbatch, hidden)

    def load_checkpoint(self, unit, microbatch):
        return self.checkpoints.load_checkpoint(unit, microbatch)

    def drop_checkpoint(self, unit, microbatch):
        self.checkpoints.drop_checkpoint(unit, microbatch)

    def acquire_unit(self, unit, *, next_unit, for_backward):
        self.weights.acquire_unit(unit, next_unit=next_unit, for_backward=for_backward)

    def release_unit(self, unit, *, gradients_final):
        self.weights.release_unit(unit, gradients_final=gradients_final)

    def compute_event(self, sweep, unit, microbatch):
        return compute_event(self.checkpoints, sweep, unit, microbatch)

    def begin_group(self, group):
        begin_group(self.checkpoints, group)
