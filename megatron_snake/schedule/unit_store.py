"""What the vertical schedule asks of storage: unit inputs and unit weights.

The schedule never knows where a tensor lives. It saves a unit's input (its activation
checkpoint) and loads it back later; it acquires a unit's weights before computing the unit
(naming the unit it will need next, so a store can prefetch it) and releases them after.
``UnitStore`` names every call the schedule makes, with a default that does nothing where
a store may have nothing to do; ``InMemoryStore`` keeps everything where it is; the stores
of megatron_snake.offload implement the same calls over GPU, host memory and NVMe.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


class UnitStore:
    """The storage interface of the sweeps (schedule/sweeps.py)."""

    # --- unit inputs: a store that keeps none (weights only) need not implement these
    def save_input(self, unit: int, microbatch: int, hidden: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no unit inputs")

    def load_input(self, unit: int, microbatch: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} keeps no unit inputs")

    def drop_input(self, unit: int, microbatch: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no unit inputs")

    # --- unit weights
    def acquire_unit(self, unit: int, *, next_unit: int | None, for_backward: bool) -> None:
        """The unit's weights are in its parameters from now on (the model's own: nothing)."""

    def release_unit(self, unit: int, *, gradients_final: bool) -> None:
        """The unit is done for this sweep; ``gradients_final``: for this step too."""

    # --- hooks
    def begin_group(self, group: list[int]) -> None:
        """The micro-batches the next sweep visits (a snake group), for reading ahead."""

    def compute_event(self, sweep: str, unit: int, microbatch: int):
        """A context around one (unit, micro-batch) computation: a profiler times it."""
        return nullcontext()

    def saved_tensors(self):
        """A context for the tensors autograd saves inside a unit's recompute (an
        SSDTrain offloader), or nothing."""
        return nullcontext()


class InMemoryStore(UnitStore):
    """Unit inputs stay on the compute device; weights stay in the model."""

    def __init__(self):
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}

    def save_input(self, unit, microbatch, hidden):
        key = (unit, microbatch)
        if key in self._inputs:
            raise KeyError(f"input of unit {unit}, micro-batch {microbatch} saved twice")
        self._inputs[key] = hidden

    def load_input(self, unit, microbatch):
        try:
            return self._inputs[(unit, microbatch)]
        except KeyError:
            raise KeyError(f"no input of unit {unit}, micro-batch {microbatch}") from None

    def drop_input(self, unit, microbatch):
        del self._inputs[(unit, microbatch)]


class CombinedStore(UnitStore):
    """Unit inputs and their hooks from one store, unit weights from another, and
    optionally an offloader for the tensors autograd saves inside each unit's recompute."""

    def __init__(self, inputs: UnitStore, weights: UnitStore, saved=None):
        self.inputs, self.weights, self.saved = inputs, weights, saved

    def saved_tensors(self):
        return self.saved if self.saved is not None else nullcontext()

    def save_input(self, unit, microbatch, hidden):
        self.inputs.save_input(unit, microbatch, hidden)

    def load_input(self, unit, microbatch):
        return self.inputs.load_input(unit, microbatch)

    def drop_input(self, unit, microbatch):
        self.inputs.drop_input(unit, microbatch)

    def acquire_unit(self, unit, *, next_unit, for_backward):
        self.weights.acquire_unit(unit, next_unit=next_unit, for_backward=for_backward)

    def release_unit(self, unit, *, gradients_final):
        self.weights.release_unit(unit, gradients_final=gradients_final)

    def compute_event(self, sweep, unit, microbatch):
        return self.inputs.compute_event(sweep, unit, microbatch)

    def begin_group(self, group):
        self.inputs.begin_group(group)
