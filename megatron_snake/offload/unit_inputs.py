"""Unit checkpoints of the vertical schedule kept in the tiered TensorStore.

Implements the schedule's ``UnitStore`` interface (megatron_snake/schedule/unit_store.py)
for activations: a checkpoint is written to its tier (``host`` or ``nvme``, or per key by a
placement plan, which may also keep it in memory) as soon as a unit produces it, and read
back ahead of use, ``lookahead`` micro-batches ahead in snake order (or, under a plan, at
the plan's prefetch points: activation_plan.PlannedUnitInputs). In the forward sweep a
checkpoint is also kept on the device until the next unit reads it (``keep_for_next_unit``
of them: one snake group's), so the forward sweep reads no checkpoint back: on a GPU each
such read is a copy the device's next micro-batch waits for, and the copies queue with the
weights' and the optimizer's reads. The checkpoints the loss unit reads first in the
backward sweep are served the same way. Unit weights are another store's concern
(megatron_snake/offload/unit_weights.py).
"""

from __future__ import annotations

import torch

from megatron_snake.errors import FlagError
from megatron_snake.schedule.order import snake_order
from megatron_snake.schedule.unit_store import UnitStore

KIND = "activations"


class OffloadedUnitInputs(UnitStore):
    """``tier`` is "host" or "nvme" for every checkpoint, or a function of the checkpoint's
    key giving "gpu" (stay in memory), "host" or "nvme" (a placement plan)."""

    def __init__(self, store, tier, num_microbatches: int, device: torch.device,
                 lookahead: int = 2, keep_for_next_unit: int = 0):
        if isinstance(tier, str) and tier not in ("host", "nvme"):
            raise FlagError(f"--snake-activation-tier: {tier!r} is not an offload tier "
                            "(host or nvme)")
        self.tier_of = tier if callable(tier) else (lambda key: tier)
        self.store, self.device = store, device
        self.num_microbatches, self.lookahead = num_microbatches, lookahead
        self._group = list(range(num_microbatches))  # the sweep's micro-batches
        self._writes = []    # put handles: waited at the end of the step so errors surface
        self._reads = {}     # (unit, mb) -> get handle issued ahead of use
        self._kept = {}      # key -> tensor the plan keeps in memory
        self.keep_for_next_unit = keep_for_next_unit
        self._passing = {}   # key -> tensor just saved, kept for the next unit's read
        self.shapes = set()  # (shape, dtype) of the checkpoints saved: a plan is per shape
        self.live = {"gpu": 0, "host": 0, "nvme": 0}   # checkpoint bytes per tier, now
        self.peak = dict(self.live)                     # ... and at most this step
        self._tier_bytes = {}

    def _key(self, unit: int, microbatch: int):
        return ("ckpt", unit, microbatch)

    def _read_ahead(self, unit: int, after: int | None):
        """Issue reads for the next ``lookahead`` checkpoints of ``unit`` in snake order."""
        order = [self._group[i] for i in snake_order(unit, len(self._group))]
        start = 0 if after is None else order.index(after) + 1
        for mb in order[start:start + self.lookahead]:
            self._issue_read(unit, mb)

    def _issue_read(self, unit: int, microbatch: int) -> bool:
        """Start reading a checkpoint back for its use, unless its read is issued, it is
        still on the device for the next unit, or it is not stored. True if issued."""
        key = self._key(unit, microbatch)
        if (unit, microbatch) in self._reads or key in self._passing or key not in self.store:
            return False
        self._reads[(unit, microbatch)] = self.store.get(key, device=self.device)
        return True

    def save_input(self, unit, microbatch, hidden):
        key = self._key(unit, microbatch)
        tier = self.tier_of(key)
        self.shapes.add((tuple(hidden.shape), hidden.dtype))
        nbytes = hidden.numel() * hidden.element_size()
        self._tier_bytes[key] = (tier, nbytes)
        self.live[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.live[tier])
        if tier == "gpu":
            self._kept[key] = hidden
            return
        self._writes.append(self.store.put(key, hidden, tier=tier, kind=KIND))
        if len(self._passing) < self.keep_for_next_unit:
            self._passing[key] = hidden

    def load_input(self, unit, microbatch):
        key = self._key(unit, microbatch)
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        passing = self._passing.pop(key, None)
        if passing is not None:   # still on the device: its copy stays for later reads
            return passing
        handle = self._reads.pop((unit, microbatch), None)
        prefetched = handle is not None
        if handle is None:
            handle = self.store.get(self._key(unit, microbatch), device=self.device)
        self._read_ahead(unit, after=microbatch)
        return handle.wait(prefetched=prefetched)

    def drop_input(self, unit, microbatch):
        key = self._key(unit, microbatch)
        tier, nbytes = self._tier_bytes.pop(key)
        self.live[tier] -= nbytes
        self._passing.pop(key, None)
        if self._kept.pop(key, None) is None:
            self.store.delete(key)

    def begin_group(self, group):
        """The micro-batches the next sweep visits (a snake group): reads run ahead within
        it only."""
        self._group = list(group)

    def acquire_unit(self, unit, *, next_unit, for_backward):
        self._read_ahead(unit, after=None)  # unit 0 too: on a later pipeline stage it has
        # checkpoints (what the previous stage sent); on the first, none to read

    def release_unit(self, unit, *, gradients_final):
        pass

    def finish_step(self):
        """Wait for every write of the step: an I/O or integrity error raises here."""
        writes, self._writes = self._writes, []
        self._passing.clear()
        for handle in writes:
            handle.wait()
