"""``--snake-activation-tier auto`` (the vertical schedule's default): profile the first
iterations, then place every unit checkpoint by a lifetime-aware plan (TERAIO).

For ``--snake-profile-iters`` steps every checkpoint goes to NVMe while the schedule's
compute events and each checkpoint's production and uses are recorded. Then the tiers'
bandwidth is measured through the store, and ``make_plan`` decides, within the device budget
and the host budget, which checkpoints stay in memory, which go to host memory and which to
NVMe, and at which compute event each read back is issued (``PlannedUnitInputs``). A
checkpoint leaving the device goes to host memory while the host budget has room, and to
the drive only after: the drive also carries the weights and the optimizer state, which the
plan does not see. The device budget is ``--snake-gpu-memory-limit`` less the largest unit's
working set; without the flag, what the profiled steps left of a GPU's memory, and on the
CPU (whose "device" memory is the host's, outside the pool's limit) no more than a plan can
manage with. The plan is summed up in one line and written as JSON (``--snake-plan-json``,
or beside ``--snake-offload-dir``); it is made again when the checkpoints' shapes or the
number of micro-batches change.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

from megatron_snake.errors import UserError
from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
from megatron_snake.placement.lifetimes import LifetimeRecorder, validate
from megatron_snake.placement.plan import make_plan, minimum_gpu_bytes
from megatron_snake.storage.safe_files import write_file_atomically

log = logging.getLogger("megatron_snake.offload")

# Without --snake-gpu-memory-limit, a GPU's memory the plan leaves free: the allocator's
# fragmentation and what a step allocates besides the profiled peak.
DEVICE_MARGIN_FRACTION = 0.1


class RecordingUnitInputs(OffloadedUnitInputs):
    """All checkpoints to NVMe, recording the timeline and lifetimes as the schedule runs."""

    def __init__(self, recorder: LifetimeRecorder, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorder = recorder

    @contextmanager
    def compute_event(self, sweep, unit, microbatch):
        name = (sweep, unit, microbatch)
        self.recorder.begin(name)
        try:
            yield
        finally:
            self.recorder.end(name)

    def save_input(self, unit, microbatch, hidden):
        self.recorder.produced(self._key(unit, microbatch), hidden.numel() * hidden.element_size())
        super().save_input(unit, microbatch, hidden)

    def load_input(self, unit, microbatch):
        self.recorder.used(self._key(unit, microbatch))
        return super().load_input(unit, microbatch)


class PlannedUnitInputs(OffloadedUnitInputs):
    """Checkpoints placed by ``plan``, each read issued at the start of the compute event the
    plan prefetches it at (its ``prefetch_at``), counted along the profiled timeline
    ``event_names``. No fixed lookahead: a read the plan does not schedule (a checkpoint it
    did not see, or a timeline that went another way) is issued at its use."""

    def __init__(self, plan, event_names, store, num_microbatches: int, device,
                 keep_for_next_unit: int = 0):
        super().__init__(store, plan_tier(plan), num_microbatches, device, lookahead=0,
                         keep_for_next_unit=keep_for_next_unit)
        self.plan, self.event_names = plan, list(event_names)
        self._prefetch_at: dict = {}     # event index -> [checkpoint key]
        for key, placement in plan.placements.items():
            for event in placement.prefetch_at:
                self._prefetch_at.setdefault(event, []).append(key)
        self._event = 0
        self.prefetch_log = []           # (event index, key) of every planned read issued

    @contextmanager
    def compute_event(self, sweep, unit, microbatch):
        index, self._event = self._event, self._event + 1
        on_plan = index < len(self.event_names) and \
            self.event_names[index] == (sweep, unit, microbatch)
        for key in self._prefetch_at.get(index, ()) if on_plan else ():
            _, ckpt_unit, mb = key
            if self._issue_read(ckpt_unit, mb):
                self.prefetch_log.append((index, key))
        yield


def plan_tier(plan):
    """The plan's tier of a checkpoint key; NVMe for a key the plan has not seen."""
    return lambda key: plan.placements[key].tier if key in plan.placements else "nvme"


class ActivationPlanner:
    """Hands the schedule a checkpoint store per training step: recording ones first, then
    ones that follow the plan."""

    def __init__(self, store, device, *, profile_iters: int, gpu_budget_bytes: int | None,
                 host_budget_bytes: int, plan_path: str | None, log=print,
                 keep_for_next_unit: int = 0, plan_default_in: str | None = None):
        """``plan_default_in``: the offload directory ``plan_path`` is the default path in
        (None: the user gave it)."""
        self.store, self.device, self.log = store, device, log
        self.keep_for_next_unit = keep_for_next_unit   # OffloadedUnitInputs
        self.profile_iters, self.plan_path = profile_iters, plan_path
        if plan_path:
            check_plan_path(plan_path, plan_default_in)   # now, not after the profiled steps
        self.gpu_budget = gpu_budget_bytes   # None: from the device (_device_budget)
        self.host_budget = host_budget_bytes
        self.plan = None
        self.plans_made = 0
        self._reserved = 0   # host-pool buffers reserved for the plan's host checkpoints
        self._shapes = None
        self._restart()

    def _restart(self):
        self.recorder, self._profiled, self.plan = LifetimeRecorder(self.device), 0, None
        self._event_names, self._microbatches = [], None

    def step_store(self, num_microbatches: int, *, forward_only: bool = False):
        if forward_only:  # evaluation: a different timeline, not profiled
            tier_of = plan_tier(self.plan) if self.plan else "nvme"
            return OffloadedUnitInputs(self.store, tier_of, num_microbatches, self.device,
                                       keep_for_next_unit=self.keep_for_next_unit)
        if self.plan is not None and num_microbatches != self._microbatches:
            self.log(f"> {num_microbatches} micro-batches instead of {self._microbatches}: "
                     "profiling again for a new activation plan")
            self._restart()
            self._shapes = None
        if self.plan is None:
            self._microbatches = num_microbatches
            return RecordingUnitInputs(self.recorder, self.store, "nvme", num_microbatches,
                                        self.device, keep_for_next_unit=self.keep_for_next_unit)
        return PlannedUnitInputs(self.plan, self._event_names, self.store, num_microbatches,
                                  self.device, keep_for_next_unit=self.keep_for_next_unit)

    def after_step(self, checkpoints) -> None:
        checkpoints.finish_step()
        if self.plan is not None and checkpoints.shapes != self._shapes:
            self.log("> checkpoint shapes changed: profiling again for a new activation plan")
            self._restart()
            self._shapes = None
            return
        if isinstance(checkpoints, RecordingUnitInputs):
            if self._shapes is not None and checkpoints.shapes != self._shapes:
                self._restart()  # shapes changed while profiling: start over next step
                self._shapes = None
                return
            self._shapes = checkpoints.shapes
            self.recorder.step()
            self._profiled += 1
            if self._profiled >= self.profile_iters:
                self._make_plan()

    def _make_plan(self) -> None:
        timeline, lifetimes = self.recorder.finish()
        self._event_names = [e.name for e in timeline.events]
        largest = max((lt.nbytes for lt in lifetimes), default=1 << 20)
        bandwidth = measure_tier_bandwidth(self.store, nbytes=max(largest, 1 << 20))
        # The pool holds whole buffers: a checkpoint takes host_buffers_for(its bytes) of
        # them however small it is, so the plan's byte budget is what that many hold; and
        # the host tiers' own records and the drive's staging (an eighth) come first.
        pool = self.store.pool
        sizes = [lt.nbytes for lt in lifetimes if lt.nbytes] or [1]
        per_checkpoint = self.store.host_buffers_for(max(sizes))
        free = pool.count - (pool.reserved - self._reserved) - max(1, pool.count // 8)
        fit = max(0, min(self.host_budget // pool.buffer_bytes, free)) // per_checkpoint
        host_budget = fit * min(sizes)
        validate(lifetimes, timeline)   # below, a ValueError is the budget's only
        budget = self.gpu_budget
        if budget is None:
            budget = max(_device_budget(self.device), minimum_gpu_bytes(lifetimes, timeline))
        while True:
            try:
                self.plan = make_plan(lifetimes, timeline, gpu_budget_bytes=budget,
                                      host_budget_bytes=host_budget, bandwidth=bandwidth,
                                      host_first=True)
                break
            except ValueError:
                if self.gpu_budget is not None:
                    raise     # the user's limit: its error says what to do
                # ours: keep a little more in memory (keeping everything always fits)
                budget += max(largest, budget // 8)
        # reserve in the pool the buffers the plan's host checkpoints take at most
        on_host = -(-self.plan.peak_bytes["host"] // min(sizes)) * per_checkpoint
        pool.reserved += on_host - self._reserved
        self._reserved = on_host
        self.plans_made += 1
        written = write_plan(self.plan_path, self.plan.to_json(),
                             "activation plan (--snake-plan-json)")
        self.log(plan_summary_line(self.plan, self._profiled, self.plan_path if written
                                   else None))


# the plan's tiers as a run names them: its "gpu" is the compute device, whichever it is
_TIER_WORDS = (("gpu", "device"), ("host", "host"), ("nvme", "nvme"))


def plan_summary_line(plan, profiled: int, path: str | None) -> str:
    """The plan in one line: how many unit inputs go to each tier, the host tier's peak
    against the plan's host budget, the predicted stall, and where its JSON (every
    placement) went."""
    counts = {tier: 0 for tier, _ in _TIER_WORDS}
    total = 0
    for placement in plan.placements.values():
        counts[placement.tier] = counts.get(placement.tier, 0) + 1
        total += placement.nbytes
    where = f"every placement in {path}" if path else \
        "--snake-plan-json FILE writes every placement"
    return (f"> activation plan after {profiled} profiled iterations: "
            f"{len(plan.placements)} unit inputs ({total / 2**20:.1f} MiB): "
            + ", ".join(f"{word} {counts[tier]}" for tier, word in _TIER_WORDS)
            + f"; host peak {plan.peak_bytes.get('host', 0) / 2**20:.1f} MiB of "
            f"{plan.host_budget_bytes / 2**20:.1f} MiB; predicted stall {plan.stall_s:.3f} s; "
            f"{where}")


def _device_budget(device) -> int:
    """Device memory for checkpoints without --snake-gpu-memory-limit: on a GPU, its memory
    less the peak the profiled steps reserved (all checkpoints were off the device then) and
    a margin; on the CPU none (the plan keeps only what it must)."""
    if device is None or torch.device(device).type != "cuda":
        return 0
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int(total * (1 - DEVICE_MARGIN_FRACTION))
               - torch.cuda.max_memory_reserved(device))


def write_plan(path: str | None, text: str, what: str) -> bool:
    """Write a plan's JSON to ``path`` (none: False) as a new 0600 file renamed into place
    (a link there is replaced, never written through). A plan file is a record for the
    user, not something the run reads: one that cannot be written (a directory made at
    its path during the run, a full or read-only drive) is one warning naming it, and the
    run goes on with the plan in memory."""
    if not path:
        return False
    try:
        write_file_atomically(path, text.encode(), what=what)
        return True
    except OSError as exc:
        log.warning("> warning: the %s was not written to %s (%s); training goes on with "
                    "the plan in memory", what, path, exc.strerror or exc)
        return False


class PlanPathError(UserError, ValueError):
    """The activation plan could not be written where it goes."""


def check_plan_path(path, default_in: str | None = None) -> None:
    """Refuse at the start a plan path the plan could not be written to: its directory must
    exist and the path must not be a directory (a link there is replaced when the plan is
    written, never followed). ``default_in``: the offload directory a default path was
    made in; the message then names it, not --snake-plan-json, which the user did not give."""
    what = f"--snake-plan-json {path}" if default_in is None else \
        f"the activation plan's default path {path} (made from --snake-offload-dir {default_in})"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PlanPathError(f"{what}: the directory {parent} does not exist; create it or "
                            "give another path")
    if not os.path.isdir(path) or os.path.islink(path):
        return
    if default_in is None:
        raise PlanPathError(f"{what} is a directory; give the path of a file")
    owner = os.lstat(path).st_uid
    whose = f", owned by uid {owner}" if owner != os.geteuid() else ""
    raise PlanPathError(f"{what} is a directory this run did not make{whose}; remove it, or "
                        "give --snake-plan-json the path of a file")


def measure_tier_bandwidth(store, nbytes: int = 64 << 20, tiers=("host", "nvme")) -> dict:
    """Time one put (write) and one get (read) of an nbytes tensor through `store` on each
    tier. Returns {tier: (read_Bps, write_Bps)} in bytes per second, the form make_plan
    takes. NVMe reads may be served by the page cache when the engine is not O_DIRECT."""
    # A private generator: the probe must not move the RNG streams training draws from.
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (max(1, int(nbytes)),), dtype=torch.uint8,
                        generator=gen).to(store.device)
    out = {}
    for tier in tiers:
        key = ("__bandwidth_probe__", tier)
        _sync(store.device)
        t0 = time.perf_counter()
        store.put(key, src, tier=tier).wait()
        t1 = time.perf_counter()
        back = store.get(key).wait()
        _sync(store.device)
        t2 = time.perf_counter()
        store.delete(key).wait()
        if not torch.equal(back, src):
            raise RuntimeError(f"bandwidth probe on tier {tier}: data came back different")
        n = src.numel()
        out[tier] = (n / max(t2 - t1, 1e-9), n / max(t1 - t0, 1e-9))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
