"""Unit checkpoints of the vertical schedule kept in the tiered TensorStore.

Implements the schedule's ``UnitStore`` interface (megatron_snake/schedule/unit_store.py)
for activations: a checkpoint is written to ``host`` or ``nvme`` as soon as a unit produces
it, and read back ahead of use, ``lookahead`` micro-batches ahead in snake order. The first
micro-batch into a unit is the one that just left the previous unit; its read is served from
memory while its write is still in flight (the store forwards it). Weights stay in the model
(their offload is a later layer).
"""

from __future__ import annotations

import torch

from megatron_snake.schedule.order import snake_order

KIND = "activations"


class OffloadedCheckpoints:
    def __init__(self, store, tier: str, num_microbatches: int, device: torch.device,
                 lookahead: int = 2):
        if tier not in ("host", "nvme"):
            raise ValueError(f"--snake-activation-tier: {tier!r} is not an offload tier "
                             "(host or nvme)")
        self.store, self.tier, self.device = store, tier, device
        self.num_microbatches, self.lookahead = num_microbatches, lookahead
        self._writes = []    # put handles: waited at the end of the step so errors surface
        self._reads = {}     # (unit, mb) -> get handle issued ahead of use

    def _key(self, unit: int, microbatch: int):
        return ("ckpt", unit, microbatch)

    def _read_ahead(self, unit: int, after: int | None):
        """Issue reads for the next ``lookahead`` checkpoints of ``unit`` in snake order."""
        order = list(snake_order(unit, self.num_microbatches))
        start = 0 if after is None else order.index(after) + 1
        for mb in order[start:start + self.lookahead]:
            if (unit, mb) not in self._reads and self._key(unit, mb) in self.store:
                self._reads[(unit, mb)] = self.store.get(self._key(unit, mb), device=self.device)

    def save_checkpoint(self, unit, microbatch, hidden):
        self._writes.append(self.store.put(self._key(unit, microbatch), hidden, tier=self.tier,
                                           kind=KIND))

    def load_checkpoint(self, unit, microbatch):
        handle = self._reads.pop((unit, microbatch), None)
        if handle is None:
            handle = self.store.get(self._key(unit, microbatch), device=self.device)
        self._read_ahead(unit, after=microbatch)
        return handle.wait()

    def drop_checkpoint(self, unit, microbatch):
        self.store.delete(self._key(unit, microbatch))

    def acquire_unit(self, unit, *, next_unit, for_backward):
        if unit > 0:
            self._read_ahead(unit, after=None)

    def release_unit(self, unit, *, gradients_final):
        pass

    def finish_step(self):
        """Wait for every write of the step: an I/O or integrity error raises here."""
        writes, self._writes = self._writes, []
        for handle in writes:
            handle.wait()
