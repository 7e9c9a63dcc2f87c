"""``--snake-activation-offload-policy adaptive``: offload a saved tensor only where the plan
says the drive hides its write and its read-back (SSDTrain's adaptive keep, on lifetimes
from profiled steps, as TERAIO plans them).

``AdaptiveOffloader`` is a ``SavedTensorOffloader`` that follows ActivationOffloadStep's
step protocol (``begin_step``, ``begin_microbatch`` at each forward step, ``end_step``):

- **profile**: for the first ``profile_iters`` training steps it offloads nothing. Every
  candidate save (one the base offloader would offload) is kept in memory, so the timeline
  is the one without offload, and recorded: its micro-batch, its pack ordinal among that
  micro-batch's candidate storages (a second save of one storage is the same candidate, as
  the base offloader dedups), its bytes, and the time of its pack and of each unpack. Times
  are the device's: CUDA events on the current stream, read after the step; on the CPU the
  host clock. The last profiled step is the one planned from (the first carries warm-up).
- **plan**: the tier's read and write rates are measured through the store, as the auto
  activation tier measures them, and ``keep_plan.plan_offload`` picks the saves to offload
  and the unpack each read is issued at. One line sums the plan up; ``plan_path`` gets it
  as JSON.
- **apply**: each candidate at a planned (micro-batch, ordinal) with the profiled bytes is
  offloaded; the others stay. A micro-batch's reads are issued, in the profile's unpack
  order, at the unpacks the plan names (read-backs then arrive just before they are needed,
  not all at the start of backward). A planned save whose bytes differ from the profile's
  is kept, and the next steps are profiled again for a new plan.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from megatron_snake.offload.activation_plan import measure_tier_bandwidth, write_plan
from megatron_snake.offload.keep_plan import ALLOWANCE, Save, SaveProfile, plan_offload
from megatron_snake.offload.saved_tensors import SavedTensorOffloader, _Saved


@dataclass(eq=False)
class _Candidate:
    group: int
    ordinal: int
    nbytes: int
    storage: weakref.ref         # identity guard for the dedup slot
    pack: object                 # clock mark
    unpacks: list = field(default_factory=list)


@dataclass(eq=False)
class _Kept:
    """What autograd holds for a candidate left in memory: the tensor itself, and which
    candidate it is (its unpacks count in its micro-batch's backward)."""

    candidate: _Candidate
    tensor: torch.Tensor
    version: int


class _Clock:
    """Marks on the device's timeline: CUDA events on the current stream (a kernel's time,
    not its launch's), else the host clock; in seconds since ``start`` once resolved."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.origin = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark - self.origin
        return self.origin.elapsed_time(mark) / 1e3


class AdaptiveOffloader(SavedTensorOffloader):
    def __init__(self, store, tier: str = "nvme", *, profile_iters: int = 2, rates=None,
                 allowance: float = ALLOWANCE, plan_path: str | None = None, log=print,
                 **kwargs):
        """``rates``: a callable returning the tier's (read, write) bytes per second given
        the largest save's bytes (default: measured through the store)."""
        # reads are issued where the plan says, not a fixed depth ahead of each unpack
        super().__init__(store, tier, **{"prefetch_depth": 0, **kwargs})
        if profile_iters < 1:
            raise ValueError(f"profile_iters must be >= 1, got {profile_iters}")
        self.profile_iters, self.allowance = profile_iters, allowance
        self.rates = rates or self._measure_rates
        self.plan_path, self.log = plan_path, log
        self.plan = None
        self.plans_made = 0
        self._profiled = 0
        self._mismatch = False
        self._recording = False         # this step profiles (keeps all candidates)
        self._apply = False             # this step follows the plan
        self._clock = None
        self._group = -1
        self._next_ordinal = 0
        self._candidates = {}           # (device, data_ptr) -> _Candidate, this step
        self._recorded = []             # _Candidate in pack order, this step
        self._unpack_marks = {}         # group -> [mark], this step (recording)
        self._unpack_count = {}         # group -> unpacks so far, this step
        self._pending_reads = {}        # group -> [(issue_at, entry)] in read order

    # ------------------------------------------------------------------ step protocol

    @property
    def leaves_all(self) -> bool:
        """The plan offloads nothing: the step need not run under the hooks at all."""
        return self.plan is not None and not self.plan.offload

    @property
    def profiling(self) -> bool:
        """This step keeps every saved tensor (to time them): it needs the memory of a run
        without offload."""
        return self._recording

    def begin_step(self, forward_only: bool = False):
        self._recording = not forward_only and self.plan is None
        # a plan that offloads nothing is followed by leaving every save alone: no
        # candidate is tracked, so the step costs what it would without the hooks' work
        self._apply = not forward_only and self.plan is not None and not self.leaves_all
        self._clock = _Clock(self.store.device.type == "cuda") if self._recording else None
        self._group, self._next_ordinal = -1, 0
        self._candidates, self._recorded = {}, []
        self._unpack_marks, self._unpack_count, self._pending_reads = {}, {}, {}

    def begin_microbatch(self):
        # Candidates are counted per micro-batch: a storage saved again by a later
        # micro-batch (a mask, a cache) is that one's candidate too, whether or not the
        # earlier one's backward has released it.
        self._group += 1
        self._next_ordinal = 0
        self._candidates = {}

    def end_step(self):
        if self._mismatch:
            self.log("> saved tensors differ from the profiled ones: profiling again for a "
                     "new saved-tensor offload plan")
            self.plan, self._profiled, self._mismatch = None, 0, False
        elif self._recording:
            end = self._clock.mark()
            if self._clock.cuda:
                torch.cuda.synchronize()
            self._profiled += 1
            if self._profiled >= self.profile_iters:
                self._make_plan(self._profile(end))
        self._recording = self._apply = False
        self._candidates, self._recorded, self._pending_reads = {}, [], {}

    # ------------------------------------------------------------------ hooks

    def _pack(self, t: torch.Tensor):
        self.stats.saves += 1
        if not (self._recording or self._apply):   # outside a training step: evaluation
            self.stats.kept += 1
            return t
        if self._keep(t):
            self.stats.kept += 1
            return t
        storage = t.untyped_storage()
        slot = (t.device, storage.data_ptr())
        with self._lock:
            entry = self._by_slot.get(slot)
            if entry is not None and entry.storage() is storage and \
                    entry.group == max(self._group, 0):   # a second save of an offloaded storage
                return self._offload(t)
            cand = self._candidates.get(slot)
            if cand is None or cand.storage() is not storage:
                cand = self._new_candidate(storage, slot)
                if self._apply and self._planned(cand):
                    del self._candidates[slot]
                    saved = self._offload(t)
                    self._queue_read(cand, saved.entry)
                    return saved
        self.stats.kept += 1
        return _Kept(cand, t, t._version)

    def _unpack(self, saved):
        if isinstance(saved, _Kept):
            self._unpacked(saved.candidate.group, saved.candidate)
            t = saved.tensor
            if t._version != saved.version:
                raise RuntimeError(
                    "saved-tensor offload: a tensor saved for backward was modified by an "
                    f"in-place operation (version {saved.version} -> {t._version}, shape "
                    f"{tuple(t.shape)})")
            return t
        if isinstance(saved, _Saved):
            self._unpacked(saved.entry.group)
        return super()._unpack(saved)

    # ------------------------------------------------------------------ profile and plan

    def _new_candidate(self, storage, slot) -> _Candidate:
        cand = _Candidate(max(self._group, 0), self._next_ordinal, storage.nbytes(),
                          weakref.ref(storage), self._clock.mark() if self._recording else None)
        self._next_ordinal += 1
        self._candidates[slot] = cand
        if self._recording:
            self._recorded.append(cand)
        return cand

    def _unpacked(self, group: int, cand: _Candidate | None = None):
        with self._lock:
            k = self._unpack_count.get(group, 0)
            self._unpack_count[group] = k + 1
            if self._recording:
                mark = self._clock.mark()
                self._unpack_marks.setdefault(group, []).append(mark)
                cand.unpacks.append(mark)
            elif self._apply:
                reads = self._pending_reads.get(group, [])
                due = [r for r in reads if r[0] <= k]   # in read order, ties included
                reads[:] = [r for r in reads if r[0] > k]
                for _, entry, _ in due:
                    if entry.refs > 0 and entry.fetch is None:
                        self._fetch(entry)
                        entry.prefetched = True
                        self.stats.prefetched += 1

    def _profile(self, end_mark) -> SaveProfile:
        sec = self._clock.seconds
        saves = [Save(c.group, c.ordinal, c.nbytes, sec(c.pack), sec(c.unpacks[0]),
                      sec(c.unpacks[-1])) for c in self._recorded if c.unpacks]
        unpacks = {g: [sec(m) for m in marks] for g, marks in self._unpack_marks.items()}
        return SaveProfile(saves, unpacks, sec(end_mark))

    def _measure_rates(self, largest: int) -> tuple[float, float]:
        return measure_tier_bandwidth(self.store, nbytes=max(largest, 1 << 20),
                                      tiers=(self.tier,))[self.tier]

    def _make_plan(self, profile: SaveProfile):
        read_Bps, write_Bps = self.rates(max((s.nbytes for s in profile.saves), default=0))
        self.plan = plan_offload(profile, read_Bps, write_Bps, self.allowance)
        self._read_rank = {s.key: i for i, s in enumerate(
            sorted(profile.saves, key=lambda s: s.unpack_s))}
        self.plans_made += 1
        written = write_plan(self.plan_path, self.plan.to_json(), "saved-tensor offload plan")
        where = f"; plan in {self.plan_path}" if written else ""
        self.log(f"> saved-tensor offload plan after {self._profiled} profiled iterations "
                 f"(tier {self.tier} read {read_Bps / 1e6:.1f} MB/s, write "
                 f"{write_Bps / 1e6:.1f} MB/s): {self.plan.summary()}{where}")

    def _planned(self, cand: _Candidate) -> bool:
        planned = self.plan.offload.get((cand.group, cand.ordinal))
        if planned is None:
            return False
        if planned.nbytes != cand.nbytes:
            self._mismatch = True
            return False
        return True

    def _queue_read(self, cand: _Candidate, entry):
        if entry.refs == 1:                  # written now, not an earlier micro-batch's
            entry.group = cand.group
        key = (cand.group, cand.ordinal)
        reads = self._pending_reads.setdefault(cand.group, [])
        reads.append((self.plan.offload[key].issue_at, entry, self._read_rank[key]))
        reads.sort(key=lambda r: r[2])
