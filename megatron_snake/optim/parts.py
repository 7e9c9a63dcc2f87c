"""A layout's update parts and how their states are stored.

This rank's shard of every flat layout (a unit's parameters, or the shared ones) is cut at
``split = (1 - alpha) * numel`` into a *backward part* and a *forward part*: each part's
master weights, moments and gradient are records of their own, updated on their own
(``optim/offloaded_adamw.py``). ``PartStates`` knows where the parts are, each parameter's
piece of a part, and the stored form of each state (its dtype, and a scaled state's
per-piece scales: ``optim/precision.py``).
"""

from __future__ import annotations

import torch

from megatron_snake.errors import FlagError
from megatron_snake.optim.dp_shards import DataParallel
from megatron_snake.optim.precision import (REMAINDER, SCALED, Precision, dequantize,
                                            quantize)
from megatron_snake.optim.unit_params import FlatLayout

PARTS = ("bwd", "fwd")

# torch's CPU fused AdamW runs a tensor in vector lanes from its first element, and its last
# (numel mod the lane count) elements on a scalar path whose rounding can differ by an ulp.
# The reference (one tensor per parameter) has lanes wherever a parameter is not at its
# end, so a cut that takes a parameter off its 16-element lines is avoided (the alpha
# split) or bridged (a host buffer's edge: optim/host_update.py).
LANE_ELEMENTS = 16


def part_bounds(lay: FlatLayout, alpha: float, dp: DataParallel = DataParallel()):
    """Element ranges (of the whole flat) of this rank's backward part and forward part.
    The split is moved to the nearest 16-element line of the parameter it falls in, so
    that it cuts no parameter where the per-parameter reference's lanes would not."""
    start, end, _ = dp.shard(lay.numel)
    split = start + int(round((1.0 - alpha) * (end - start)))
    seg = next((s for s in lay.segments if s.offset < split < s.offset + s.numel), None)
    off = (split - seg.offset) % LANE_ELEMENTS if seg and start < split < end else 0
    if off:
        lines = (split - off, min(split - off + LANE_ELEMENTS, seg.offset + seg.numel))
        split = min((c for c in lines + (start, end) if start <= c <= end),
                    key=lambda c: abs(c - split))
    return (start, split), (split, end)


def next_key(name: str, key, part: str) -> tuple:
    """The store key of state ``name`` of a part as an update wrote it out of place, until
    it is the part's state (``("master", key, part)`` and so on)."""
    return (f"{name}.next", key, part)


def check_alpha(alpha: float) -> None:
    """``--snake-alpha``: the deferred (forward) part of each update, 0 to 0.5 of it (the
    flag check and ``OffloadedAdamW`` both call this)."""
    if not 0.0 <= alpha <= 0.5:
        raise FlagError(f"--snake-alpha must be between 0 and 0.5, got {alpha}")


class PartStates:
    """The parts of ``layouts`` ({key: FlatLayout}) on this rank, and each state's stored
    form. The scales of a scaled state (fp16, fp8) are kept here per (state, key, part): a
    list with one multiplier per parameter piece (Transformer Engine's per-tensor scale),
    replaced by each update of the part."""

    def __init__(self, layouts: dict, alpha: float, dp: DataParallel, precision: Precision):
        self.layouts, self.alpha, self.dp, self.precision = layouts, alpha, dp, precision
        self.scales: dict = {}
        self._piece_cache: dict = {}

    def bounds(self, lay: FlatLayout):
        return part_bounds(lay, self.alpha, self.dp)

    def part_range(self, key, part: str) -> tuple[int, int]:
        """(lo, hi) of ``part`` of layout ``key`` in its whole flat."""
        return self.bounds(self.layouts[key])[PARTS.index(part)]

    def parts(self, key) -> list[tuple[str, int, int]]:
        """(part, lo, hi) of each non-empty part of layout ``key``."""
        return [(part, lo, hi) for part, (lo, hi) in zip(PARTS, self.bounds(self.layouts[key]))
                if hi > lo]

    def pieces(self, key, part: str) -> list[tuple[int, int, bool]]:
        """(start, stop, decay) of each parameter's piece of a part, from the part's start:
        what a scale spans and how the chunked update cuts its work."""
        cached = self._piece_cache.get((key, part))
        if cached is None:
            lay = self.layouts[key]
            lo, hi = self.part_range(key, part)
            cached = [(s.start - lo, s.stop - lo, seg.decay) for seg, s in lay.pieces(lo, hi)]
            self._piece_cache[(key, part)] = cached
        return cached

    def start_at_zero(self, name: str, key, part: str) -> None:
        """A fresh scaled moment: zero with scale 1 (Transformer Engine's start)."""
        if self.precision.dtype(name) in SCALED:
            self.scales[(name, key, part)] = [1.0] * len(self.pieces(key, part))

    def set_scales(self, name: str, key, part: str, scales: list, next_: bool = False) -> None:
        """A part's new scales of state ``name``; ``next_``: of the state an update wrote
        out of place, kept apart until ``commit_next`` (or ``drop_next``)."""
        self.scales[(name, key, part, "next") if next_ else (name, key, part)] = scales

    def commit_next(self, key, part: str) -> None:
        """The state written out of place is the part's state now: its scales too."""
        for name in ("master", "exp_avg", "exp_avg_sq"):
            scales = self.scales.pop((name, key, part, "next"), None)
            if scales is not None:
                self.scales[(name, key, part)] = scales

    def drop_next(self, key, part: str) -> None:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            self.scales.pop((name, key, part, "next"), None)

    def encode(self, name: str, key, part: str, values: torch.Tensor) -> torch.Tensor:
        """A state's values of one part (fp32; a master under remainders: its int16
        remainders) as it is stored, with the scales of a scaled dtype recorded."""
        dtype = self.precision.dtype(name)
        if dtype == REMAINDER:
            if values.dtype != REMAINDER:
                raise ValueError(f"{name} of {key} {part}: remainders expected, got "
                                 f"{values.dtype}")
            return values.contiguous()
        if dtype not in SCALED:
            return values.to(dtype=dtype, copy=True).contiguous()
        x = values.to(dtype=torch.float32, copy=True).reshape(-1)
        out = torch.empty(x.numel(), dtype=dtype)
        self.scales[(name, key, part)] = [quantize(x[a:b], dtype, out[a:b])
                                          for a, b, _ in self.pieces(key, part)]
        return out

    def decode(self, name: str, key, part: str, stored: torch.Tensor,
               out: torch.Tensor) -> None:
        """A part's stored state (not remainders) as fp32 values into ``out``."""
        dtype = self.precision.dtype(name)
        if dtype not in SCALED:
            out.copy_(stored)
            return
        for (a, b, _), scale in zip(self.pieces(key, part), self.scales[(name, key, part)]):
            dequantize(stored[a:b], dtype, scale, out[a:b])

    def state_bytes(self) -> int:
        """Bytes of master weights and moments this rank holds, each in its dtype (12 per
        parameter in fp32)."""
        return sum(self.precision.state_bytes * (hi - lo) for lay in self.layouts.values()
                   for lo, hi in self.bounds(lay))

    def grad_bytes(self) -> int:
        """Bytes of this rank's gradients waiting for their update, in their dtype."""
        return sum(self.precision.grad_bytes * (hi - lo) for lay in self.layouts.values()
                   for lo, hi in self.bounds(lay))
