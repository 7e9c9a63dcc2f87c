"""The offloaded part of a run, from the flags: the tensor store under
``--snake-offload-dir``, the tiers and bytes of the offloaded state (checked against the
device limit and the drive's free space before anything is written), the offloaded units
and optimizer, and the store's traffic for the log line."""

from __future__ import annotations

import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megatron_snake.errors import FlagError
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.storage import directory
from megatron_snake.storage.directory import named_twice
from megatron_snake.storage.errors import CapacityError, HostMemoryError
from megatron_snake.storage.host_heap import bound_host_heap, keep_heap_trimmed
from megatron_snake.storage.host_pool import STAGING_BUFFERS
from megatron_snake.storage.sizes import mib, size
from megatron_snake.storage.store import TensorStore
from megatron_snake.storage.temp_dirs import make_temp_offload_dir, sweep_dead_temp_offload_dirs
from megatron_snake.offload.initial_weights import InitialWeights
from megatron_snake.offload.unit_weights import OffloadedUnits
from megatron_snake.optim.dp_shards import DataParallel
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.parts import part_bounds
from megatron_snake.optim.precision import Precision
from megatron_snake.optim.unit_params import UnitParams
from megatron_snake.training import distributed
from megatron_snake.training.snake_args import split_offload_dirs

def tier_label(tier: str) -> str:
    """A tier's name in what a run prints: the store's ``gpu`` tier is the compute device
    (a CPU run's too), as ``--snake-activation-tier device`` names it."""
    return "device" if tier == "gpu" else tier


def checkpoint_bytes(args) -> int:
    """One unit input of one micro-batch: [s, b, h] in the parameters' dtype."""
    seq = args.seq_length // (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    return seq * args.micro_batch_size * args.hidden_size * \
        torch.tensor([], dtype=args.params_dtype).element_size()


def checkpoints_per_step(args) -> int:
    """Unit checkpoints alive between the sweeps on this pipeline stage: (units of the
    stage - 1) x M (at most; a later stage adds what it received, a snake group frees its
    checkpoints before the next group's backward)."""
    layers = args.num_layers // args.pipeline_model_parallel_size
    units = -(-layers // args.snake_checkpoint_interval)
    return (units - 1) * args.num_microbatches


def checkpoint_bytes_per_step(args) -> int:
    return checkpoints_per_step(args) * checkpoint_bytes(args)


@contextmanager
def open_store(args, device: torch.device, rank: int):
    """The run's tensor store under ``--snake-offload-dir`` (None without
    ``--snake-offload`` or ``--snake-activation-offload``). Its files, and a temporary directory made for it, are removed on
    exit."""
    if not (args.snake_offload or args.snake_activation_offload):
        yield None
        return
    # host memory stays bounded only if what a unit frees leaves the process (with the
    # thread that keep_heap_trimmed starts)
    bound_host_heap()
    made = None
    if not args.snake_offload_dir:   # what killed runs left in the temporary folder goes first
        sweep_dead_temp_offload_dirs()
        made = make_temp_offload_dir()
    try:
        roots = [made] if made else offload_dirs_for_rank(args.snake_offload_dir, rank)
        store, error = None, None
        try:
            store = TensorStore(roots, rank=rank, device=device, engine=args.snake_io_engine,
                                host_memory_limit=args.snake_host_memory_limit)
        except (OSError, ValueError, RuntimeError) as exc:
            error = exc
        distributed.raise_unless_all_ranks_ok(error, "--snake-offload-dir check")
        with store, keep_heap_trimmed():
            yield store
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def offload_dirs_for_rank(value: str, rank: int) -> list[str]:
    """``--snake-offload-dir``'s directories (a comma-separated list: the store is striped
    over them), each with {node}, {hostname}, {rank} and {local_rank} filled in; one named
    twice (once filled in) is refused."""
    fields = dict(node=distributed.node_index(), hostname=socket.gethostname(), rank=rank,
                  local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    dirs = []
    for template in split_offload_dirs(value):
        try:
            dirs.append(template.format(**fields))
        except (KeyError, IndexError, ValueError) as exc:
            raise FlagError(f"--snake-offload-dir {template!r}: bad template ({exc!r}); the "
                            "fields are {node}, {hostname}, {rank} and {local_rank}") from None
    twice = named_twice(dirs)
    if twice:
        raise FlagError(f"--snake-offload-dir {value!r}: rank {rank} gets one directory more "
                        f"than once ({', '.join(twice)}: named twice, by another path, a "
                        "link or a bind mount); give each drive's directory once")
    return dirs


class StoreMeter:
    """The store's traffic for the log, per log interval: by default a compact set (the
    drive's read and write rates, the share of the time the training thread waited on the
    store, the host pool's peak); with ``details`` (``--snake-log-details``) bytes read and
    written per tier (all state, then unit checkpoints and saved tensors alone), the
    activation peaks, and the prefetch and other waits apart. The run's totals at the
    end."""

    TIERS = ("nvme", "host")
    KINDS = (("activations", "unit inputs"), ("saved_activations", "saved tensors"))
    # what the compact fields mean, for the line that explains the log lines
    LEGEND = ("drive r/w: MB/s read from and written to the offload drive; io wait: the "
              "share of the time training waited on the store; pool peak: the most of the "
              "host pool in use since the start, of its limit")

    def __init__(self, store: TensorStore | None, details: bool = False):
        self.store, self.details = store, details
        self.start_interval()

    def start_interval(self) -> None:
        self._since = self.snapshot()
        self._started = time.perf_counter()

    def snapshot(self) -> dict | None:
        return self.store.counters.snapshot() if self.store else None

    def exclude(self, before: dict | None, seconds: float) -> None:
        """Leave the store traffic and waits since ``before`` (a ``snapshot``) and
        ``seconds`` of time out of this interval: they were not training's."""
        self._started += seconds
        if self.store is None:
            return
        now, since = self.store.counters.snapshot(), self._since
        for key in ("read", "written"):
            for tier in since[key]:
                since[key][tier] += now[key][tier] - before[key][tier]
        for key in ("blocked_s", "prefetch_wait_s"):
            since[key] += now[key] - before[key]
        for kind, tiers in now["by_kind"].items():
            for tier, rw in tiers.items():
                old = before["by_kind"].get(kind, {}).get(tier, [0, 0])
                mine = since["by_kind"].setdefault(kind, {}).setdefault(tier, [0, 0])
                mine[0] += rw[0] - old[0]
                mine[1] += rw[1] - old[1]

    def interval(self, activation_peak: dict | None = None) -> tuple[str, dict]:
        """This interval's figures as log-line text and as tracker scalars, and a new
        interval starts. ``activation_peak``: the last step's peak bytes per tier
        (``{"unit inputs": {tier: bytes}, "saved tensors": {...}}``)."""
        if self.store is None:
            return "", {}
        now, before = self.store.counters.snapshot(), self._since
        elapsed = time.perf_counter() - self._started
        self.start_interval()
        read = {t: now["read"][t] - before["read"][t] for t in self.TIERS}
        written = {t: now["written"][t] - before["written"][t] for t in self.TIERS}
        prefetch = now["prefetch_wait_s"] - before["prefetch_wait_s"]
        other = now["blocked_s"] - before["blocked_s"] - prefetch
        pool = self.store.pool
        pool_peak = pool.peak_in_use * pool.buffer_bytes
        overlap = max(0.0, 1.0 - (prefetch + other) / elapsed) if elapsed > 0 else 1.0
        scalars = {f"snake/{t}-{d}-bytes": v[t] for t in self.TIERS
                   for d, v in (("read", read), ("write", written))}
        scalars.update({"snake/prefetch-wait-seconds": prefetch,
                        "snake/other-io-wait-seconds": other,
                        "snake/io-overlap-fraction": overlap})
        if not self.details:
            per_s = max(elapsed, 1e-9) * 1e6
            return " | ".join([
                f"drive r/w {read['nvme'] / per_s:.1f}/{written['nvme'] / per_s:.1f} MB/s",
                f"io wait {1.0 - overlap:.1%}",
                f"pool peak {pool_peak / 2**20:.0f}/{pool.limit_bytes / 2**20:.0f} MiB"]), \
                scalars
        parts = [f"{t} r/w (interval) {mib(read[t])}/{mib(written[t])}"
                 for t in self.TIERS if read[t] or written[t]]
        for kind, label in self.KINDS:
            moved = {t: [a - b for a, b in zip(now["by_kind"].get(kind, {}).get(t, [0, 0]),
                                               before["by_kind"].get(kind, {}).get(t, [0, 0]))]
                     for t in self.TIERS}
            if any(any(rw) for rw in moved.values()):
                parts.append(f"{label} (interval) " + ", ".join(
                    f"{t} r/w {mib(rw[0])}/{mib(rw[1])}" for t, rw in moved.items() if any(rw)))
        for label, peak in (activation_peak or {}).items():
            # the store's "gpu" tier is the compute device, whichever it is
            held = [f"{tier_label(tier)} {mib(n)}" for tier, n in peak.items() if n]
            if held:
                parts.append(f"{label} peak (last step) " + ", ".join(held))
        parts += [f"host pool peak (cumulative) {mib(pool_peak)} of {mib(pool.limit_bytes)}",
                  f"prefetch wait (interval) {prefetch:.2f} s",
                  f"other io wait (interval) {other:.2f} s",
                  f"not waiting on io (interval) {overlap:.1%}"]
        return " | ".join(parts), scalars

    def total(self) -> str:
        """The whole run's store traffic and waits, for the line after the last step."""
        if self.store is None:
            return ""
        c = self.store.counters.snapshot()
        moved = [f"{t} r/w {size(c['read'][t])}/{size(c['written'][t])}" for t in self.TIERS
                 if c["read"][t] or c["written"][t]]
        return (f"> store traffic (whole run): {', '.join(moved) or 'nothing moved'}; waited "
                f"on the store {c['blocked_s']:.2f} s ({c['prefetch_wait_s']:.2f} s of it "
                "for prefetched reads)")


@dataclass
class OffloadedState:
    """The offloaded training state of one model: unit weights and gradients, and the
    AdamW whose master weights and moments live in the store."""

    units: GPTUnits            # the unit partition, made once for the run
    weights: OffloadedUnits
    optimizer: OffloadedAdamW
    tiers: StateTiers          # where weights and optimizer state went (auto resolved)
    capacity: tuple = (0, 0)   # (bytes needed, bytes free) on the offload drive, checked
    speculation: "Speculation" = None   # the layouts that speculate, the state they keep
    device: "DevicePlan" = None   # the optimizer's share on the device, the pinned units

    def summary(self, args) -> str:
        """Bytes this rank holds per tier, moves per step, and the free-space check."""
        elem = torch.tensor([], dtype=args.params_dtype).element_size()
        weights = sum(hi - lo for lay in self.weights.params.units
                      for _, (lo, hi) in self.weights.record_parts(lay)) * elem
        pinned = self.weights.pinned_bytes()
        optim = self.optimizer.state_bytes()     # each state in its dtype
        grads = self.optimizer.grad_bytes()      # held between backward and update
        ckpt = checkpoint_bytes_per_step(args)
        per_tier = {"device": pinned, "host": 0, "nvme": 0}
        per_tier[self.tiers.params] += weights - pinned
        per_tier[self.tiers.optimizer] += optim + grads
        ckpt_tier = None if args.snake_activation_tier == "auto" else args.snake_activation_tier
        if ckpt_tier is not None:
            per_tier[ckpt_tier] += ckpt
        # Per step, off the device: unpinned weights read in both sweeps and written once by
        # the update; optimizer state and fp32 gradient written and read once each;
        # offloaded checkpoints written and read once.
        off_device_ckpt = ckpt if ckpt_tier in ("host", "nvme") else 0
        # every snake group reads each unit in both sweeps
        groups = args.num_microbatches // (args.snake_group_size or args.num_microbatches)
        read = 2 * groups * (weights - pinned) + optim + grads + off_device_ckpt
        if self.optimizer.precision.remainders:   # the update reads its masters' high halves
            read += weights
        written = (weights - pinned) + optim + grads + off_device_ckpt
        units = sorted(self.weights.pinned)
        need, free = self.capacity
        inputs_on = "where the activation plan puts them (auto)" \
            if ckpt_tier is None else f"on {ckpt_tier}"
        line = ("> offloaded state per tier: "
                + ", ".join(f"{t} {mib(n)}" for t, n in per_tier.items())
                + f" (weights {mib(weights)} on {self.tiers.params}, "
                f"pinned on the device: {'units ' + str(units) if units else 'none'}; master "
                f"weights + moments + gradients {mib((optim + grads))} on "
                f"{self.tiers.optimizer}; unit inputs {mib(ckpt)} {inputs_on}); per step "
                f"about {mib(read)} read and {mib(written)} written off the device; free "
                f"space checked: {mib(need)} more needed with margin (beyond what the "
                f"offload files hold now), {mib(free)} free on the offload drive")
        if getattr(args, "use_precision_aware_optimizer", False):
            line += "\n" + self.optimizer.precision.summary()
        if self.speculation is not None:
            line += f"\n> {self.speculation.summary()} on {self.tiers.optimizer}"
        if self.device is not None and self.device.summary():
            line += f"\n> {self.device.summary()}"
        return line


@dataclass(frozen=True)
class StateTiers:
    """Where the unit weights and the optimizer state (master weights, moments, fp32
    gradients) live: ``host`` or ``nvme``, ``auto`` resolved."""

    params: str
    optimizer: str


def resolve_state_tiers(args, need: HostBuffers, pool_buffers: int) -> StateTiers:
    """``--snake-param-tier``/``--snake-optimizer-tier auto``: host when a quarter of the
    host pool (``--snake-host-memory-limit``) holds it (the rest stays for checkpoints and
    the I/O buffers NVMe transfers go through), weights first (per byte held they move the
    most: read in both sweeps), else nvme. The flags themselves are left as given."""
    room = pool_buffers // 4
    params, optimizer = args.snake_param_tier, args.snake_optimizer_tier
    if params == "auto":
        params = "host" if need.weights <= room else "nvme"
    if params == "host":
        room -= need.weights
    if optimizer == "auto":
        optimizer = "host" if need.optimizer <= room else "nvme"
    return StateTiers(params, optimizer)


@dataclass(frozen=True)
class HostBuffers:
    """Host-pool buffers each part of the state holds while it lives on the host tier (a
    record takes whole buffers, so this is not bytes / buffer size)."""

    weights: int
    optimizer: int       # master weights, two moments and the gradient, each in its dtype
    unit_inputs: int
    largest_unit_weights: int = 0   # one unit's weight records, the largest unit's


def host_buffers_needed(args, params: UnitParams, dp: DataParallel, pinned: list[int],
                        buffers_for, share=()) -> HostBuffers:
    """What each part would hold on the host tier: this rank's records of every unit's
    weights (the pinned ones stay on the device), four optimizer records per weight record
    (master weights, two moments, gradient: four fp32 ones, or each in its dtype with
    --use-precision-aware-optimizer; none for the units of the device ``share``), and the
    step's unit inputs; ``buffers_for(nbytes)`` is the store's rule."""
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    sizes = optimizer_record_bytes(args)
    weights = optimizer = largest = 0
    for unit, lay in enumerate(params.units):
        unit_weights = 0
        for lo, hi in part_bounds(lay, args.snake_alpha, dp):
            if hi > lo:
                unit_weights += buffers_for((hi - lo) * elem)
                if unit not in share:
                    optimizer += sum(buffers_for((hi - lo) * n) for n in sizes)
        weights += 0 if unit in pinned else unit_weights
        largest = max(largest, unit_weights)
    if params.shared.segments:
        optimizer += sum(buffers_for((hi - lo) * n)
                         for lo, hi in part_bounds(params.shared, args.snake_alpha, dp)
                         if hi > lo for n in sizes)
    inputs = checkpoints_per_step(args) * buffers_for(checkpoint_bytes(args))
    return HostBuffers(weights, optimizer, inputs, largest)


def optimizer_record_bytes(args) -> tuple[int, ...]:
    """Bytes per element of the optimizer's four records of a part: master weights, the two
    moments and the gradient (4 each in fp32)."""
    p = Precision.from_args(args)
    return tuple(p.nbytes(name) for name in ("master", "exp_avg", "exp_avg_sq", "grad"))


def optimizer_bytes_per_param(args) -> int:
    """Drive bytes per parameter the optimizer's state and gradients hold (16 in fp32)."""
    return sum(optimizer_record_bytes(args))


def on_host_tier(args, tiers: StateTiers, need: HostBuffers) -> list[tuple[str, int]]:
    """(part, host buffers) of each part of the state placed on the host tier."""
    parts = [("weights", need.weights, tiers.params == "host"),
             ("optimizer state and gradients", need.optimizer, tiers.optimizer == "host"),
             ("unit inputs", need.unit_inputs, args.snake_activation_tier == "host")]
    return [(name, n) for name, n, host in parts if host and n]


def check_host_memory(args, tiers: StateTiers, need: HostBuffers, pool_buffers: int,
                      buffer_bytes: int, *, limit: int | None = None, outside: int = 0) -> None:
    """Refuse at start a plan whose host tiers cannot fit ``--snake-host-memory-limit``,
    with the total it needs, instead of a per-key error at the first step. ``limit``: the
    flag's value, of which the run holds ``outside`` bytes outside the pool (the
    pre-flight's; default: the pool is the whole limit)."""
    on_host = on_host_tier(args, tiers, need)
    total = sum(n for _, n in on_host) + 1   # one buffer always stays free for staging
    if total > pool_buffers:
        detail = ", ".join(f"{name} {n}" for name, n in on_host)
        after = f" (after the {size(outside)} the run holds outside its pool)" if limit \
            else ""
        raise HostMemoryError(
            f"--snake-host-memory-limit "
            f"{mib(args.snake_host_memory_limit if limit is None else limit)} holds "
            f"{pool_buffers} host buffers of {mib(buffer_bytes)}{after}, but the host tiers "
            f"need {total} ({detail}, and 1 for staging): raise --snake-host-memory-limit to "
            f"at least {mib(total * buffer_bytes + outside)}, or move a part to nvme "
            "(--snake-param-tier / --snake-optimizer-tier / --snake-activation-tier nvme)")


@dataclass(frozen=True)
class HostRoom:
    """Host buffers a copy made only if there is room must leave free (TensorStore's
    ``spill``/``if_room``), besides ``planned``: the buffers the placement planned for the
    host tiers, which the pool keeps for them whether they hold them now or not
    (``HostBufferPool.reserved``: a buffer a planned record holds is not counted again). So
    records that can go to the drive instead never crowd out the drive's staging or what
    was planned."""

    planned: int   # host-tier weights and optimizer state, unit inputs planned on host
    spill: int     # gradients waiting for their update, optimizer state read ahead
    weights: int   # the weights a unit reads next (prefetch, a just-updated part): they
    #                may also use the two units' worth reserved for them


def host_room(args, tiers: StateTiers, need: HostBuffers, pool_buffers: int) -> HostRoom:
    """``HostRoom`` from the placement: an eighth of the pool for staging, the host tiers
    chosen and the unit inputs on the host planned (under ``auto`` the activation plan
    reserves its own when it is made), and two of the largest unit's weights reserved for
    the weights read next. With saved tensors offloaded to the host
    (their size is known only while running) nothing spills to host memory."""
    staging = max(1, pool_buffers // 8)
    if args.snake_activation_offload and args.snake_activation_tier == "host":
        return HostRoom(0, pool_buffers, pool_buffers)
    # (under auto, the activation plan adds its host checkpoints when it is made)
    planned = sum(n for _, n in on_host_tier(args, tiers, need))
    reserve = 0 if tiers.params == "host" else 2 * need.largest_unit_weights
    return HostRoom(planned=planned, spill=staging + reserve, weights=staging)


@dataclass(frozen=True)
class Speculation:
    """Which layouts' backward parts are updated speculatively (``OffloadedAdamW``'s
    ``speculate``: in the backward sweep, before the step's norm is known) and what they
    keep until the step's verdict: each one's new master weights and moments beside the
    old, on the optimizer's tier (``kept_bytes``; ``host_buffers`` of them in the pool)."""

    layouts: tuple = ()          # indices in the forward sweep's order of updates
    kept_bytes: int = 0
    host_buffers: int = 0
    of: int = 0                  # layouts that could speculate
    why: str = ""                # why none or not all do

    def summary(self) -> str:
        if not self.layouts:
            return f"speculative updates: none ({self.why})"
        some = f"{len(self.layouts)} of {self.of} layouts" if len(self.layouts) < self.of \
            else f"all {self.of} layouts"
        return (f"speculative updates: {some}, keeping {size(self.kept_bytes)} of state "
                "until each step's norm is known" + (f" ({self.why})" if self.why else ""))


def plan_speculation(args, parts: list[int], tier: str, buffers_for, *,
                     host_room: int | None = None, drive_room: int | None = None) -> Speculation:
    """The layouts that speculate, first in the forward sweep's order (``parts``: the
    size of each layout's backward part in that order): the first units' updates are on
    the step's critical path (the forward sweep reads their weights first), while a later
    unit's update, left for the forward sweep, hides behind the compute of the units before
    it. They speculate only where an update needs the step's verdict (``--clip-grad``,
    ``--fp16``), and while their kept state fits: in the pool's ``host_room`` buffers on
    the host tier, in ``drive_room`` bytes (with the space check's margin) on the drive
    (None: no limit known)."""
    p = Precision.from_args(args)
    if args.snake_speculate == "off":
        return Speculation(of=len(parts), why="--snake-speculate off")
    if not (args.clip_grad > 0 or args.fp16):
        return Speculation(of=len(parts), why="no clip or loss scale: no update waits")
    if not p.speculable:
        return Speculation(of=len(parts), why="--main-params-dtype fp16")
    per = [p.nbytes(n) for n in ("master", "exp_avg", "exp_avg_sq")]
    chosen, kept, buffers = [], 0, 0
    for index, numel in enumerate(parts):
        more = numel * sum(per)
        more_buffers = sum(buffers_for(numel * n) for n in per) if numel else 0
        if tier == "host" and host_room is not None and buffers + more_buffers > host_room:
            break
        if tier == "nvme" and drive_room is not None and \
                (kept + more) * (1 + directory.MARGIN_FRACTION) > drive_room:
            break
        chosen.append(index)
        kept, buffers = kept + more, buffers + (more_buffers if tier == "host" else 0)
    why = "" if len(chosen) == len(parts) else \
        ("the host pool's room" if tier == "host" else "the drive's free space")
    return Speculation(tuple(chosen), kept, buffers, len(parts), why)


def kept_state_room(pool_buffers: int, planned: int) -> int:
    """Pool buffers the kept state of speculative updates may take on the host tier: what
    the planned host records leave, but a staging allowance (the default pool's) and one
    buffer always free for the drive's I/O. Its buffers are planned too (reserved)."""
    return pool_buffers - planned - min(STAGING_BUFFERS, pool_buffers // 8) - 1


def backward_parts(args, params, dp: DataParallel, share=()) -> list[int]:
    """This rank's backward part of each layout, in the forward sweep's order of updates
    (what ``plan_speculation`` takes): none for the units of the device ``share`` (updated
    on the device, they do not speculate)."""
    units = {id(lay): u for u, lay in enumerate(params.units)}
    return [0 if units.get(id(lay)) in share else hi - lo
            for lay, (lo, hi) in ((lay, part_bounds(lay, args.snake_alpha, dp)[0])
                                  for lay in update_order(params))]


def update_order(params) -> list:
    """The layouts in the order the forward sweep updates them (each unit's, the shared
    one with the unit that owns it)."""
    order = []
    for unit in range(len(params.units)):
        order.append(params.units[unit])
        if getattr(params, "shared_owner", 0) == unit and params.shared.segments:
            order.append(params.shared)
    return order


def saves_to_offload_drive(args, offload_path: str) -> bool:
    """Whether ``--save`` is on the file system of the offload directory."""
    if not args.save:
        return False
    path = os.path.abspath(args.save)
    while not os.path.exists(path):   # --save is made at the first save
        path = os.path.dirname(path)
    return os.stat(path).st_dev == os.stat(offload_path).st_dev


def checkpoint_bytes_planned(args, model_bytes: int, optimizer_bytes: int) -> int:
    """What this rank's ``--save`` checkpoints of the run add up to (every saved iteration
    is kept, as in Megatron-LM): its model state and its optimizer shard, per save."""
    saves = (args.train_iters // args.save_interval if args.save_interval else 0) + 1
    return saves * (model_bytes + optimizer_bytes)


@dataclass(frozen=True)
class DevicePlan:
    """What of the offloaded state stays on the compute device: the units whose optimizer
    state lives and is updated there (``share``: Megatron's own optimizer on the device, for
    the first units in the forward sweep's order), and the units whose working weights stay
    there (``pinned``: the share's, then as many more as the room leaves)."""

    share: tuple = ()
    pinned: tuple = ()
    share_bytes: int = 0      # the share's master weights and moments on the device
    why: str = ""             # why no share, or the share asked for

    def summary(self) -> str:
        """A line for the start-up log; empty where auto put nothing there (the default
        without a device memory limit: nothing to say)."""
        if not self.share and self.why.startswith("auto"):
            return ""
        if not self.share:
            return f"the optimizer on the device: none ({self.why})"
        return (f"the optimizer on the device: units {list(self.share)}, "
                f"{size(self.share_bytes)} of master weights and moments ({self.why})")


def _device_room(args, params: UnitParams) -> int:
    """What ``--snake-gpu-memory-limit`` leaves after the working set (the unit computed,
    the prefetched next one, the gradient accumulator) and the step's checkpoints when they
    may stay on the device."""
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    working_set, _ = unit_working_set_bytes(args, params)
    room = args.snake_gpu_memory_limit - working_set - \
        max(lay.numel for lay in params.units) * elem          # the prefetched next unit
    if args.snake_activation_tier in ("device", "auto"):
        room -= checkpoint_bytes_per_step(args)
    return room


def plan_device(args, params: UnitParams, dp_size: int) -> DevicePlan:
    """``DevicePlan`` from ``--snake-device-optimizer-share`` and ``--snake-gpu-memory-limit``.
    A share F: the first units in the forward sweep's order, F of this rank's unit
    parameters (refused when the limit leaves no room for it). auto: as many of them as the
    room holds (an update on the device costs it little: 16 bytes of its memory traffic a
    parameter, against the host's whole update), none without the limit (the device's free
    memory is not known). Then the weights of as many other units as the room leaves stay
    on the device, smallest first. Without the limit nothing else is pinned."""
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    state = Precision.from_args(args).state_bytes
    shard = [-(-lay.numel // dp_size) for lay in params.units]   # this rank's records
    limit = args.snake_gpu_memory_limit
    room = _device_room(args, params) if limit is not None else None
    share, why, asked = [], "", args.snake_device_optimizer_share
    if asked == "auto" and not Precision.from_args(args).fp32:
        why = "auto with --use-precision-aware-optimizer: its states stay on the host"
    elif asked == "auto" and room is None:
        why = "auto without --snake-gpu-memory-limit: the device's free memory is not known"
    elif asked == "auto":
        for unit, n in enumerate(shard):
            if n * (elem + state) > room:
                break
            share.append(unit)
            room -= n * (elem + state)
        why = "auto: what --snake-gpu-memory-limit leaves room for"
    else:
        goal, total = float(asked) * sum(shard), 0
        for unit, n in enumerate(shard):
            if total + n > goal:
                break
            share.append(unit)
            total += n
        need = total * (elem + state)
        if room is not None and need > room:
            raise FlagError(
                f"--snake-device-optimizer-share {asked}: units {share} need {mib(need)} of "
                f"device memory for their weights and optimizer state, but "
                f"--snake-gpu-memory-limit {mib(limit)} leaves {mib(max(room, 0))} after the "
                "working set; lower the share, or raise the limit")
        room = None if room is None else room - need
        why = f"--snake-device-optimizer-share {asked}"
    pinned = list(share)
    if room is not None:
        for unit in sorted(range(len(shard)), key=lambda u: shard[u]):
            if unit in share:
                continue
            if shard[unit] * elem > room:
                break
            pinned.append(unit)
            room -= shard[unit] * elem
    return DevicePlan(tuple(share), tuple(sorted(pinned)),
                      sum(shard[u] for u in share) * state, why)


def units_to_pin(args, params: UnitParams, dp_size: int) -> list[int]:
    """Units whose working weights stay on the device (``plan_device``'s ``pinned``)."""
    return list(plan_device(args, params, dp_size).pinned)


def nvme_bytes(args, tiers: StateTiers, weights_bytes: int, optimizer_bytes: int) -> int:
    """What the plan places on NVMe: checked against free space before the first step.
    Under ``auto`` every unit input may be there (the profiled steps put them all there)."""
    total = checkpoint_bytes_per_step(args) \
        if args.snake_activation_tier in ("nvme", "auto") else 0
    total += weights_bytes if tiers.params == "nvme" else 0
    total += optimizer_bytes if tiers.optimizer == "nvme" else 0
    return total


def forward_window(args) -> int:
    """Unit checkpoints kept on the device between a unit's forward and the next unit's
    (OffloadedUnitInputs' ``keep_for_next_unit``): one snake group's."""
    return getattr(args, "snake_group_size", None) or getattr(args, "num_microbatches", 1)


def unit_working_set_bytes(args, params: UnitParams) -> tuple[int, int]:
    """(bytes, unit) of the largest device working set of one unit: its weights and fp32
    gradient, the shared (tied) weights and their fp32 gradient, and the checkpoints
    between two units of the forward sweep (``forward_window``) with one micro-batch's
    output. Activations inside the unit come on top."""
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    checkpoint = args.seq_length * args.micro_batch_size * args.hidden_size * elem
    checkpoints = 1 + max(1, forward_window(args))
    shared = params.shared.numel * (elem + 4)
    sizes = [lay.numel * (elem + 4) + shared + checkpoints * checkpoint
             for lay in params.units]
    unit = max(range(len(sizes)), key=sizes.__getitem__)
    return sizes[unit], unit


def grad_scaler(args):
    """Megatron-LM's loss scaler for fp16 (None otherwise): static with --loss-scale."""
    if not args.fp16:
        return None
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if args.loss_scale:
        return ConstantGradScaler(args.loss_scale)
    return DynamicGradScaler(initial_scale=args.initial_loss_scale,
                             min_scale=args.min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=args.loss_scale_window,
                             hysteresis=args.hysteresis)


def _model_parallel_group():
    """Megatron's TP x PP group when it has more than one rank (the gradient norm and the
    fp16 overflow flag are reduced over it), else None."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() * \
            parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return parallel_state.get_model_parallel_group()
    return None


def _embedding_group(gpt):
    """Megatron's group of the first and last pipeline stage when they hold the two copies
    of a tied embedding (and this rank is in it), else None."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and \
            gpt.share_embeddings_and_output_weights and \
            parallel_state.is_rank_in_embedding_group():
        return parallel_state.get_embedding_group()
    return None


def working_set_parts(tied: bool) -> str:
    """What a unit's device working set holds, in words (``unit_working_set_bytes``);
    ``tied``: the model has shared (tied) weights on this stage."""
    return "its weights and fp32 gradient, " + \
        ("the tied embedding and its fp32 gradient, " if tied else "") + \
        "a snake group's unit inputs"


def working_set_error(limit: int, need: int, unit, *, tied: bool) -> FlagError:
    """``--snake-gpu-memory-limit`` below the largest unit's working set (the pre-flight
    and the start check say it alike)."""
    return FlagError(
        f"--snake-gpu-memory-limit {mib(limit)} is below the working set of unit {unit} "
        f"({mib(need)}: {working_set_parts(tied)}); the minimum is {need} bytes. Raise "
        "the limit or lower --snake-checkpoint-interval or --snake-group-size.")


def build_offloaded_state(args, gpt, store, device: torch.device, *,
                          initial: InitialWeights | None = None) -> OffloadedState:
    """Move ``gpt``'s weights and a fresh AdamW state into ``store`` (checking the device
    limit and that the drive has room for all of it first). ``initial``: the values of a
    model built out of memory (``build_gpt_model(..., on_built=initial.spill)``)."""
    units = GPTUnits(gpt, args.snake_checkpoint_interval)
    params = UnitParams.of(units)
    if initial is not None:   # shared (tied) weights stay on the device for the whole run
        initial.restore(params.shared, device)
    if args.snake_gpu_memory_limit is not None:
        need, unit = unit_working_set_bytes(args, params)
        if args.snake_gpu_memory_limit < need:
            raise working_set_error(args.snake_gpu_memory_limit, need, unit,
                                    tied=params.shared.numel > 0)
    dp = DataParallel.from_megatron()
    full_numel = sum(lay.numel for lay in params.all_layouts())
    numel = -(-full_numel // dp.size)  # this rank's share
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    device_plan = plan_device(args, params, dp.size)
    need = host_buffers_needed(args, params, dp, list(device_plan.pinned),
                               store.host_buffers_for, device_plan.share)
    tiers = resolve_state_tiers(args, need, store.pool.count)
    off_device = numel - sum(-(-params.units[u].numel // dp.size) for u in device_plan.share)
    error, capacity = None, (0, 0)
    try:
        check_host_memory(args, tiers, need, store.pool.count, store.pool.buffer_bytes)
        room = host_room(args, tiers, need, store.pool.count)
        store.spill_keep_free, store.pool.reserved = room.spill, room.planned
        # master, moments, gradient, each in its dtype
        planned = nvme_bytes(args, tiers, numel * elem,
                             optimizer_bytes_per_param(args) * off_device)
        if initial is not None:   # held until the state is built from them: counted too
            planned += initial.nbytes
        # the --save checkpoints land on one file system: counted there alone
        saved_on = next((d.path for d in store.dirs if saves_to_offload_drive(args, d.path)),
                        None)
        saved = checkpoint_bytes_planned(
            args, full_numel * elem, Precision.from_args(args).checkpoint_bytes * numel) \
            if saved_on else 0
        try:
            capacity = store.check_capacity(planned, {saved_on: saved} if saved else None)
        except CapacityError as exc:
            if not saved:
                raise
            raise CapacityError(f"{exc} (This counts {mib(saved)} of --save checkpoints on "
                                "the same file system: every saved iteration is kept; raise "
                                "--save-interval or save to another drive.)") from None
        speculation = plan_speculation(
            args, backward_parts(args, params, dp, device_plan.share), tiers.optimizer,
            store.host_buffers_for, host_room=kept_state_room(store.pool.count, room.planned),
            drive_room=capacity[1] - capacity[0] if capacity else None)
        store.pool.reserved += speculation.host_buffers   # the kept state's, when on host
    except (OSError, ValueError, RuntimeError) as exc:
        error = exc
    distributed.raise_unless_all_ranks_ok(error, "host memory and free space check for the "
                                          "offloaded state")
    order = update_order(params)
    optimizer = OffloadedAdamW(params, store, lr=args.lr, weight_decay=args.weight_decay,
                               beta1=args.adam_beta1, beta2=args.adam_beta2, eps=args.adam_eps,
                               clip_grad=args.clip_grad, alpha=args.snake_alpha,
                               tier=tiers.optimizer, dp=DataParallel.from_megatron(),
                               grad_scaler=grad_scaler(args),
                               model_parallel_group=_model_parallel_group(),
                               embedding_group=_embedding_group(gpt), initial=initial,
                               precision=Precision.from_args(args),
                               weight_records=False,   # OffloadedUnits writes them
                               threads=args.snake_optimizer_threads,
                               speculate=[order[i].key for i in speculation.layouts],
                               device_share=[params.units[u].key for u in device_plan.share])
    weights = OffloadedUnits(params, store, optimizer, device=device, dtype=args.params_dtype,
                             tier=tiers.params, pinned=device_plan.pinned, initial=initial,
                             host_keep_free=room.weights)
    if initial is not None:
        initial.drop()
    return OffloadedState(units, weights, optimizer, tiers, capacity, speculation,
                          device_plan)
