"""Lifetime-aware placement (TERAIO): which tracked tensors stay on the GPU, which go to host
memory or NVMe between their uses, and when each is prefetched back.

Semantics of a plan (the planner, `simulate` and the schedule all follow them):
- Events run back to back with the profiled durations (lifetimes.Timeline).
- A tensor on tier host/nvme is written there once, issued at the end of the event that
  produces it. For each of its "offloads" (release_after, prefetch_at) its GPU copy is
  released after event `release_after` (one of its accesses) once that write is done, and a
  read back is issued at the start of event `prefetch_at`; the read must arrive before the
  tensor's next access begins. The GPU memory of a prefetch counts from its issue.
- Each tier is one channel (a FIFO queue) at min(tier bandwidth, pcie): transfers run one at
  a time, in order of (issue time, writes before reads, lifetime order, gap). Host and NVMe
  channels run concurrently.
- A host-tier tensor holds host memory from its write until its last use ends.

Greedy (TERAIO's benefit/cost): while the GPU peak exceeds the budget, take the tensors that
sit idle across the peak event and offload the one with the highest benefit/cost (bytes x idle
time / transfer time) to the slowest tier on which the prefetch, issued as late as possible,
still arrives in time without making any other transfer late, within the host budget. Short
idle gaps at the end of the forward (the last units' checkpoints, needed first in backward)
have the lowest benefit and are the first to miss their deadline behind a slow drive's write
backlog: they stay on the GPU (SSDTrain's adaptive keep).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
from dataclasses import dataclass, field

import numpy as np

from megatron_snake.placement.lifetimes import TensorLifetime, Timeline, validate
from megatron_snake.storage.sizes import TIERS, gib

OFF_TIERS = ("nvme", "host")          # slowest first: NVMe is plentiful, host memory is not
INF = float("inf")


def _seconds(nbytes, rate):
    if nbytes == 0 or rate == INF:
        return 0.0
    return INF if rate <= 0 else nbytes / rate


def _rates(bandwidth, pcie_Bps, tier):
    """(read, write) bytes/s of tier's channel; (0, 0) for a tier that is not offered."""
    if tier not in bandwidth:
        return 0.0, 0.0
    r, w = bandwidth[tier]
    return min(float(r), float(pcie_Bps)), min(float(w), float(pcie_Bps))


def fingerprint(lifetimes: list[TensorLifetime], timeline: Timeline) -> str:
    """Changes when sizes, lifetimes or events change (then re-plan); ignores durations."""
    text = repr([(lt.key, lt.nbytes, lt.accesses) for lt in lifetimes]) + \
        repr([e.name for e in timeline.events])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


# ==================================================================== the plan

@dataclass
class Placement:
    tier: str = "gpu"
    nbytes: int = 0
    offloads: list = field(default_factory=list)   # [(release_after, prefetch_at)]

    @property
    def prefetch_at(self) -> list[int]:
        return [p for _, p in self.offloads]


def _enc(k):
    return [_enc(x) for x in k] if isinstance(k, tuple) else k


def _dec(k):
    return tuple(_dec(x) for x in k) if isinstance(k, list) else k


@dataclass
class Plan:
    placements: dict                 # key -> Placement
    peak_bytes: dict                 # tier -> bytes, the planner's (per-event, conservative)
    stall_s: float
    gpu_budget_bytes: int
    host_budget_bytes: int
    fingerprint: str = ""

    def tier(self, key) -> str:
        return self.placements[key].tier

    def kept(self) -> list:
        """Keys that never leave the GPU."""
        return [k for k, p in self.placements.items() if not p.offloads]

    def actions(self, lifetimes: list[TensorLifetime]) -> dict:
        """{event: [(phase, op, key)]}, phase "before"/"after" the event, op "write" (put to
        the tier), "release" (drop the GPU copy once the write is done) or "prefetch" (start
        the read back). Issue them in this order: it is the channel order the plan assumes."""
        out: dict = {}
        for lt in lifetimes:
            pl = self.placements.get(lt.key)
            if pl is None or pl.tier == "gpu":
                continue
            out.setdefault(lt.produced_at, []).append(("after", "write", lt.key))
            for rel, pre in pl.offloads:
                out.setdefault(rel, []).append(("after", "release", lt.key))
                out.setdefault(pre, []).append(("before", "prefetch", lt.key))
        return dict(sorted(out.items()))

    def summary(self, max_lines: int = 20) -> str:
        count = {t: [0, 0] for t in TIERS}
        for p in self.placements.values():
            count[p.tier][0] += 1
            count[p.tier][1] += p.nbytes
        total = sum(c[1] for c in count.values())
        lines = [f"placement plan {self.fingerprint}: {len(self.placements)} tensors, "
                 f"{gib(total, 3)}: "
                 + ", ".join(f"{t} {c[0]} ({gib(c[1], 3)})" for t, c in count.items()),
                 f"  peak gpu {gib(self.peak_bytes['gpu'], 3)} of {gib(self.gpu_budget_bytes, 3)}"
                 f" | host {gib(self.peak_bytes['host'], 3)} of {gib(self.host_budget_bytes, 3)}"
                 f" | nvme {gib(self.peak_bytes['nvme'], 3)} | predicted stall {self.stall_s:.3f} s"]
        for i, (k, p) in enumerate(self.placements.items()):
            if i == max_lines:
                lines.append(f"  ... {len(self.placements) - max_lines} more")
                break
            lines.append(f"  {k!r}: {p.tier}" + "".join(
                f", off after event {r} back from {f}" for r, f in p.offloads))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({
            "version": 1, "fingerprint": self.fingerprint, "stall_s": self.stall_s,
            "gpu_budget_bytes": self.gpu_budget_bytes, "host_budget_bytes": self.host_budget_bytes,
            "peak_bytes": self.peak_bytes,
            "placements": [{"key": _enc(k), "tier": p.tier, "nbytes": p.nbytes,
                            "offloads": [list(o) for o in p.offloads]}
                           for k, p in self.placements.items()]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        if d.get("version") != 1:
            raise ValueError(f"unknown plan version {d.get('version')!r}")
        placements = {_dec(p["key"]): Placement(p["tier"], p["nbytes"],
                                                [tuple(o) for o in p["offloads"]])
                      for p in d["placements"]}
        return cls(placements, d["peak_bytes"], d["stall_s"], d["gpu_budget_bytes"],
                   d["host_budget_bytes"], d["fingerprint"])


# ==================================================================== the planner

def make_plan(lifetimes: list[TensorLifetime], timeline: Timeline, *, gpu_budget_bytes: int,
              host_budget_bytes: int, bandwidth: dict, pcie_Bps: float = INF,
              host_first: bool = False) -> Plan:
    """bandwidth: {"host"|"nvme": (read_Bps, write_Bps)}; a tier left out is not used.
    ``host_first``: a tensor leaving the GPU tries host memory (within its budget) before
    the drive, for a drive this plan does not own (the offloaded state's weights and
    optimizer state use it too); else the slowest tier that is in time, as TERAIO.
    Raises ValueError naming --snake-gpu-memory-limit when the budget cannot be met."""
    validate(lifetimes, timeline)
    return _Planner(lifetimes, timeline, gpu_budget_bytes, host_budget_bytes, bandwidth,
                    pcie_Bps, host_first).run()


def _needed_per_event(lifetimes: list[TensorLifetime], timeline: Timeline) -> np.ndarray:
    """Bytes each event needs on the GPU whatever the plan: its working set and the tensors
    it accesses."""
    need = np.array([e.working_bytes for e in timeline.events], dtype=np.int64)
    for lt in lifetimes:
        for a in lt.accesses:
            need[a] += lt.nbytes
    return need


def minimum_gpu_bytes(lifetimes: list[TensorLifetime], timeline: Timeline) -> int:
    """The smallest GPU budget any plan can meet."""
    return int(_needed_per_event(lifetimes, timeline).max(initial=0))


class _Planner:
    """Bookkeeping per event: a tensor counts on the GPU for every event it is resident in
    at any moment (conservative against the continuous-time simulator)."""

    def __init__(self, lifetimes, timeline, gpu_budget, host_budget, bandwidth, pcie_Bps,
                 host_first=False):
        self.lts, self.timeline = lifetimes, timeline
        self.gpu_budget, self.host_budget = int(gpu_budget), int(host_budget)
        self.bounds = timeline.bounds()
        self.n_events = len(timeline)
        self.working = np.array([e.working_bytes for e in timeline.events], dtype=np.int64)
        self.rates = {t: _rates(bandwidth, pcie_Bps, t) for t in OFF_TIERS}
        self.tiers = [t for t in OFF_TIERS if t in bandwidth and (t != "host" or host_budget > 0)]
        # the order a tensor still on the GPU tries the tiers in (a retry is always faster)
        self.first_tiers = self.tiers[::-1] if host_first else self.tiers
        self.tier = [None] * len(lifetimes)           # None: on the GPU
        self.off = [{} for _ in lifetimes]            # per tensor: gap index -> prefetch_at

    # ---------------------------------------------------------------- bookkeeping

    def _decision(self, j, trial):
        """(tier, {gap: prefetch_at}) of tensor j, with trial = (j, tier, offs) applied."""
        if trial is not None and trial[0] == j:
            return trial[1], trial[2]
        return self.tier[j], self.off[j]

    def _queue(self, tier, trial=None):
        """Run tier's FIFO channel. Returns ({(j, gap): finish time}, all on time?), gap -1
        being the write. Deadlines: a read before its next access starts; a write before
        the tensor's first prefetch is issued (else its GPU copy is never released)."""
        rd, wr = self.rates[tier]
        reqs = []
        for j, lt in enumerate(self.lts):
            t, offs = self._decision(j, trial)
            if t != tier:
                continue
            acc = lt.accesses
            first = min(offs.values(), default=self.n_events)
            reqs.append((self.bounds[acc[0] + 1], 0, j, -1, _seconds(lt.nbytes, wr),
                         self.bounds[first]))
            for i, p in offs.items():
                reqs.append((self.bounds[p], 1, j, i, _seconds(lt.nbytes, rd),
                             self.bounds[acc[i + 1]]))
        reqs.sort(key=lambda q: q[:4])
        done, busy, ok = {}, 0.0, True
        for issue, _, j, i, dur, deadline in reqs:
            busy = max(busy, issue) + dur
            done[(j, i)] = busy
            ok = ok and busy <= deadline
        return done, ok

    def _usage(self, done, trial=None):
        """(GPU bytes per event, host bytes per event) for the decisions with trial applied."""
        gpu = np.zeros(self.n_events + 1, dtype=np.int64)
        host = np.zeros(self.n_events + 1, dtype=np.int64)
        for j, lt in enumerate(self.lts):
            acc, nb = lt.accesses, lt.nbytes
            gpu[acc[0]] += nb
            gpu[acc[-1] + 1] -= nb
            t, offs = self._decision(j, trial)
            if t is None:
                continue
            if t == "host":
                host[acc[0]] += nb
                host[acc[-1] + 1] -= nb
            for i, p in offs.items():
                free_t = max(self.bounds[acc[i] + 1], done[t][(j, -1)])
                f = bisect.bisect_left(self.bounds, free_t)   # first event starting after it
                if f < p:
                    gpu[f] -= nb
                    gpu[p] += nb
        return self.working + np.cumsum(gpu)[:-1], np.cumsum(host)[:-1]

    # ---------------------------------------------------------------- greedy

    def _freed(self, j, i):
        """The events during which gap i of tensor j (offloaded) is off the GPU."""
        acc, t = self.lts[j].accesses, self.tier[j]
        free_t = max(self.bounds[acc[i] + 1], self.done[t][(j, -1)])
        return range(bisect.bisect_left(self.bounds, free_t), self.off[j][i])

    def _candidates(self, e):
        """Gaps (tensor, gap index) idle across event e but on the GPU during e, best first:
        gaps still on the GPU, and offloaded gaps whose write or prefetch overlaps e (a
        faster tier may free e)."""
        out = []
        for j, lt in enumerate(self.lts):
            acc, cur = lt.accesses, self.tier[j]
            k = bisect.bisect_left(acc, e)
            if lt.nbytes == 0 or k == 0 or k == len(acc) or acc[k] == e or not self.tiers:
                continue
            if (k - 1) in self.off[j] and (e in self._freed(j, k - 1) or cur == self.tiers[-1]):
                continue
            tier = cur or self.first_tiers[0]
            rd, wr = self.rates[tier]
            cost = _seconds(lt.nbytes, rd) + (0.0 if cur else _seconds(lt.nbytes, wr))
            idle = self.bounds[acc[k]] - self.bounds[acc[k - 1] + 1]
            score = INF if cost == 0 else lt.nbytes * idle / cost
            out.append((-score, -acc[k], j, k - 1))   # ties: the later next use first
        out.sort()
        return [(j, i) for _, _, j, i in out]

    def _try(self, j, i, e, gpu, host):
        """Offload gap i of tensor j so that event e gets lighter; True when done. A tensor
        already on a tier may move to a faster one (its other gaps keep their prefetches);
        an offloaded gap is only retried on a faster tier."""
        lt, cur = self.lts[j], self.tier[j]
        acc, nb, nxt = lt.accesses, lt.nbytes, lt.accesses[i + 1]
        tiers = self.first_tiers if cur is None else self.tiers[self.tiers.index(cur):]
        for tier in (tiers[1:] if i in self.off[j] else tiers):
            if tier == "host" and cur != "host" and \
                    host[acc[0]:acc[-1] + 1].max() + nb > self.host_budget:
                continue
            read = _seconds(nb, self.rates[tier][0])
            if read == INF:
                continue
            # the latest event that leaves time for the read, then earlier if contention needs
            p = min(nxt, bisect.bisect_right(self.bounds, self.bounds[nxt] - read) - 1)
            while p > e:
                trial = (j, tier, {**self.off[j], i: p})
                done = dict(self.done)
                oks = []
                for t in {tier, cur} - {None}:
                    done[t], ok = self._queue(t, trial)
                    oks.append(ok)
                if done[tier][(j, -1)] > self.bounds[e]:
                    break                  # the write is not done by the peak: no p helps
                if all(oks):
                    new_gpu, _ = self._usage(done, trial)
                    if new_gpu[e] >= gpu[e] or new_gpu.max() > gpu.max():
                        break              # it delays other writes more than it frees
                    self.tier[j], self.off[j], self.done = tier, trial[2], done
                    return True
                p -= 1
        return False

    def run(self) -> Plan:
        need = _needed_per_event(self.lts, self.timeline)
        e = int(np.argmax(need)) if self.n_events else 0
        if self.n_events and need[e] > self.gpu_budget:
            at = [lt for lt in self.lts if e in lt.accesses]
            big = max(at, key=lambda lt: lt.nbytes, default=None)
            raise ValueError(
                f"--snake-gpu-memory-limit {self.gpu_budget} bytes ({gib(self.gpu_budget, 3)}) is "
                f"below the minimum {int(need[e])} bytes ({gib(need[e], 3)}) that must be on the GPU "
                f"at once: event {e} ({self.timeline.events[e].name!r}) needs its working set "
                f"{int(self.working[e])} bytes and {len(at)} tensors"
                + (f", the largest {big.key!r} of {big.nbytes} bytes" if big else ""))
        self.done = {t: self._queue(t)[0] for t in OFF_TIERS}
        while self.n_events:
            gpu, host = self._usage(self.done)
            e = int(np.argmax(gpu))
            if gpu[e] <= self.gpu_budget:
                break
            if not any(self._try(j, i, e, gpu, host) for j, i in self._candidates(e)):
                raise ValueError(
                    f"--snake-gpu-memory-limit {self.gpu_budget} bytes ({gib(self.gpu_budget, 3)}) "
                    f"cannot be met with these bandwidths: the best plan found needs {int(gpu[e])} "
                    f"bytes ({gib(gpu[e], 3)}) at event {e} ({self.timeline.events[e].name!r}); the "
                    f"minimum with unlimited bandwidth is {int(need.max())} bytes. Raise the "
                    "limit, the host memory limit (--snake-host-memory-limit) or use a faster "
                    "drive")
        return self._plan()

    def _plan(self) -> Plan:
        gpu, host = self._usage(self.done) if self.n_events else (np.zeros(1), np.zeros(1))
        nvme = np.zeros(self.n_events + 1, dtype=np.int64)
        placements = {}
        for j, lt in enumerate(self.lts):
            acc = lt.accesses
            if self.tier[j] == "nvme":
                nvme[acc[0]] += lt.nbytes
                nvme[acc[-1] + 1] -= lt.nbytes
            placements[lt.key] = Placement(self.tier[j] or "gpu", lt.nbytes,
                                           sorted((acc[i], p) for i, p in self.off[j].items()))
        peak = {"gpu": int(gpu.max(initial=0)), "host": int(host.max(initial=0)),
                "nvme": int(np.cumsum(nvme).max(initial=0))}
        return Plan(placements, peak, 0.0, self.gpu_budget, self.host_budget,
                    fingerprint(self.lts, self.timeline))


# ==================================================================== the simulator

@dataclass
class Prefetch:
    key: object
    use_event: int
    issued_s: float
    arrival_s: float
    needed_s: float

    @property
    def late_s(self) -> float:
        late = self.arrival_s - self.needed_s
        return late if late > 1e-9 * max(1.0, abs(self.needed_s)) else 0.0


@dataclass
class SimResult:
    peak_bytes: dict          # tier -> bytes, continuous time
    prefetches: list          # [Prefetch]
    stall_s: float            # sum of late arrivals (the timeline is not shifted by them)
    late_writes: int          # offloads whose write finished after their prefetch began


def simulate(plan: Plan, lifetimes: list[TensorLifetime], timeline: Timeline, bandwidth: dict,
             pcie_Bps: float = INF) -> SimResult:
    """Play `plan` against the timeline in continuous time, independently of the planner's
    bookkeeping: transfer queues per tier, memory per tier, arrival of every prefetch."""
    start = [0.0]
    for ev in timeline.events:
        start.append(start[-1] + ev.seconds)
    queues = {t: [] for t in OFF_TIERS}            # heap of (issue, kind, order, gap, nbytes)
    for order, lt in enumerate(lifetimes):
        pl = plan.placements.get(lt.key, Placement())
        acc = lt.accesses
        if pl.tier == "gpu":
            if pl.offloads:
                raise ValueError(f"{lt.key!r}: offloads without a tier")
            continue
        heapq.heappush(queues[pl.tier], (start[acc[0] + 1], 0, order, -1, lt.nbytes))
        for rel, pre in pl.offloads:
            if rel not in acc[:-1]:
                raise ValueError(f"{lt.key!r}: release after {rel}, not an access before the last")
            gap = acc.index(rel)
            if not rel < pre <= acc[gap + 1]:
                raise ValueError(f"{lt.key!r}: prefetch at {pre} outside ({rel}, {acc[gap + 1]}]")
            heapq.heappush(queues[pl.tier], (start[pre], 1, order, gap, lt.nbytes))

    finish = {}
    for tier, q in queues.items():
        rates, free_at = _rates(bandwidth, pcie_Bps, tier), 0.0
        while q:
            issue, kind, order, gap, nbytes = heapq.heappop(q)
            rate = rates[kind ^ 1]                 # kind 0 = write, 1 = read
            dur = 0.0 if nbytes == 0 or rate == INF else (nbytes / rate if rate > 0 else INF)
            free_at = max(free_at, issue) + dur
            finish[(order, gap)] = free_at

    changes = {t: [] for t in TIERS}               # (time, +-bytes); frees sort first
    for e, ev in enumerate(timeline.events):
        changes["gpu"] += [(start[e], ev.working_bytes), (start[e + 1], -ev.working_bytes)]
    prefetches, late_writes = [], 0
    for order, lt in enumerate(lifetimes):
        pl, acc, nb = plan.placements.get(lt.key, Placement()), lt.accesses, lt.nbytes
        changes["gpu"] += [(start[acc[0]], nb), (start[acc[-1] + 1], -nb)]
        if pl.tier == "gpu":
            continue
        changes[pl.tier] += [(start[acc[0] + 1], nb), (start[acc[-1] + 1], -nb)]
        written = finish[(order, -1)]
        for rel, pre in pl.offloads:
            gap = acc.index(rel)
            released = max(start[rel + 1], written)
            if released < start[pre]:          # else the GPU copy simply stays
                changes["gpu"] += [(released, -nb), (start[pre], nb)]
            late_writes += written > start[pre] + 1e-9 * max(1.0, start[pre])
            prefetches.append(Prefetch(lt.key, acc[gap + 1], start[pre], finish[(order, gap)],
                                       start[acc[gap + 1]]))
    peak = {}
    for tier, ch in changes.items():
        level = best = 0
        for _, d in sorted(ch, key=lambda c: (c[0], c[1])):
            level += d
            best = max(best, level)
        peak[tier] = best
    return SimResult(peak, prefetches, sum(p.late_s for p in prefetches), late_writes)
