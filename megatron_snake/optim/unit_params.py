"""Which unit owns each parameter, and the flat layouts that unit weights and optimizer
states are stored in.

A parameter read by one unit only belongs to that unit's flat layout: its working weights,
fp32 master copy, moments and gradient are stored, moved and updated as one flat buffer
per unit. A parameter read by several units (a tied embedding: the first and the last unit)
is *shared*: it stays on the compute device, and its update is owned by the lowest unit
that reads it: the backward sweep runs U-1..0, so that is where its gradient becomes final,
and the forward sweep runs 0..U-1, so that is where it is first read again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_snake.models.gpt_units import GPTUnits

SHARED = "shared"


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and 1-D parameters (norms) get no weight decay."""
    return param.dim() == 1 or name.endswith(".bias")


@dataclass
class Segment:
    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    decay: bool
    shape: torch.Size  # recorded: an offloaded parameter's data is empty between uses
    index: int         # position in model.named_parameters(): the order norms are summed in


@dataclass
class FlatLayout:
    """Parameters laid end to end in one flat buffer."""

    key: int | str  # the unit index, or SHARED
    segments: list[Segment]

    @property
    def numel(self) -> int:
        return self.segments[-1].offset + self.segments[-1].numel if self.segments else 0

    def pieces(self, start: int, end: int):
        """(segment, flat slice) for every segment overlapping the element range
        [start, end)."""
        for seg in self.segments:
            lo, hi = max(start, seg.offset), min(end, seg.offset + seg.numel)
            if lo < hi:
                yield seg, slice(lo, hi)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of ``flat``, shaped like the parameter."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.segments]

    def gather(self, device=None, dtype=None) -> torch.Tensor:
        """The parameters' current values as one flat tensor."""
        parts = [s.param.detach().reshape(-1) for s in self.segments]
        flat = torch.cat(parts) if parts else torch.empty(0)
        return flat.to(device=device or flat.device, dtype=dtype or flat.dtype)


def _layout(key, params, names: dict[int, tuple[int, str]]) -> FlatLayout:
    segments, offset = [], 0
    for p in params:
        index, name = names[id(p)]
        segments.append(Segment(name, p, offset, p.numel(), not no_weight_decay(name, p),
                                p.shape, index))
        offset += p.numel()
    return FlatLayout(key, segments)


@dataclass
class UnitParams:
    units: list[FlatLayout]       # per unit: the parameters only that unit reads
    shared: FlatLayout            # parameters read by several units
    shared_owner: int | None      # the unit whose sweeps carry the shared update

    @classmethod
    def of(cls, units: GPTUnits) -> "UnitParams":
        names = {id(p): (i, n) for i, (n, p) in enumerate(units.gpt.named_parameters())}
        reads = [[p for p in units.unit_parameters(u) if p.requires_grad]
                 for u in range(units.num_units)]
        readers: dict[int, list[int]] = {}
        for u, params in enumerate(reads):
            for p in params:
                readers.setdefault(id(p), []).append(u)
        shared = [p for p in dict.fromkeys(p for ps in reads for p in ps)
                  if len(readers[id(p)]) > 1]
        owner = min((readers[id(p)][0] for p in shared), default=None)
        return cls(units=[_layout(u, [p for p in ps if len(readers[id(p)]) == 1], names)
                          for u, ps in enumerate(reads)],
                   shared=_layout(SHARED, shared, names), shared_owner=owner)

    def layouts_owned_by(self, unit: int) -> list[FlatLayout]:
        """The layouts whose gradients are final after ``unit``'s backward."""
        owned = [self.units[unit]]
        if self.shared_owner == unit and self.shared.segments:
            owned.append(self.shared)
        return owned

    def all_layouts(self) -> list[FlatLayout]:
        return self.units + ([self.shared] if self.shared.segments else [])
