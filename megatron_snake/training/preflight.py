"""Pre-flight of an offloaded run, from the flags alone: the bytes each tier needs (the
compute device's working set, host memory, and drive space for weights, gradients, master
weights, moments, unit inputs and ``--save`` checkpoints), printed and checked before
anything is allocated. Arithmetic on the model's shapes: seconds for any model size.

The parameter counts are those of Megatron-Core's ``GPTModel`` with the local layer spec
(``get_gpt_layer_local_spec``), per unit of this rank's pipeline stage and tensor-parallel
shard. The tiers, pinned units, host buffers and drive plan are computed by the very
functions ``offloaded_state.build_offloaded_state`` runs on the built model, given
shape-only stand-ins for its flat layouts, so the two agree by construction.
"""

from __future__ import annotations

import contextlib

import os
import tempfile
from dataclasses import dataclass, replace

import torch

from megatron_snake.errors import UserError
from megatron_snake.optim import host_kernel
from megatron_snake.optim.dp_shards import DataParallel
from megatron_snake.optim.host_update import HostUpdate
from megatron_snake.optim.parts import part_bounds
from megatron_snake.optim.unit_params import SHARED
from megatron_snake.optim.precision import Precision
from megatron_snake.storage import directory
from megatron_snake.storage.errors import CapacityError, HostMemoryError
from megatron_snake.storage.host_heap import HEAP_RETAIN_BYTES, resident_bytes
from megatron_snake.storage.host_pool import (DEFAULT_BUFFER_BYTES, DEFAULT_POOL_CAP_BYTES,
                                              STAGING_BUFFERS, check_host_memory_limit,
                                              default_pool_bytes)
from megatron_snake.storage.sizes import mib, size
from megatron_snake.storage.store import host_buffers_for
from megatron_snake.storage.temp_dirs import sweep_dead_temp_offload_dirs
from megatron_snake.training.offloaded_state import (DevicePlan, HostBuffers, Speculation,
                                                     StateTiers,
                                                     backward_parts, check_host_memory,
                                                     checkpoint_bytes_per_step,
                                                     checkpoint_bytes_planned,
                                                     host_buffers_needed, host_room,
                                                     kept_state_room,
                                                     nvme_bytes, plan_speculation,
                                                     offload_dirs_for_rank,
                                                     optimizer_bytes_per_param,
                                                     resolve_state_tiers,
                                                     saves_to_offload_drive, plan_device,
                                                     unit_working_set_bytes, working_set_error,
                                                     working_set_parts)


# --- parameter counts ------------------------------------------------------------------

class ShapeError(UserError, ValueError):
    """A model shape the tensor-parallel size does not divide."""


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ShapeError(f"--tensor-model-parallel-size {parts} does not divide {what} "
                         f"({n}); Megatron-Core needs an even split")
    return n // parts


def layer_parameters(args, tp: int = 1) -> int:
    """One decoder layer of the local spec on one tensor-parallel rank: column-parallel
    weights and biases (QKV, fc1) and row-parallel weights (proj, fc2) are split over the
    ``tp`` ranks; row-parallel biases and the layer norms are whole on every rank."""
    h, heads, groups = args.hidden_size, args.num_attention_heads, args.num_query_groups
    kv = args.kv_channels or h // heads
    bias = not args.disable_bias_linear
    norm = h * (2 if args.normalization == "LayerNorm" else 1)   # weight (+ bias)
    qkv_out = _divide((heads + 2 * groups) * kv, tp, "the QKV projection's outputs")
    proj_in = _divide(heads * kv, tp, "the attention output projection's inputs")
    fc1_out = _divide(args.ffn_hidden_size * (2 if args.swiglu else 1), tp,
                      "--ffn-hidden-size (x2 with --swiglu)")
    fc2_in = _divide(args.ffn_hidden_size, tp, "--ffn-hidden-size")
    return (norm + qkv_out * h + (qkv_out if bias else 0) + h * proj_in + (h if bias else 0)
            + norm + fc1_out * h + (fc1_out if bias else 0) + h * fc2_in + (h if bias else 0))


def _embedding_parameters(args, vocab_size: int, tp: int = 1) -> tuple[int, int]:
    """(word embedding, learned position embedding) of one tensor-parallel rank."""
    word = _divide(vocab_size, tp, "the padded vocabulary") * args.hidden_size
    position = args.max_position_embeddings * args.hidden_size \
        if args.position_embedding_type == "learned_absolute" else 0
    return word, position


@dataclass(frozen=True)
class UnitCounts:
    """Parameters of one rank's pipeline stage and tensor-parallel shard, the way
    ``UnitParams.of(GPTUnits(gpt, --snake-checkpoint-interval))`` lays them out: ``units[u]``
    counts what unit ``u`` alone reads, ``shared`` what several units read (a tied
    embedding with one stage: the first and the last unit)."""

    units: tuple[int, ...]
    shared: int

    @property
    def total(self) -> int:
        """``sum(p.numel() for p in gpt.parameters())`` of this rank."""
        return sum(self.units) + self.shared


def gpt_parameter_counts(args, vocab_size: int, *, tp_rank: int = 0,
                         pp_rank: int = 0) -> UnitCounts:
    """Per-unit parameter counts of pipeline stage ``pp_rank``, tensor shard ``tp_rank``
    (every shard is the same size: Megatron splits evenly), as Megatron-Core builds them."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if not 0 <= tp_rank < tp or not 0 <= pp_rank < pp:
        raise ValueError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside TP {tp} x PP {pp}")
    first, last = pp_rank == 0, pp_rank == pp - 1
    layers = args.num_layers // pp
    interval = args.snake_checkpoint_interval
    per_layer = layer_parameters(args, tp)
    units = [per_layer * min(interval, layers - start) for start in range(0, layers, interval)]
    units = units or [0]
    word, position = _embedding_parameters(args, vocab_size, tp)
    tied = not args.untie_embeddings_and_output_weights
    shared = 0
    if first:
        units[0] += position
        if tied and last and len(units) > 1:
            shared = word        # read by the embedding (unit 0) and the head (the last)
        else:
            units[0] += word
    if last:
        units[-1] += args.hidden_size * (2 if args.normalization == "LayerNorm" else 1)
        if not tied or not first:
            # untied: its own output layer; tied over stages: the last stage's copy
            units[-1] += word
    return UnitCounts(tuple(units), shared)


def fp32_at_build(args, *, pp_rank: int = 0) -> int:
    """Parameters of stage ``pp_rank`` (any tensor shard) that Megatron-Core's local spec
    creates in fp32 whatever ``--bf16`` / ``--fp16`` say (torch's LayerNorm / RMSNorm and the
    learned position embedding take torch's default dtype), until ``Float16Module`` casts
    the model: what the initial weights spilled during the build hold in 4 bytes."""
    norm = args.hidden_size * (2 if args.normalization == "LayerNorm" else 1)
    count = 2 * norm * (args.num_layers // args.pipeline_model_parallel_size)
    if pp_rank == args.pipeline_model_parallel_size - 1:
        count += norm
    if pp_rank == 0:
        count += _embedding_parameters(args, 0)[1]
    return count


def gpt_parameter_total(args, vocab_size: int) -> int:
    """The whole model's parameters (all stages, unsharded; a tied embedding once)."""
    word, position = _embedding_parameters(args, vocab_size)
    norm = args.hidden_size * (2 if args.normalization == "LayerNorm" else 1)
    output = word if args.untie_embeddings_and_output_weights else 0
    return args.num_layers * layer_parameters(args) + word + position + norm + output


# --- shape-only stand-ins for UnitParams ---------------------------------------------

@dataclass(frozen=True)
class _Span:
    offset: int
    numel: int


@dataclass(frozen=True)
class _Layout:
    """What offloaded_state's planning functions read of a ``FlatLayout``: its size, and
    its segments (one spanning the unit: the flags do not give each parameter's offset,
    so the alpha split is placed within 16 elements of the run's)."""

    numel: int

    @property
    def segments(self) -> tuple:
        return (_Span(0, self.numel),) if self.numel else ()


@dataclass(frozen=True)
class _UnitParams:
    units: tuple[_Layout, ...]
    shared: _Layout


# --- the pre-flight --------------------------------------------------------------------

@dataclass(frozen=True)
class Preflight:
    """Bytes one rank's offloaded run needs per tier, from the flags. The drive figures
    are the start check's (``build_offloaded_state``): ``numel`` is this rank's share,
    ceil(parameters / data-parallel size), of every parameter of its stage and shard."""

    params_total: int            # the whole model (all stages, unsharded)
    counts: UnitCounts           # this rank's stage and tensor shard, per unit
    ranks: tuple                 # (tp, TP, pp, PP, dp, DP)
    elem: int                    # bytes per working weight: 2 with --bf16 / --fp16, else 4
    tiers: StateTiers            # weights and optimizer state, auto resolved
    unit_input_tier: str         # --snake-activation-tier
    # device
    working_set: int             # the largest unit's: what --snake-gpu-memory-limit must hold
    working_set_unit: int
    prefetch: int                # the next unit's weights, read while one computes
    pinned_units: tuple          # units kept on the device (--snake-gpu-memory-limit)
    pinned: int                  # their records' bytes
    device_unit_inputs: int      # the step's unit inputs when they may stay on the device
    # host
    pool_bytes: int              # --snake-host-memory-limit, or its default for this rank
    pool_buffers: int
    buffer_bytes: int
    host_buffers: HostBuffers    # pool buffers each part would hold on the host tier
    optimizer_update: int        # outside the pool: the update's loans (UpdateBytes)
    partial_gradients: int       # outside the pool: fp32 unit gradients between snake groups
    # drive
    nvme_weights: int
    nvme_optimizer: int          # master weights and two moments: 12 B per parameter in
                                 # fp32, each state in its dtype with the precision-aware
                                 # optimizer (2 B for the bf16 masters' remainders)
    nvme_gradients: int          # 4 B per parameter in fp32, 2 in bf16
    nvme_unit_inputs: int
    nvme_initial: int            # the initial weights: spilled while Megatron builds the model
                                 # (InitialWeights), held until the state is made from them
    checkpoints: int             # every --save checkpoint the run keeps (0 without --save)
    checkpoints_on: int | None   # the offload directory --save shares a file system with
                                 # (its index): they count there
    offload_paths: tuple         # the offload directories (this rank's), or the temporary one
    offload_dir_given: bool
    pool_why: str = "given by --snake-host-memory-limit"   # where pool_bytes comes from
    precision: Precision = Precision()   # the dtype each optimizer state is stored in
    # the layouts that speculate and the state they keep until each step's verdict: pool
    # buffers on the host tier; on the drive, as much as its free space leaves room for
    speculation: Speculation = Speculation()
    device_plan: DevicePlan = DevicePlan()   # the optimizer's share on the device
    # each offload directory's bytes of a killed run's swap files in rank<N>/, which the
    # store removes as it opens: counted as free (``run`` adds them to the free space)
    stale: tuple = ()
    rank: int = 0                # the global rank: its directory is rank<N>/
    update: object = None        # UpdateBytes: what optimizer_update counts
    # the process beyond --snake-host-memory-limit: what it holds when the pre-flight runs
    # (torch, Megatron, the process groups, pretrain's datasets), freed heap glibc may keep
    # for reuse, and on a CPU the device's working set
    base_rss: int = 0
    device_is_host: bool = False
    limit_given: int | None = None   # --snake-host-memory-limit when given

    @property
    def params_rank(self) -> int:
        return self.counts.total

    @property
    def device_bytes(self) -> int:
        return self.working_set + self.prefetch + self.pinned + self.device_unit_inputs + \
            self.device_plan.share_bytes

    def _on_host(self) -> list[tuple[str, int]]:
        h, t = self.host_buffers, self.tiers
        return [(name, n) for name, n, host in (
            ("weights", h.weights, t.params == "host"),
            ("optimizer state and gradients", h.optimizer, t.optimizer == "host"),
            ("unit inputs", h.unit_inputs, self.unit_input_tier == "host")) if host and n]

    @property
    def host_buffers_used(self) -> int:
        """Pool buffers the host tiers hold, and one always free for staging (the count
        ``check_host_memory`` compares with the pool)."""
        return sum(n for _, n in self._on_host()) + 1

    @property
    def speculation_line(self) -> str:
        s, t = self.speculation, self.tiers.optimizer
        if s.layouts and t == "host":
            return (f"> pre-flight {s.summary()}: {s.host_buffers} pool buffers of the host "
                    "tier's")
        if s.layouts:
            return (f"> pre-flight {s.summary()}: on the drive, as many layouts as its free "
                    "space leaves room for (checked at the start)")
        return f"> pre-flight {s.summary()}"

    @property
    def host_working_set(self) -> int:
        """What the run holds in host memory outside the pool: the update's loans and the
        partial gradients."""
        return self.optimizer_update + self.partial_gradients

    @property
    def host_limit(self) -> int:
        """What --snake-host-memory-limit bounds (its value, or the default's): the pool
        and what the run holds outside it."""
        return self.limit_given or self.pool_bytes + self.host_working_set

    @property
    def host_bytes(self) -> int:
        """The process's resident memory at its peak: the base measured at the pre-flight,
        the heap glibc may keep, the limit's, and a CPU device's working set (the
        activations inside a unit come on top). Within 15% of the OS's peak RSS (``tests/test_bigger_than_memory``)."""
        return self.base_rss + HEAP_RETAIN_BYTES + self.host_limit + \
            (self.device_bytes if self.device_is_host else 0)

    @property
    def checkpoints_on_drive(self) -> bool:
        return self.checkpoints_on is not None

    @property
    def drive_planned(self) -> int:
        """What the run places on the drives, all directories together."""
        return self.drive_striped + (self.checkpoints if self.checkpoints_on_drive else 0)

    @property
    def drive_striped(self) -> int:
        """What the store places on the drives, striped over the directories."""
        return self.nvme_weights + self.nvme_optimizer + self.nvme_gradients + \
            self.nvme_unit_inputs + self.nvme_initial

    @property
    def drive_needed(self) -> int:
        """Free space the offload directories ask for, together."""
        return sum(self.drive_needed_in(i) for i in range(len(self.offload_paths)))

    def drive_planned_in(self, i: int) -> int:
        """What directory ``i`` holds: the store's records are striped over the directories
        in equal shares (one segment more for the rounding: ``DriveTier._share``), and the
        --save checkpoints count where they are."""
        n = len(self.offload_paths)
        striped = self.drive_striped
        share = striped if n == 1 else -(-striped // n) + self.buffer_bytes
        return share + (self.checkpoints if self.checkpoints_on == i else 0)

    def drive_needed_in(self, i: int) -> int:
        """Free space directory ``i`` asks for (``RankDir.check_capacity``'s margin)."""
        planned = self.drive_planned_in(i)
        return int(planned * (1 + directory.MARGIN_FRACTION)) + directory.MARGIN_BYTES \
            if planned else 0

    def drive_label(self, i: int = 0) -> str:
        path = self.offload_paths[i]
        return (f"--snake-offload-dir {path}" if self.offload_dir_given else
                f"the temporary directory {path} (no --snake-offload-dir)")

    def drive_parts(self, i: int = 0) -> str:
        """What the run places on the drives; the --save checkpoints where directory ``i``
        holds them."""
        t = self.tiers
        p = self.precision
        masters = "master-weight remainders" if p.remainders else "master weights"
        grads = "fp32" if p.grad == torch.float32 else "bf16"
        parts = [f"weights {size(self.nvme_weights)}" if t.params == "nvme" else "",
                 f"{masters} + moments {size(self.nvme_optimizer)} ({p.state_bytes} B per "
                 f"parameter), {grads} gradients {size(self.nvme_gradients)}"
                 if t.optimizer == "nvme" else "",
                 f"unit inputs {size(self.nvme_unit_inputs)}" if self.nvme_unit_inputs else "",
                 f"initial weights while the state is built {size(self.nvme_initial)}"
                 if self.nvme_initial else "",
                 f"--save checkpoints {size(self.checkpoints)}"
                 if self.checkpoints_on == i else ""]
        return ", ".join(p for p in parts if p) or "nothing"

    def summary(self, frees: list | None = None) -> str:
        """Megatron-style start lines: the counts, then each tier's bytes, a line for each
        offload directory. ``frees``: the free bytes of each (None: not known)."""
        tp, TP, pp, PP, dp, DP = self.ranks
        shared = f" (of them {self.counts.shared:,} shared by the first and last: tied)" \
            if self.counts.shared else ""
        pinned = f"; pinned units {list(self.pinned_units)} {size(self.pinned)}" \
            if self.pinned_units else "; nothing pinned"
        if self.device_unit_inputs:
            pinned += f"; the step's unit inputs {size(self.device_unit_inputs)}" + \
                (" at most (auto)" if self.unit_input_tier == "auto" else "")
        outside = self.update.describe() if self.update is not None else \
            f"the optimizer's update {size(self.optimizer_update)}"
        if self.partial_gradients:
            outside += f", partial gradients of the snake groups {size(self.partial_gradients)}"
        frees = frees or [None] * len(self.offload_paths)
        return "\n".join([
            f"> pre-flight (from the flags, before anything is allocated): "
            f"{self.params_total:,} parameters ({_count(self.params_total)}); this rank "
            f"(tensor shard {tp + 1}/{TP}, pipeline stage {pp + 1}/{PP}, data-parallel "
            f"shard {dp + 1}/{DP}): {self.params_rank:,} parameters in "
            f"{len(self.counts.units)} unit(s){shared}, {self.elem}-byte working weights",
            f"> pre-flight device: {size(self.device_bytes)} (working set of unit "
            f"{self.working_set_unit} {size(self.working_set)}: "
            f"{working_set_parts(self.counts.shared > 0)}; the next unit "
            f"prefetched {size(self.prefetch)}{pinned}); activations inside a unit come on "
            "top",
            f"> pre-flight host: {size(self.host_bytes)} for the process: "
            f"{size(self.base_rss)} resident now, {size(HEAP_RETAIN_BYTES)} of freed heap "
            f"kept for reuse, the host limit {size(self.host_limit)} (pool "
            f"{size(self.pool_bytes)}: {self.pool_buffers} buffers of "
            f"{mib(self.buffer_bytes)}, the host tiers hold {self.host_buffers_used} ("
            + ", ".join([f"{name} {n}" for name, n in self._on_host()] + ["1 for staging"])
            + f"); outside the pool: {outside})"
            + (f", the device's {size(self.device_bytes)} (the CPU's memory)"
               if self.device_is_host else "")
            + f"; the pool is {self.pool_why}",
            *([self.precision.summary()] if self.precision != Precision(
                params=self.precision.params) else []),
            self.speculation_line,
            *([f"> pre-flight {self.device_plan.summary()}"] if self.device_plan.summary()
              else []),
            *(self._drive_line(i, free) for i, free in enumerate(frees)),
        ])

    def stale_in(self, i: int) -> int:
        return self.stale[i] if i < len(self.stale) else 0

    def free_text(self, i: int, free: int) -> str:
        """``free`` bytes of directory ``i``'s drive, in words: with the part a killed
        run's files hold, which the run removes first."""
        stale = self.stale_in(i)
        return f"{size(free)}" + (
            f" (with the {size(stale)} of swap files a killed run left in "
            f"{os.path.join(self.offload_paths[i], f'rank{self.rank}')}, which this run "
            "removes first)" if stale else "")

    def _drive_line(self, i: int, free: int | None) -> str:
        t, n = self.tiers, len(self.offload_paths)
        free = "" if free is None else f", {self.free_text(i, free)} free"
        saved = ""
        if self.checkpoints and not self.checkpoints_on_drive:
            saved = f"; --save checkpoints {size(self.checkpoints)} on another drive"
        which, share = "", ""
        if n > 1:
            which = f" {i + 1} of {n}"
            share = f"a 1/{n} share of the striped {size(self.drive_striped)}: "
            if self.checkpoints_on_drive and self.checkpoints_on != i:
                saved = ""
        return (f"> pre-flight drive{which}, {self.drive_label(i)}: "
                f"{size(self.drive_planned_in(i))} planned ({share}{self.drive_parts(i)}; "
                f"weights on {t.params}, optimizer state on {t.optimizer}, unit inputs on "
                f"{self.unit_input_tier}){saved}; {size(self.drive_needed_in(i))} needed "
                f"with the {directory.MARGIN_FRACTION:.0%} + {directory.MARGIN_BYTES >> 20} "
                f"MiB margin{free}")


def host_pool_default(args, need: HostBuffers, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                      kept: int = 0) -> tuple[int, str]:
    """``--snake-host-memory-limit``'s default for this rank, and why, in words:
    ``host_pool.default_pool_bytes`` of the buffers its state may hold in host memory:
    the weights, the optimizer state and gradients and the step's unit inputs, whichever
    tier they are on (the host tiers hold them; from the drive tiers the gradients
    waiting for their update, the optimizer state read ahead and the weights read next
    spill to host memory when there is room); under ``--snake-activation-tier auto`` at
    least twice the unit inputs (its plan may use half the pool). With
    ``--snake-param-tier`` / ``--snake-optimizer-tier auto``, at least four times what
    they put on the host with the largest pool, so that the smaller pool makes the same
    choice (a quarter of the pool: ``resolve_state_tiers``). The cap when saved tensors
    go to the host tier: their size is known only while running. ``kept``: the buffers of
    the state speculative updates keep, when the optimizer state is on the host tier."""
    cap = DEFAULT_POOL_CAP_BYTES
    cap_text = "the default's cap (without --snake-host-memory-limit)"
    if args.snake_activation_offload and args.snake_activation_tier == "host":
        return cap, f"{cap_text}: saved tensors on the host tier are sized while running"
    state = need.weights + need.optimizer + need.unit_inputs + kept
    what = (f"room for this rank's state, {state} buffers (weights {need.weights}, "
            f"optimizer state and gradients {need.optimizer}, unit inputs "
            f"{need.unit_inputs}" + (f", speculative updates' kept state {kept}" if kept
                                     else "") + f"), and {STAGING_BUFFERS} for staging")
    if args.snake_activation_tier == "auto" and 2 * need.unit_inputs > state:
        state = 2 * need.unit_inputs
        what = (f"twice the {need.unit_inputs} buffers of unit inputs (the auto plan may "
                f"use half the pool), and {STAGING_BUFFERS} for staging")
    pool = default_pool_bytes(state, buffer_bytes)
    if "auto" in (args.snake_param_tier, args.snake_optimizer_tier):
        largest = resolve_state_tiers(args, need, cap // buffer_bytes)
        if resolve_state_tiers(args, need, pool // buffer_bytes) != largest:
            on_host = (need.weights if largest.params == "host" else 0) + \
                (need.optimizer if largest.optimizer == "host" else 0)
            pool = default_pool_bytes(4 * on_host, buffer_bytes)
            what = (f"4 x the {on_host} buffers the auto tiers put on the host (they take "
                    f"a quarter of the pool), and {STAGING_BUFFERS} for staging")
            if resolve_state_tiers(args, need, pool // buffer_bytes) != largest:
                return cap, f"{cap_text}: the auto tiers choose within it"
    if pool >= cap:
        return cap, f"{cap_text}: {what} would be more"
    return pool, f"the default without --snake-host-memory-limit: {what}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.2f}M"


def offload_paths(args, rank: int = 0) -> list[str]:
    """The directories the store will use: ``--snake-offload-dir``'s for this rank, or the
    directory temporary ones are made in."""
    if args.snake_offload_dir:
        return [os.path.abspath(p) for p in offload_dirs_for_rank(args.snake_offload_dir, rank)]
    return [tempfile.gettempdir()]


def drive_free_bytes(path: str) -> int | None:
    """Free bytes of the file system of ``path`` (None when it does not exist: the store
    then refuses it with its own error)."""
    return directory.disk_free_bytes(path) if os.path.isdir(path) else None


def estimate(args, vocab_size: int, *, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int = 0,
             rank: int = 0, base_rss: int | None = None) -> Preflight:
    """This rank's pre-flight from validated flags (``--snake-offload``) and the padded
    vocabulary: arithmetic only, plus a stat of the offload directory for ``--save`` and
    this process's resident memory now (``base_rss``: given instead)."""
    counts = gpt_parameter_counts(args, vocab_size, tp_rank=tp_rank, pp_rank=pp_rank)
    params = _UnitParams(tuple(_Layout(n) for n in counts.units), _Layout(counts.shared))
    dp = DataParallel(dp_rank, args.data_parallel_size)
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    working_set, unit = unit_working_set_bytes(args, params)
    device = plan_device(args, params, dp.size)
    pinned = list(device.pinned)
    need = host_buffers_needed(args, params, dp, pinned, host_buffers_for, device.share)
    precision = Precision.from_args(args)
    groups = args.num_microbatches // (1 if args.snake_schedule == "horizontal"
                                       else args.snake_group_size or args.num_microbatches)
    # outside the pool: the update's loans (a part's state and gradient as copies, the
    # next part's read ahead) and the snake groups' partial gradients
    update = UpdateBytes.of(args, precision, params, dp, device.share)
    partial = 4 * sum(counts.units) if groups > 1 else 0
    pool_bytes, pool_why = args.snake_host_memory_limit, "given by --snake-host-memory-limit"
    if getattr(args, "snake_host_pool_default", False):   # the flag was not given
        kept = plan_speculation(args, backward_parts(args, params, dp, device.share), "host",
                                host_buffers_for).host_buffers \
            if args.snake_optimizer_tier == "host" else 0
        pool_bytes, pool_why = host_pool_default(args, need, kept=kept)
    else:   # the flag bounds all of it: the pool is what the rest leaves
        limit = given_host_limit(args)
        # (a pool too small is refused by check, with the other tiers: short_of_pool)
        pool_bytes = max(pool_left(limit, update, partial), 2 * DEFAULT_BUFFER_BYTES)
        pool_why = (f"what --snake-host-memory-limit {size(limit)} leaves after what the "
                    "run holds outside the pool")
    pool_buffers = check_host_memory_limit(pool_bytes, DEFAULT_BUFFER_BYTES)
    tiers = resolve_state_tiers(args, need, pool_buffers)
    numel = -(-counts.total // dp.size)
    ckpt = checkpoint_bytes_per_step(args)
    paths = offload_paths(args, rank)
    off_device = numel - sum(-(-counts.units[u] // dp.size) for u in device.share)
    planned = nvme_bytes(args, tiers, numel * elem,
                         optimizer_bytes_per_param(args) * off_device)
    pf_parts = dict(
        nvme_weights=numel * elem if tiers.params == "nvme" else 0,
        nvme_optimizer=precision.state_bytes * off_device if tiers.optimizer == "nvme" else 0,
        nvme_gradients=precision.grad_bytes * off_device if tiers.optimizer == "nvme" else 0,
        nvme_unit_inputs=ckpt if args.snake_activation_tier in ("nvme", "auto") else 0)
    assert sum(pf_parts.values()) == planned, (pf_parts, planned)
    # build_run builds the model through InitialWeights (tier nvme): every parameter of
    # this rank, in the dtype Megatron creates it in, is on the drive until the state is
    # built from it
    fp32 = fp32_at_build(args, pp_rank=pp_rank)
    pf_parts["nvme_initial"] = (counts.total - fp32) * elem + fp32 * 4
    parts = [part_bounds(lay, args.snake_alpha, dp) for lay in params.units]
    speculation = plan_speculation(
        args, backward_parts(args, params, dp, device.share), tiers.optimizer,
        host_buffers_for,
        host_room=kept_state_room(pool_buffers, host_room(args, tiers, need,
                                                          pool_buffers).planned))
    return Preflight(
        params_total=gpt_parameter_total(args, vocab_size), counts=counts,
        ranks=(tp_rank, args.tensor_model_parallel_size, pp_rank,
               args.pipeline_model_parallel_size, dp_rank, dp.size),
        elem=elem, tiers=tiers, unit_input_tier=args.snake_activation_tier,
        working_set=working_set, working_set_unit=unit,
        prefetch=max(counts.units) * elem, pinned_units=tuple(pinned),
        pinned=sum(hi - lo for u in pinned for lo, hi in parts[u]) * elem,
        device_unit_inputs=ckpt if args.snake_activation_tier in ("device", "auto") else 0,
        pool_bytes=pool_bytes, pool_buffers=pool_buffers, pool_why=pool_why,
        buffer_bytes=DEFAULT_BUFFER_BYTES, host_buffers=need,
        optimizer_update=update.nbytes, update=update, partial_gradients=partial,
        base_rss=resident_bytes() if base_rss is None else base_rss,
        device_is_host=_device_is_host(args),
        limit_given=None if getattr(args, "snake_host_pool_default", False)
        else given_host_limit(args),
        **pf_parts,
        checkpoints=checkpoint_bytes_planned(args, counts.total * elem,
                                             precision.checkpoint_bytes * numel)
        if args.save else 0,
        checkpoints_on=next((i for i, path in enumerate(paths) if os.path.isdir(path)
                             and saves_to_offload_drive(args, path)), None),
        offload_paths=tuple(paths), offload_dir_given=bool(args.snake_offload_dir),
        precision=precision, speculation=speculation, device_plan=device, rank=rank)


@dataclass(frozen=True)
class UpdateBytes:
    """Host memory the optimizer's update holds outside the pool at most, as it works
    today (``optim/update_worker.py``). A part's update borrows its master weights, moments
    and gradient (and, under remainders, its working weights) as copies when the pool has
    no room for them (``loans`` bytes per element), writes a speculative update's new state
    into copies of its own and publishes its new working weights as a converted copy
    (``running`` on top); as it starts, the loans of the part submitted after it are read.
    So: the most any part in the order of a step's updates (the backward sweep's parts,
    units U-1 to 0, then the forward sweep's, 0 to U-1) holds with the next one's loans,
    and the torch path's fp32 scratch (the native kernel's update has none). The units
    of the device share are updated on the device, on loans there.
    ``tools/bench_update_memory.py`` measures it against the OS's RSS."""

    largest: int = 0         # elements of the part at that most
    next: int = 0            # of the part read ahead meanwhile
    where: str = ""          # the layout of the first, in words
    loans: int = 0           # bytes per element a part's loans take
    running: int = 0         # bytes per element of a running part on top of its loans
    scratch: int = 0

    @classmethod
    def of(cls, args, precision: Precision, params, dp: DataParallel,
           share=()) -> "UpdateBytes":
        owned = [[] if u in share else [(u, lay)] for u, lay in enumerate(params.units)]
        if params.shared.numel and owned:   # updated with the first unit that reads it
            owned[0].append((SHARED, params.shared))
        bounds = [[(key, part_bounds(lay, args.snake_alpha, dp)) for key, lay in layouts]
                  for layouts in owned]
        order = [(key, hi - lo, True) for layouts in reversed(bounds)
                 for key, ((lo, hi), _) in layouts] + \
                [(key, hi - lo, False) for layouts in bounds for key, (_, (lo, hi)) in layouts]
        order = [item for item in order if item[1]]
        if not order:
            return cls()
        speculates = bool(plan_speculation(args, [1], "nvme", host_buffers_for).layouts)
        weights = torch.tensor([], dtype=precision.params).element_size()
        in_place = args.snake_optimizer_tier == "host"   # lent from the pool's own buffers
        loans = (0 if in_place else precision.state_bytes + precision.grad_bytes) + \
            (weights if precision.remainders else 0)
        published = weights * (2 if precision.master == torch.float16 else 1)
        outs = 0 if in_place else precision.state_bytes + \
            (weights if precision.remainders else 0)

        def held(i):
            key, n, backward = order[i]
            nxt = order[(i + 1) % len(order)][1] if len(order) > 1 else 0
            running = published + (outs if backward and speculates else 0)
            return (loans + running) * n + loans * nxt, key, n, nxt, running

        _, key, n, nxt, running = max(held(i) for i in range(len(order)))
        where = "the tied embedding" if key == SHARED else f"unit {key}"
        return cls(n, nxt, where, loans, running,
                   0 if host_kernel.implementation().startswith("native")
                   else HostUpdate.scratch_bytes())

    @property
    def nbytes(self) -> int:
        return (self.loans + self.running) * self.largest + self.loans * self.next + \
            self.scratch

    def describe(self) -> str:
        return (f"the optimizer's update {size(self.nbytes)} (a part of "
                f"{_count(self.largest)} elements of {self.where} as copies at "
                f"{self.loans + self.running} B each, and the next part's loans)")


def pool_left(limit: int, update: UpdateBytes, partial: int) -> int:
    """The host pool ``--snake-host-memory-limit`` leaves after what the run holds outside
    it: the update's loans (``update``) and the snake groups' ``partial`` gradients, in
    whole buffers (fewer than the 2 a pool needs: ``short_of_pool`` says so). (The sources
    of puts queued for the drive are the device's gradients and the update's loans on
    their way back: counted there.)"""
    return (limit - update.nbytes - partial) // DEFAULT_BUFFER_BYTES * DEFAULT_BUFFER_BYTES


def least_host_limit_mib(pf: "Preflight") -> int:
    """The least --snake-host-memory-limit, in MiB, that the run takes: what it holds in
    host memory outside its pool and a pool of 2 buffers."""
    return -(-(pf.host_working_set + 2 * DEFAULT_BUFFER_BYTES) >> 20)   # rounded up


def short_of_pool(pf: "Preflight") -> HostMemoryError | None:
    """The refusal of a --snake-host-memory-limit that leaves the pool fewer than 2
    buffers after what the run holds outside it, naming the flag and the least it takes;
    None when it does not."""
    if pf.limit_given is None or pool_left(pf.limit_given, pf.update, pf.partial_gradients) \
            >= 2 * DEFAULT_BUFFER_BYTES:
        return None
    least = least_host_limit_mib(pf)
    partial = f" and {size(pf.partial_gradients)} of partial gradients" \
        if pf.partial_gradients else ""
    return HostMemoryError(
        f"--snake-host-memory-limit {size(pf.limit_given)} cannot hold what the run keeps in "
        f"host memory outside its pool, {pf.update.describe()}{partial}, and a pool of 2 "
        f"buffers of {mib(DEFAULT_BUFFER_BYTES)}: give at least --snake-host-memory-limit "
        f"{least}MiB (or make the largest part smaller: --snake-checkpoint-interval, "
        "--snake-alpha)")


def given_host_limit(args) -> int:
    """--snake-host-memory-limit as given (``run`` puts the pool in its place for the
    store, and keeps the flag's value beside it)."""
    return getattr(args, "snake_host_limit_given", None) or args.snake_host_memory_limit


def _device_is_host(args) -> bool:
    """Whether the compute device is the CPU: then its working set is host memory too."""
    return getattr(args, "device", "auto") == "cpu" or not torch.cuda.is_available()


def check(preflight: Preflight, args, frees: list | None) -> None:
    """Refuse a plan a tier cannot hold, before anything is allocated: one error naming
    the flag to change and the amount (the first tier's type when several fail, with every
    message). ``frees``: each offload directory's free space (None, or None in it: not
    checked)."""
    pf, errors = preflight, []
    limit = args.snake_gpu_memory_limit
    if limit is not None and limit < pf.working_set:
        errors.append(working_set_error(limit, pf.working_set, pf.working_set_unit,
                                        tied=pf.counts.shared > 0))
    try:
        short = short_of_pool(pf)
        if short is not None:
            raise short
        check_host_memory(args, pf.tiers, pf.host_buffers, pf.pool_buffers, pf.buffer_bytes,
                          limit=pf.limit_given,
                          outside=pf.optimizer_update + pf.partial_gradients)
    except HostMemoryError as exc:
        errors.append(exc)
    n = len(pf.offload_paths)
    # directories on one file system share its free space: checked once, together, as
    # the first of them
    for group in directory.file_system_groups(pf.offload_paths) if frees else ():
        i = group[0]
        free = frees[i] if frees[i] is None else \
            frees[i] + sum(pf.stale_in(j) for j in group[1:])
        need = sum(pf.drive_needed_in(j) for j in group)
        if free is None or need <= free:
            continue
        where, share = ("in all", "") if n == 1 else \
            ("there", f"a 1/{n} share of the striped {size(pf.drive_striped)}: ")
        if len(group) > 1:
            where = "on its file system, with " + ", ".join(
                f"{pf.offload_paths[j]}'s {size(pf.drive_needed_in(j))}" for j in group[1:])
        message = (
            f"{pf.drive_label(i)}: the run needs {size(need)} of drive space {where} "
            f"({size(pf.drive_planned_in(i))} planned: {share}{pf.drive_parts(i)}; with the "
            f"{directory.MARGIN_FRACTION:.0%} + {directory.MARGIN_BYTES >> 20} MiB margin), "
            f"{pf.free_text(i, free)} is free: free {size(need - free)} more, "
            "or point --snake-offload-dir at a larger drive.")
        if pf.checkpoints_on == i:
            message += (f" (This counts {size(pf.checkpoints)} of --save checkpoints on the "
                        "same file system: every saved iteration is kept; raise "
                        "--save-interval or save to another drive.)")
        errors.append(CapacityError(message))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise type(errors[0])("; ".join(str(e) for e in errors))


class DoesNotFitError(UserError, ValueError):
    """--snake-dry-run's answer when the run as planned does not fit."""


@contextlib.contextmanager
def dry_run_verdict(args, log=print):
    """Around the pre-flight: with --snake-dry-run a refusal is the dry run's answer, "does
    not fit: ..." (after the report was printed), and a pass says that it fits."""
    try:
        yield
    except UserError as exc:
        if not args.snake_dry_run:
            raise
        raise DoesNotFitError(f"does not fit: {exc}") from exc
    if args.snake_dry_run:
        log("> --snake-dry-run: the run fits; nothing was built")


def run(args, vocab_size: int, *, rank: int = 0, log=print) -> Preflight:
    """``pretrain``'s pre-flight, after the process groups and before the model: this
    rank's figures, printed (by ``log``), then refused together on every rank when a tier
    does not fit."""
    from megatron.core import parallel_state

    from megatron_snake.training import distributed

    error, pf = None, None
    try:
        pf = estimate(args, vocab_size, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                      pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                      dp_rank=parallel_state.get_data_parallel_rank(), rank=rank)
        # the pool (the default's, sized to this rank, or what the flag leaves) is what
        # the store is made with
        args.snake_host_limit_given = pf.limit_given
        args.snake_host_memory_limit = pf.pool_bytes
        if not args.snake_offload_dir:   # killed runs' leftovers are not counted as used
            sweep_dead_temp_offload_dirs()
        # a killed run's swap files in this rank's directory are removed before the store
        # plans: their space is free for this run
        stale = tuple(directory.stale_bytes(path, rank) if pf.offload_dir_given else 0
                      for path in pf.offload_paths)
        pf = replace(pf, stale=stale)
        frees = [None if free is None else free + extra
                 for free, extra in zip(map(drive_free_bytes, pf.offload_paths), stale)]
        log(pf.summary(frees))
        check(pf, args, frees)
    except (OSError, ValueError, RuntimeError) as exc:
        error = exc
    distributed.raise_unless_all_ranks_ok(error, "pre-flight of the offloaded run")
    return pf
