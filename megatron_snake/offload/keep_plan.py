"""Which saved tensors to offload: SSDTrain's adaptive keep on TERAIO's lifetimes.

A profiled step (``SaveProfile``) says, for every tensor autograd saved that could go to the
tier, its micro-batch (``group``), its pack ordinal in that micro-batch's forward, its
bytes, when it was packed, when backward first needed it and when it was last needed; and,
per micro-batch, the time of every unpack of such a tensor (the moments a read can be
issued at). ``plan_offload`` picks the saves whose write and read-back the drive hides behind
the compute between them, so offloading them costs (almost) no step time.

The drive is one FIFO queue. A write is queued at its pack; a read is queued at an unpack of
its micro-batch's backward (the earliest: the first), in unpack order, behind everything
queued before it (so behind its own write). A read is on time when it ends by its unpack,
plus the allowance: ``allowance`` of the time elapsed since the step began (the allowance
spread over the step: at most that fraction of the step is added). Greedy: candidates by
decreasing lifetime x bytes (the ones that lower the peak most), each added if every chosen
read stays on time. Then each read is issued as late as the queue allows (as late an unpack
as still lets it and every read after it end on time), so read-backs do not pile up in
memory at the start of backward.

Pure: no torch, no clock; ``SaveProfile`` is built by the offloader (offload/adaptive.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# The step time the plan may add, as a fraction of the step: under the 3% the offload may
# cost, leaving room for what the profile does not see (the store's own CPU time).
ALLOWANCE = 0.02


@dataclass(frozen=True)
class Save:
    """One storage autograd saved (a second save of it is the same Save)."""

    group: int          # micro-batch within the step
    ordinal: int        # its pack position among the group's candidate storages
    nbytes: int
    pack_s: float       # seconds since the step began
    unpack_s: float     # first unpack
    last_use_s: float   # last unpack (the storage is freed after it)

    @property
    def key(self) -> tuple[int, int]:
        return (self.group, self.ordinal)


@dataclass
class SaveProfile:
    saves: list[Save]
    unpacks: dict[int, list[float]]   # group -> time of each unpack, in order
    step_s: float


@dataclass(frozen=True)
class Offload:
    nbytes: int
    issue_at: int       # the read is issued at the group's unpack number issue_at (from 0)


@dataclass
class KeepPlan:
    offload: dict[tuple[int, int], Offload]
    saves: int
    bytes_total: int
    peak_before: int        # the saved storages' peak, all kept
    peak_after: int         # with the plan's offloads
    added_s: float          # predicted step time added (the latest read's lateness)
    step_s: float
    rates: tuple[float, float]   # (read, write) bytes per second
    profiled_saves: list[Save] = field(default_factory=list, repr=False)

    @property
    def bytes_offloaded(self) -> int:
        return sum(o.nbytes for o in self.offload.values())

    def summary(self) -> str:
        cut = 1 - self.peak_after / self.peak_before if self.peak_before else 0.0
        return (f"{len(self.offload)} of {self.saves} saved tensors offloaded "
                f"({self.bytes_offloaded / 2**20:.1f} of {self.bytes_total / 2**20:.1f} MiB a "
                f"step); predicted peak of saved tensors {cut:.0%} lower, step "
                f"+{self.added_s * 1e3:.2f} ms of {self.step_s * 1e3:.1f} ms"
                + ("" if self.offload or not self.saves else
                   "; all kept: no save's write and read-back fit in the compute between "
                   "its pack and its unpack at the tier's rates"))

    def to_json(self) -> str:
        return json.dumps({
            "read_Bps": self.rates[0], "write_Bps": self.rates[1], "step_s": self.step_s,
            "added_s": self.added_s, "peak_before": self.peak_before,
            "peak_after": self.peak_after,
            "saves": [{"group": s.group, "ordinal": s.ordinal, "nbytes": s.nbytes,
                       "pack_s": s.pack_s, "unpack_s": s.unpack_s,
                       "offload": s.key in self.offload,
                       "issue_at": self.offload[s.key].issue_at if s.key in self.offload
                       else None} for s in self.profiled_saves]}, indent=1)


def plan_offload(profile: SaveProfile, read_Bps: float, write_Bps: float,
                 allowance: float = ALLOWANCE) -> KeepPlan:
    """The largest set, greedily, of saves whose tier traffic the compute hides."""
    if read_Bps <= 0 or write_Bps <= 0:
        raise ValueError(f"rates must be > 0, got read {read_Bps}, write {write_Bps}")
    saves = profile.saves
    order = sorted(saves, key=lambda s: (s.unpack_s - s.pack_s) * s.nbytes, reverse=True)
    chosen: list[Save] = []
    for s in order:
        trial = chosen + [s]
        if _on_time(profile, trial, _first_unpack(trial), read_Bps, write_Bps, allowance):
            chosen = trial
    issue = _latest_issue(profile, chosen, read_Bps, allowance)
    if not _on_time(profile, chosen, issue, read_Bps, write_Bps, allowance):
        issue = _first_unpack(chosen)   # the late issue met other groups' writes: the
        # earliest, which the greedy checked, is on time
    writes, reads = _queue(profile, chosen, issue, read_Bps, write_Bps)
    added = max((reads[s.key] - s.unpack_s for s in chosen), default=0.0)
    return KeepPlan(
        offload={s.key: Offload(s.nbytes, issue[s.key]) for s in chosen}, saves=len(saves),
        bytes_total=sum(s.nbytes for s in saves), peak_before=_peak(profile, {}, {}, {}),
        peak_after=_peak(profile, writes, reads,
                         {s.key: _issue_time(profile, s, issue) for s in chosen}),
        added_s=max(0.0, added), step_s=profile.step_s, rates=(read_Bps, write_Bps),
        profiled_saves=list(saves))


def _first_unpack(chosen) -> dict:
    return {s.key: 0 for s in chosen}


def _issue_time(profile, s: Save, issue) -> float:
    times = profile.unpacks.get(s.group) or [s.unpack_s]
    return times[min(issue[s.key], len(times) - 1)]


def _deadline(s: Save, allowance: float) -> float:
    return s.unpack_s * (1 + allowance)


def _queue(profile, chosen, issue, read_Bps, write_Bps):
    """Run the FIFO drive: -> ({key: write end}, {key: read end})."""
    ops = []   # (queued at, 0 write / 1 read, tie-break, save)
    for s in chosen:
        ops.append((s.pack_s, 0, s.ordinal, s))
        ops.append((_issue_time(profile, s, issue), 1, s.unpack_s, s))
    ops.sort(key=lambda op: op[:3])
    free, writes, reads = 0.0, {}, {}
    for at, kind, _, s in ops:
        start = max(at, free)
        if kind == 0:
            free = writes[s.key] = start + s.nbytes / write_Bps
        else:
            free = reads[s.key] = max(start, writes[s.key]) + s.nbytes / read_Bps
    return writes, reads


def _on_time(profile, chosen, issue, read_Bps, write_Bps, allowance) -> bool:
    reads = _queue(profile, chosen, issue, read_Bps, write_Bps)[1]
    return all(reads[s.key] <= _deadline(s, allowance) for s in chosen)


def _latest_issue(profile, chosen, read_Bps, allowance) -> dict:
    """Per group, backwards in unpack order: the latest each read may start so that it and
    every later read of the group end on time; issued at the last unpack before that."""
    issue = {}
    for group in {s.group for s in chosen}:
        times = profile.unpacks.get(group) or []
        reads = sorted((s for s in chosen if s.group == group), key=lambda s: s.unpack_s)
        latest_start = float("inf")
        for s in reversed(reads):
            latest_start = min(_deadline(s, allowance), latest_start) - s.nbytes / read_Bps
            issue[s.key] = max([k for k, t in enumerate(times) if t <= latest_start],
                               default=0)
    return issue


def _peak(profile, write_ends: dict, read_ends: dict, read_issued: dict) -> int:
    """Peak bytes of the saved storages: a kept one from pack to its last use; an offloaded
    one from pack until its write ends, and again from its read's issue to its last use."""
    deltas = []
    for s in profile.saves:
        if s.key in read_ends:
            deltas += [(s.pack_s, s.nbytes), (write_ends[s.key], -s.nbytes),
                       (read_issued[s.key], s.nbytes), (s.last_use_s, -s.nbytes)]
        else:
            deltas += [(s.pack_s, s.nbytes), (s.last_use_s, -s.nbytes)]
    deltas.sort(key=lambda d: (d[0], -d[1]))   # at one instant, count the rise first
    live = peak = 0
    for _, d in deltas:
        live += d
        peak = max(peak, live)
    return peak
