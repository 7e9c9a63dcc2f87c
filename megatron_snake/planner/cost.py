"""The cost of one training step of the vertical schedule, from a workload and a hardware
profile.

Per pipeline stage and sweep, each resource's busy time: device compute (with the
tensor-parallel all-reduces, which it waits for, and the host's fixed time per layer pass and
per unit visit, measured in real steps), copies between the device and the store,
host-memory copies inside the store, the drive (reads and writes share it), the CPU AdamW
and the data-parallel collectives. They overlap, so a sweep takes the busiest of them, plus
the first unit's weight read, which nothing hides; a compute device that shares the host's
cores (the CPU) is slowed by the drive's I/O beside it, by a measured share. Read-ahead
moves the optimizer state's reads from the forward sweep into the backward sweep's drive
slack, as the runtime does (docs/overlap.md). A stage's time is its sweeps over all snake
groups plus its pipeline sends; the step is when Megatron's 1F1B over the M/G groups ends,
given each stage's per-group sweeps: (M/G + p - 1) / (M/G) times a stage's time when the
stages are equal, less when only one stage is slow. Bytes follow the store's
accounting: what each tier holds, and what it reads and writes per step, per kind of state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_snake.errors import UserError
from megatron_snake.planner.hardware import Hardware
from megatron_snake.planner.workload import Stage, Workload

RESOURCES = ("compute", "copy", "host", "drive", "cpu_adam", "dp_comm")
SWEEPS = ("forward", "backward")
OPTIMIZER_BYTES = 12   # fp32 master weight and two moments per parameter (the default;
GRAD_BYTES = 4         # the fp32 gradient: Workload.optimizer_record_bytes says otherwise)
DEVICE_GRAD_BYTES = 4  # the device accumulates a unit's gradient in fp32 whatever is stored


class DoesNotFit(UserError, ValueError):
    """The workload needs more of a tier than the hardware has."""


@dataclass
class Traffic:
    """Bytes of one sweep: per kind of state and tier, [read, written]."""

    by_kind: dict = field(default_factory=dict)
    copy: int = 0              # between the device and the store (PCIe on a GPU)
    adam_params: int = 0       # parameters the CPU AdamW updates
    dp_bytes: float = 0.0      # data-parallel collective bytes per rank (bus bytes)

    def add(self, kind: str, tier: str, read: float = 0, written: float = 0) -> None:
        if tier == "device" or (not read and not written):
            return
        rw = self.by_kind.setdefault(kind, {}).setdefault(tier, [0, 0])
        rw[0] += int(round(read))
        rw[1] += int(round(written))

    def tier(self, tier: str) -> tuple[int, int]:
        rws = [t[tier] for t in self.by_kind.values() if tier in t]
        return sum(r for r, _ in rws), sum(w for _, w in rws)

    def host_copied(self) -> int:
        """Host-tier bytes that are copied: the CPU update borrows its state and gradient
        in place (TensorStore.borrow), so their host reads and its state's host writes
        are counted as traffic but move nothing."""
        read, written = self.tier("host")
        optim = self.by_kind.get("optim", {}).get("host", [0, 0])
        grad = self.by_kind.get("grad", {}).get("host", [0, 0])
        return read + written - sum(optim) - grad[0]


@dataclass
class StageCost:
    stage: int
    sweeps: dict               # sweep -> {resource: seconds, "fill": s, "time": s}
    p2p_s: float
    traffic: dict              # sweep -> Traffic
    capacity: dict             # tier -> bytes this rank holds

    @property
    def time_s(self) -> float:
        return sum(s["time"] for s in self.sweeps.values()) + self.p2p_s


@dataclass
class Prediction:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble_s: float
    stages: list               # StageCost per stage
    slowest: int               # the stage that sets the step time
    breakdown: dict            # the slowest stage: sweep -> {resource: s}, plus bubble, p2p
    bytes: dict                # tier -> {"capacity", "read", "written"}, the slowest stage
    bytes_by_kind: dict        # kind -> tier -> [read, written] per step, the slowest stage
    drive_capacity_per_node: int

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "bubble_s": self.bubble_s, "slowest_stage": self.slowest,
                "breakdown": self.breakdown, "bytes": self.bytes,
                "bytes_by_kind": self.bytes_by_kind,
                "drive_capacity_per_node": self.drive_capacity_per_node}


# --- placement --------------------------------------------------------------------------
def _share(n: int, dp: int) -> int:
    """This data-parallel rank's records of n parameters."""
    return -(-n // dp)


def _buffers(nbytes: float, w: Workload) -> int:
    return max(1, math.ceil(nbytes / (w.host_buffer_bytes - 64)))   # 64: a record's header


def _checkpoint_counts(w: Workload, stage: int) -> tuple[int, int, int]:
    """(unit inputs stored per step, read back in the backward sweep, read in the forward
    sweep). The first stage's first unit starts from the embedding; a later stage stores
    what it received. A group's inputs stay on the device from one unit's forward to the
    next's (the forward window), so the forward sweep reads none back, and the loss unit,
    first in the backward sweep, takes its inputs from there too."""
    units = len(w.stages[stage].unit_params)
    stored = (units - (1 if stage == 0 else 0)) * w.micro_batches
    from_window = w.micro_batches if stage == w.pp - 1 and stored else 0
    return stored, stored - from_window, 0


def device_working_set(w: Workload, st: Stage) -> int:
    """The largest unit's weights and fp32 gradient, the tied weights, a group's unit
    inputs (the forward window) and one micro-batch's output, the next unit prefetched,
    and the activations of one micro-batch's
    recompute (Korthikanti et al.: s b h (34 + 5 a s / h) bytes a layer at 2 bytes, over
    the tensor-parallel ranks)."""
    e, c = w.elem_bytes, w.checkpoint_bytes
    act_layer = w.seq_length * w.micro_batch_size * w.hidden_size * \
        (34 + 5 * w.heads * w.seq_length / w.hidden_size) / w.tp * e / 2
    units = max(p * (e + DEVICE_GRAD_BYTES) + layers * act_layer
                for p, layers in zip(st.unit_params, st.unit_layers))
    return int(units + st.shared_params * (e + DEVICE_GRAD_BYTES) + (1 + w.group_size) * c
               + max(st.unit_params) * e)


def _alive(w: Workload, stage: int, stored: int) -> int:
    """Unit inputs a stage holds at once: a group's are freed by its backward sweep, and
    under 1F1B stage s has up to p - s groups in flight."""
    return max(1, stored // w.groups * min(w.groups, w.pp - stage))


def _host_tier_buffers(w: Workload, shares: list[int], shared: int) -> int:
    """Pool buffers the weights and optimizer state placed on the host tier hold (whole
    buffers per record: a unit's weights, and master weight, two moments and gradient,
    each in its dtype)."""
    records = shares + ([shared] if shared else [])
    n = sum(_buffers(s * w.elem_bytes, w) for s in records) if w.param_tier == "host" else 0
    if w.optimizer_tier == "host":
        n += sum(_buffers(s * b, w) for s in records for b in w.optimizer_record_bytes)
    return n


def _checkpoint_tiers(w: Workload, st: Stage, hw: Hardware, alive: int,
                      host_free: int) -> dict:
    """Fraction of the unit inputs on each tier. ``auto``: the device's memory left after the
    working set, then host memory (half the pool at most, in whole buffers, after the host
    tiers and the drive's staging), then the drive."""
    if w.activation_tier != "auto":
        return {w.activation_tier: 1.0}
    c = w.checkpoint_bytes
    on_device = max(0, hw.device_memory * 0.9 - device_working_set(w, st)) // c
    pool = w.host_pool_bytes // w.host_buffer_bytes
    on_host = max(0, min(pool // 2, host_free)) // _buffers(c, w)
    device = min(alive, on_device)
    host = min(alive - device, on_host)
    return {"device": device / alive, "host": host / alive, "nvme": (alive - device - host) / alive}


# --- traffic ----------------------------------------------------------------------------
def stage_traffic(w: Workload, stage: int, hw: Hardware) -> tuple[dict, dict]:
    """({sweep: Traffic}, {tier: bytes held}) of one rank of ``stage``."""
    st = w.stages[stage]
    e, dp, groups = w.elem_bytes, w.dp, w.groups
    shares = [_share(p, dp) for p in st.unit_params]
    shared = _share(st.shared_params, dp)
    numel = sum(shares) + shared
    weights = numel * e
    turn = st.unit_params[-1] if stage == w.pp - 1 else 0   # the last unit, kept at the turn
    f = 1.0 if w.update_in_forward else w.alpha              # updated in the forward sweep
    fwd, bwd = Traffic(), Traffic()

    # gradients: off the device in the backward sweep, read by their update; host while the
    # pool has room beside the planned records, else the optimizer's tier
    grads = numel * w.grad_bytes
    stored, bwd_reads, fwd_reads = _checkpoint_counts(w, stage)
    alive = _alive(w, stage, stored)
    pool = w.host_pool_bytes // w.host_buffer_bytes
    staging = max(1, pool // 8)
    host_tiers = _host_tier_buffers(w, shares, shared)
    ckpt_tiers = _checkpoint_tiers(w, st, hw, alive, pool - host_tiers - staging)
    host_ckpts = math.ceil(ckpt_tiers.get("host", 0) * alive) * _buffers(w.checkpoint_bytes, w)
    # as training/offloaded_state.host_room: staging, the planned host records and, with
    # the weights on the drive, two units' weights for the weights read next stay free
    reserve = 0 if w.param_tier == "host" else 2 * _buffers(max(shares) * e, w)
    room = pool - staging - host_tiers - host_ckpts - reserve
    # working weights: read in both sweeps of every group; an update writes its part once.
    # The forward sweep's updates publish into host memory, where the first group's read
    # finds them. On the drive's tier, what a forward read found or read into host memory
    # stays there for the backward read (when the pool has room for the stage's weights
    # beside what is kept free), which moves it down: the backward sweep then reads none
    # from the drive, and the published part is written in the backward sweep.
    kept = w.param_tier == "nvme" and _buffers(weights, w) <= room
    bwd_weights = groups * (weights - _share(turn, dp) * e - shared * e)
    published = f * weights
    fwd.add("weights", w.param_tier, read=groups * weights - published,
            written=0 if kept else published)
    if w.param_tier == "nvme":
        fwd.add("weights", "host", read=published, written=published)
    # Master-weight remainders: the backward read leaves kept weights in host memory, where
    # the next update reads them (its masters' high halves), so the published part is not
    # written to the drive; weights that are not kept are read again from their tier.
    moved_down = published if kept and not w.update_reads_weights else 0
    bwd.add("weights", w.param_tier, read=0 if kept else bwd_weights,
            written=(1 - f) * weights + moved_down)
    if kept:
        bwd.add("weights", "host", read=bwd_weights)
    if w.update_reads_weights:
        tier = "host" if kept or w.param_tier == "host" else w.param_tier
        fwd.add("weights", tier, read=f * weights)
        bwd.add("weights", tier, read=(1 - f) * weights)
    fwd.copy += groups * weights
    bwd.copy += bwd_weights

    grad_tier = "host" if w.optimizer_tier == "host" or \
        _buffers(f * grads, w) + _buffers(max(shares) * w.grad_bytes, w) <= room else "nvme"
    bwd.add("grad", grad_tier, written=grads, read=(1 - f) * grads)
    fwd.add("grad", grad_tier, read=f * grads)
    bwd.copy += grads

    # optimizer state: read and written once, in the sweep that runs the update
    state = numel * w.optimizer_bytes
    fwd.add("optim", w.optimizer_tier, read=f * state, written=f * state)
    bwd.add("optim", w.optimizer_tier, read=(1 - f) * state, written=(1 - f) * state)
    fwd.adam_params, bwd.adam_params = f * numel, (1 - f) * numel

    # unit inputs: stored in the forward sweep, read back in both
    c = w.checkpoint_bytes
    for tier, frac in ckpt_tiers.items():
        fwd.add("activations", tier, read=frac * fwd_reads * c, written=frac * stored * c)
        bwd.add("activations", tier, read=frac * bwd_reads * c)
        if tier != "device":
            fwd.copy += frac * (fwd_reads + stored) * c
            bwd.copy += frac * bwd_reads * c

    # data parallelism: weights all-gathered per read, gradients reduce-scattered once
    if dp > 1:
        ring = (dp - 1) / dp
        full = (sum(st.unit_params) + st.shared_params) * e
        fwd.dp_bytes = ring * groups * full
        bwd.dp_bytes = ring * (groups * (full - turn * e - st.shared_params * e)
                               + (sum(st.unit_params) + st.shared_params) * DEVICE_GRAD_BYTES)

    held = {"device": device_working_set(w, st), "host": w.host_pool_bytes, "nvme": 0,
            "host_buffers": host_tiers + host_ckpts}
    held["nvme"] += weights if w.param_tier == "nvme" else 0
    held["nvme"] += state + grads if w.optimizer_tier == "nvme" else 0
    if w.activation_tier in ("nvme", "auto"):   # auto: the profiled steps put all there
        held["nvme"] += stored * c               # as the pre-flight counts them
    held["device"] += int(ckpt_tiers.get("device", 0) * alive * c)
    return {"forward": fwd, "backward": bwd}, held


# --- time -------------------------------------------------------------------------------
def _gpus_on_a_node(w: Workload, hw: Hardware) -> int:
    return min(hw.gpus_per_node, w.tp * w.pp * w.dp)


def _bus(w: Workload, hw: Hardware, ranks: int) -> float:
    """Collective bandwidth of a group spanning ``ranks`` consecutive GPUs."""
    return hw.intra_node_Bps if ranks <= hw.gpus_per_node else hw.inter_node_Bps


def _seconds(w: Workload, hw: Hardware, stage: int, sweep: str, t: Traffic) -> dict:
    st = w.stages[stage]
    share = _gpus_on_a_node(w, hw)   # the node's drives serve all its GPUs at once
    drive_r, drive_w = hw.drive_read_Bps / share, hw.drive_write_Bps / share
    # The backward sweep recomputes each unit and runs its backward (twice a forward); the
    # last stage's forward sweep stops before its last unit, which turns in place.
    units = len(st.unit_flops) - (1 if sweep == "forward" and stage == w.pp - 1 else 0)
    passes = 3 if sweep == "backward" else 1
    flops = passes * sum(st.unit_flops[:units])
    # the fixed time of a pass is a one-layer unit's: kernel launches and Python per layer
    layer_passes = sum(max(1, layers) for layers in st.unit_layers[:units])
    tp_s = 0.0
    if w.tp > 1:   # two all-reduces per layer and pass
        act = w.micro_batch_size * w.seq_length * w.hidden_size * w.elem_bytes
        per = 2 * (w.tp - 1) / w.tp * act / _bus(w, hw, w.tp)
        tp_s = 2 * passes * sum(st.unit_layers[:units]) * per * w.micro_batches
    drive_read, drive_written = t.tier("nvme")
    # the output layer runs with the last unit: in the backward sweep only on the last stage
    head = passes * st.head_flops if sweep == "backward" and stage == w.pp - 1 else 0.0
    out = {
        "compute": flops * w.micro_batches / (hw.device_tflops * 1e12) + tp_s
        + head * w.micro_batches / (hw.output_layer_tflops * 1e12)
        + passes * layer_passes * w.micro_batches * hw.unit_overhead_s
        + units * w.groups * hw.unit_visit_s,
        "copy": t.copy / hw.pcie_Bps,
        "host": t.host_copied() / hw.host_copy_Bps,
        "drive": drive_read / drive_r + drive_written / drive_w,
        "cpu_adam": t.adam_params / (hw.cpu_adam_params_per_s * w.update_rate_share),
        "dp_comm": t.dp_bytes / _bus(w, hw, w.tp * w.dp) if w.dp > 1 else 0.0,
    }
    first = _share(st.unit_params[0], w.dp) * w.elem_bytes
    rate = drive_r if w.param_tier == "nvme" else hw.host_copy_Bps
    out["fill"] = w.groups * (first / rate + first / hw.pcie_Bps)
    return out


def _read_ahead(w: Workload, hw: Hardware, sweeps: dict, traffic: dict) -> None:
    """Move forward-sweep optimizer reads into the backward sweep's drive slack (into host
    memory), as OffloadedAdamW.read_ahead_state does."""
    if w.optimizer_tier != "nvme":
        return
    bwd = sweeps["backward"]
    slack = max(r for k, r in bwd.items() if k in RESOURCES) - bwd["drive"]
    read = traffic["forward"].by_kind.get("optim", {}).get("nvme", [0, 0])[0]
    drive_r = hw.drive_read_Bps / _gpus_on_a_node(w, hw)
    moved = int(min(read, slack * drive_r))
    if moved <= 0:
        return
    traffic["forward"].by_kind["optim"]["nvme"][0] -= moved
    traffic["backward"].add("optim", "nvme", read=moved)
    traffic["backward"].add("optim", "host", written=moved)
    traffic["forward"].add("optim", "host", read=moved)
    for sweep, sign in (("forward", -1), ("backward", 1)):
        sweeps[sweep]["drive"] += sign * moved / drive_r
    # read into host buffers straight from the drive, and borrowed there in place


def _slow_compute_by_io(sweep: dict, share: float) -> None:
    """A compute device that shares its cores with the store (the CPU) loses ``share`` of
    its time while the drive's I/O runs beside it: the compute stretches by what the I/O
    takes during the overlap, which lasts the drive's time or the stretched compute's,
    whichever is shorter."""
    if share:
        alone = sweep["compute"]
        sweep["compute"] = alone + share * min(sweep["drive"], alone / (1 - share))


def stage_cost(w: Workload, hw: Hardware, stage: int) -> StageCost:
    traffic, held = stage_traffic(w, stage, hw)
    sweeps = {s: _seconds(w, hw, stage, s, traffic[s]) for s in SWEEPS}
    _read_ahead(w, hw, sweeps, traffic)
    for s in sweeps.values():
        _slow_compute_by_io(s, hw.io_compute_slowdown)
        s["time"] = max(s[r] for r in RESOURCES) + s["fill"]
    p2p = 0.0
    if w.pp > 1:   # activations forward and gradients back, per group and boundary
        p2p = 2 * w.micro_batches * w.checkpoint_bytes / \
            _bus(w, hw, w.tp * w.dp * w.pp) * (2 if 0 < stage < w.pp - 1 else 1)
    return StageCost(stage, sweeps, p2p, traffic, held)


def check_fits(w: Workload, hw: Hardware, cost: StageCost) -> None:
    need = cost.capacity
    if need["device"] > hw.device_memory:
        raise DoesNotFit(
            f"device memory: stage {cost.stage} needs {need['device'] / 2**30:.1f} GiB "
            f"(the largest unit's working set, its recompute's activations and the unit "
            f"inputs kept there), the device has {hw.device_memory / 2**30:.1f} GiB: raise "
            "--tensor-model-parallel-size or lower --snake-checkpoint-interval or "
            "--micro-batch-size")
    gpus = _gpus_on_a_node(w, hw)
    pool = w.host_pool_bytes // w.host_buffer_bytes
    if need["host_buffers"] + 1 > pool:
        raise DoesNotFit(
            f"host memory: stage {cost.stage}'s host tiers need {need['host_buffers'] + 1} "
            f"buffers of {w.host_buffer_bytes >> 20} MiB (with one for staging), "
            f"--snake-host-memory-limit {w.host_pool_bytes / 2**30:.1f} GiB holds {pool}: "
            "raise the limit or move a part to nvme")
    node_drive = need["nvme"] * gpus
    if node_drive > hw.drive_capacity:
        raise DoesNotFit(
            f"drive: a node needs {node_drive / 1e12:.2f} TB ({need['nvme'] / 1e9:.1f} GB per "
            f"GPU), its drives hold {hw.drive_capacity / 1e12:.2f} TB: use more nodes or "
            "larger drives")
    node_host = w.host_pool_bytes * gpus
    if node_host > hw.host_memory:
        raise DoesNotFit(
            f"host memory: {gpus} GPUs x --snake-host-memory-limit "
            f"{w.host_pool_bytes / 2**30:.1f} GiB = {node_host / 2**30:.1f} GiB, the node has "
            f"{hw.host_memory / 2**30:.1f} GiB: lower --snake-host-memory-limit")


def _per_group(cost: StageCost, sweep: str, groups: int) -> float:
    """One snake group's sweep on a stage, with its half of the stage's pipeline sends."""
    return (cost.sweeps[sweep]["time"] + cost.p2p_s / 2) / groups


def one_f_one_b(fwd: list[float], bwd: list[float], groups: int) -> float:
    """When Megatron's 1F1B schedule ends, each stage running a group's forward sweep in
    ``fwd[s]`` and its backward sweep in ``bwd[s]``: (groups + p - 1) times a group's time
    at equal stages; at unequal ones the slowest stage sets the pace and the others add
    their fill and drain, which 1F1B's order partly hides (so no closed form)."""
    p = len(fwd)
    orders = []
    for s in range(p):   # warm-up forwards, then one forward and one backward in turn
        warm = min(p - 1 - s, groups)
        ops = [("F", g) for g in range(warm)]
        for g in range(groups):
            if g + warm < groups:
                ops.append(("F", g + warm))
            ops.append(("B", g))
        orders.append(ops)
    end: dict = {}             # (kind, stage, group) -> when it ends
    free = [0.0] * p           # when each stage is next free
    nxt = [0] * p              # each stage's next op
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, g = orders[s][nxt[s]]
                if kind == "F":
                    needs = ("F", s - 1, g) if s else None
                else:
                    needs = ("B", s + 1, g) if s < p - 1 else ("F", s, g)
                if needs is not None and needs not in end:
                    break
                start = max(free[s], end[needs] if needs else 0.0)
                free[s] = end[(kind, s, g)] = start + (fwd[s] if kind == "F" else bwd[s])
                nxt[s] += 1
                moved = True
        if not moved:
            raise AssertionError("1F1B deadlocked: a planner bug")
    return max(free)


def predict(w: Workload, hw: Hardware, *, check: bool = True) -> Prediction:
    """The step time and bytes of ``w`` on ``hw``; DoesNotFit names the tier that is short."""
    costs = [stage_cost(w, hw, s) for s in range(w.pp)]
    if check:
        for cost in costs:
            check_fits(w, hw, cost)
    slowest = max(costs, key=lambda c: c.time_s)
    step = one_f_one_b([_per_group(c, "forward", w.groups) for c in costs],
                       [_per_group(c, "backward", w.groups) for c in costs], w.groups)
    gpus = w.dp * w.tp * w.pp
    traffic = slowest.traffic
    by_kind: dict = {}
    for t in traffic.values():
        for kind, tiers in t.by_kind.items():
            for tier, (r, wr) in tiers.items():
                acc = by_kind.setdefault(kind, {}).setdefault(tier, [0, 0])
                acc[0] += r
                acc[1] += wr
    tiers = {}
    for tier in ("host", "nvme"):
        read = sum(t.tier(tier)[0] for t in traffic.values())
        written = sum(t.tier(tier)[1] for t in traffic.values())
        tiers[tier] = {"capacity": slowest.capacity[tier], "read": read, "written": written}
    tiers["device"] = {"capacity": slowest.capacity["device"], "read": 0, "written": 0}
    breakdown = {s: {k: v for k, v in slowest.sweeps[s].items()} for s in SWEEPS}
    breakdown["p2p_s"] = slowest.p2p_s
    breakdown["bubble_s"] = step - slowest.time_s
    return Prediction(
        step_time_s=step, tokens_per_s=w.tokens_per_step / step,
        mfu=w.model_flops / (step * gpus * hw.device_peak_tflops * 1e12),
        bubble_s=step - slowest.time_s, stages=costs, slowest=slowest.stage,
        breakdown=breakdown, bytes=tiers, bytes_by_kind=by_kind,
        drive_capacity_per_node=max(c.capacity["nvme"] for c in costs) * _gpus_on_a_node(w, hw))
