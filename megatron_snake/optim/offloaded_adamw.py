"""AdamW with its state offloaded per unit, stepped unit by unit, overlapped with compute.

Every flat layout (a unit's parameters, or the shared ones) keeps its fp32 master weights
and both moments in the tensor store, cut at ``split = (1 - alpha) * numel`` into a
*backward part* and a *forward part*, each its own record. When a unit's gradient is final
in the backward sweep, the backward part is updated at once on a CPU worker thread while
the GPU goes on with the next unit; the forward part waits for the next forward sweep and is
applied, one unit ahead of compute, before the unit's weights are read. With gradient
clipping on, no part can run before the global gradient norm is known at the step
boundary, so both parts run in the next forward sweep. Either way every unit is updated
before its next read (no staleness) and each state byte is read and written once per step.

The arithmetic is torch's fused AdamW kernel (the one ``torch.optim.AdamW(fused=True)``
runs) on views of the state's host buffers, borrowed from the store (no copy): one view per
parameter and buffer. The kernel is elementwise, but it rounds a tensor's last (numel mod
its vector lanes) elements on a scalar path, so where a buffer's edge cuts a parameter off
its 16-element lines, those elements are gathered into a small tensor of their own (a
bridge), and the alpha split is moved onto a line, so every bit equals the per-parameter
reference (docs/design.md, invariant 1). Weight decay follows Megatron
(none on biases and 1-D parameters); ``param_groups`` lets Megatron's
OptimizerParamScheduler set lr and wd.

With Megatron-Core's precision-aware optimizer (``precision``: ``optim/precision.py``) each
state is stored and moved in its own dtype (the master weights as bf16-weight remainders, in
fp16, or fp32; the moments in fp32, bf16, fp16 or fp8; the gradient in fp32 or bf16). The
update then loads a chunk of each state into fp32 scratch buffers, runs the same fused AdamW
kernel on them, parameter piece by parameter piece (cut at 16-element lines, so every bit is
the kernel's on the whole piece), and rounds the results back to their dtypes by Transformer
Engine's rules. With every state in fp32 it runs on the stored bytes in place, as before.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_snake.errors import FlagError
import megatron_snake.emulated_device as emulated_device
import megatron_snake.timeline as timeline
from megatron_snake.optim.adamw import (STATES, HostAdamW, check_clip_grad, clip_coefficient,
                                        fused_adamw_, megatron_param_groups)
from megatron_snake.optim.cpu_threads import budgeted_worker, check_optimizer_threads
from megatron_snake.optim.dp_shards import DataParallel, all_reduce_on_backend
from megatron_snake.optim.precision import (E4M3, FP8, REMAINDER, SCALED, Precision, dequantize,
                                            join_flat, join_master, quantize, scale_for,
                                            split_flat, split_master)
from megatron_snake.optim.unit_params import FlatLayout, UnitParams

PARTS = ("bwd", "fwd")
UPDATE_PHASES = ("read", "clip", "adamw", "weights")

# torch's CPU fused AdamW runs a tensor in vector lanes from its first element, and its last
# (numel mod the lane count) elements on a scalar path whose rounding can differ by an ulp.
# The reference (one tensor per parameter) has lanes wherever a parameter is not at its
# end, so a cut that takes a parameter off its 16-element lines is avoided (the alpha
# split) or bridged (a host buffer's edge).
LANE_ELEMENTS = 16
# Elements per fp32 scratch batch of the chunked (precision-aware) update: a multiple of
# LANE_ELEMENTS, so a piece cut into chunks is rounded as the whole piece. 2^18 (four fp32
# buffers of 1 MiB) was the fastest of 2^16 to 2^21 on the CPU machine (tools/
# bench_optimizer_rate.py --chunk-elements): smaller batches pay each torch op's fixed cost
# more often, larger ones fall out of the cache.
CHUNK_ELEMENTS = 1 << 18


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


def check_alpha(alpha: float) -> None:
    """``--snake-alpha``: the deferred (forward) part of each update, 0 to 0.5 of it (the
    flag check and ``OffloadedAdamW`` both call this)."""
    if not 0.0 <= alpha <= 0.5:
        raise FlagError(f"--snake-alpha must be between 0 and 0.5, got {alpha}")


@dataclass(frozen=True)
class StepHyper:
    """What one step's update of every part uses, fixed when the step's first gradient is
    final (the scheduler moves lr only after the step)."""

    step: int
    lr: float
    weight_decay: float


def _intervals(sizes: list[int], ranges: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The element ``ranges`` (start, stop, start of their parameter) of a concatenation of
    pieces of ``sizes``, cut where the pieces are; a cut off the parameter's 16-element
    lines becomes one interval from the line before it to the line after (a bridge)."""
    cuts = list(itertools.accumulate(sizes))[:-1]
    out = []
    for start, stop, origin in ranges:
        pos = start
        for cut in cuts:
            if not pos < cut < stop:
                continue
            off = (cut - origin) % LANE_ELEMENTS
            down, up = max(pos, cut - off), min(stop, cut - off + LANE_ELEMENTS)
            if off == 0:
                down = up = cut
            if pos < down:
                out.append((pos, down))
            if down < up:
                out.append((down, up))
            pos = max(pos, up)
        if pos < stop:
            out.append((pos, stop))
    return out


def _take(pieces: list[torch.Tensor], intervals: list[tuple[int, int]]):
    """(tensors, bridges): each interval of the concatenation of ``pieces`` as a view of
    one piece, or, across pieces, gathered into a new tensor; ``bridges`` lists those as
    (tensor, [(piece view, its slice of the tensor)]) for ``_return_bridges``."""
    starts = list(itertools.accumulate([0] + [p.numel() for p in pieces]))
    tensors, bridges = [], []
    for a, b in intervals:
        parts = [(p[max(a, s) - s:min(b, e) - s], slice(max(a, s) - a, min(b, e) - a))
                 for p, s, e in zip(pieces, starts, starts[1:]) if s < b and a < e]
        if len(parts) == 1:
            tensors.append(parts[0][0])
        else:
            bridge = torch.cat([view for view, _ in parts])
            tensors.append(bridge)
            bridges.append((bridge, parts))
    return tensors, bridges


def _return_bridges(bridges) -> None:
    for bridge, parts in bridges:
        for view, piece in parts:
            view.copy_(bridge[piece])


class _Flat:
    """Element access to a record lent as 1-D pieces (cut where its host buffers end: records
    of other dtypes are cut at other elements). fp8 records are uint8 bytes read as E4M3."""

    def __init__(self, pieces: list[torch.Tensor]):
        self.pieces = [p for p in pieces if p.numel()]
        self.starts = list(itertools.accumulate([0] + [p.numel() for p in self.pieces]))

    def spans(self, a: int, b: int):
        """(view of a piece, its offset from ``a``) covering elements [a, b)."""
        i = bisect.bisect_right(self.starts, a) - 1
        pos = a
        while pos < b:
            piece, start = self.pieces[i], self.starts[i]
            end = min(b, start + piece.numel())
            yield piece[pos - start:end - start], pos - a
            pos, i = end, i + 1

    def view(self, a: int, b: int) -> torch.Tensor | None:
        """Elements [a, b) as one view, when one piece holds them."""
        spans = list(self.spans(a, b))
        return spans[0][0] if len(spans) == 1 else None

    def read(self, a: int, b: int, out: torch.Tensor, fp8: bool = False) -> None:
        """Elements [a, b) into ``out``, converted to its dtype."""
        for view, off in self.spans(a, b):
            out[off:off + view.numel()].copy_(view.view(E4M3) if fp8 else view)

    def write(self, a: int, b: int, src: torch.Tensor) -> None:
        """``src`` (the record's dtype) into elements [a, b)."""
        for view, off in self.spans(a, b):
            view.copy_(src[off:off + view.numel()])


class OffloadedAdamW(HostAdamW):
    def __init__(self, unit_params: UnitParams, store, *, lr: float, weight_decay: float,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 clip_grad: float = 0.0, alpha: float = 0.0, tier: str = "nvme",
                 on_weights=None, dp: DataParallel = DataParallel(), grad_scaler=None,
                 model_parallel_group=None, embedding_group=None, initial=None,
                 precision: Precision | None = None, weight_records: bool = True,
                 threads: int | None = None):
        """``initial``: where the parameters' values are when they are not in memory
        (``offload.initial_weights.InitialWeights``); by default they are read from the
        parameters. ``precision``: the dtype each state is stored in (default: every one
        fp32). With master-weight remainders the master's high half is the working-weight
        record ``("w", key, part)``: the update reads it and replaces it (``on_weights``, or
        itself without one); ``weight_records``: write every layout's first one here
        (``OffloadedUnits`` writes them itself). ``threads``: the update's CPU threads
        (default: ``cpu_threads.default_optimizer_threads``)."""
        check_alpha(alpha)
        check_clip_grad(clip_grad)
        self.layouts = {lay.key: lay for lay in unit_params.all_layouts()}
        self.store, self.tier = store, tier
        self.precision = precision or Precision()
        # (state, key, part) -> the multiplier of each parameter piece of a scaled record
        # (fp16, fp8): Transformer Engine's per-tensor scale
        self._scales: dict = {}
        self._piece_cache: dict = {}
        self._scratch: dict | None = None   # the chunked update's fp32 buffers (worker)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.clip_grad, self.alpha, self.dp = clip_grad, alpha, dp
        # Under TP / PP the norm and the overflow flag are reduced over the model-parallel
        # group too, and a parameter every TP rank holds whole counts once (Megatron's rule).
        self.model_parallel_group = model_parallel_group
        self._in_norm = {seg.index for lay in self.layouts.values() for seg in lay.segments
                         if param_is_not_shared(seg.param) and (
                             model_parallel_group is None
                             or param_is_not_tensor_parallel_duplicate(seg.param))}
        # A tied embedding across pipeline stages: the first stage's embedding and the last
        # stage's output weight are two copies whose gradients Megatron sums over its
        # embedding group; their layouts wait for that sum until the step boundary.
        self.embedding_group = embedding_group
        self._tied = {key: [seg for seg in lay.segments
                            if getattr(seg.param, "shared_embedding", False)]
                      for key, lay in self.layouts.items()} if embedding_group is not None else {}
        self._tied = {key: segs for key, segs in self._tied.items() if segs}
        self._tied_pending: list = []  # [(key, flat gradient, all-reduce handles)]
        # fp16: Megatron's loss scaler. Gradients arrive scaled, and whether any of them
        # overflowed is known only at the step boundary, so every update waits for it.
        self.grad_scaler = grad_scaler
        self._found_inf = None       # this step's overflow flag, on the gradients' device
        self._inv_scale = 1.0
        self._read_loss_scale()
        # Called with (layout key, part, new master weights as 1-D pieces, soon) after each
        # part's update; soon: the weights are read next in this sweep (a deferred part),
        # not a sweep later.
        self.on_weights = on_weights
        self.param_groups = megatron_param_groups(lr, weight_decay)
        self.iteration = 0           # completed steps
        self._hyper: StepHyper | None = None
        self._norms: dict[int, torch.Tensor] = {}  # parameter index -> its gradient's norm
        self._clip_coef: torch.Tensor | None = None
        self._deferred: dict = {}    # (key, part) -> StepHyper, waiting for the next forward
        self._running: dict = {}     # (key, part) -> Future on the worker
        self._reducing: list = []    # [(key, PendingShard)]: reduce-scatters in flight
        self.collective_log: list = []  # this step's ("launch"|"wait", key), in order
        # Seconds the worker spent updating, and seconds the caller waited for an update it
        # needed: 1 - blocked_s / update_s of the step is hidden behind compute.
        self.update_s = self.blocked_s = 0.0
        # update_s by phase (the worker's; a phase is added as it ends, update_s as the
        # whole update does): waiting for the state's reads, the clip, the fused AdamW (in
        # the chunked update also its loads, clip and roundings: its clip is 0), the
        # gradient dropped and the new weights handed on (converted and put: on_weights)
        self.update_phase_s = dict.fromkeys(UPDATE_PHASES, 0.0)
        self._read_ahead: list = []     # handles of the state read ahead last
        self._read_ahead_keys: list = []  # every record read ahead this step
        self._read_ahead_next = 0       # position in the forward order, this step
        self._read_ahead_order = None   # that order while the backward sweep reads ahead
        self._read_ahead_lock = threading.Lock()   # the chain runs on the store's workers
        self._device_gradients: list = []  # puts of the last gradient still on the device
        self._queued: list = []         # submitted updates not yet started, in order
        self._lock = threading.Lock()
        self.threads = check_optimizer_threads(threads)
        self._worker = budgeted_worker(self.threads, "snake-adamw")
        previous: list = []
        for key, lay in self.layouts.items():
            master = initial.flat(lay, dtype=torch.float32) if initial is not None else \
                lay.gather(device="cpu", dtype=torch.float32)  # the full flat
            writes = []
            for part, (lo, hi) in zip(PARTS, self._bounds(lay)):
                writes += self._initial_writes(key, part, master[lo:hi], weight_records)
            for write in previous:   # at most two layouts' values in memory at once
                write.wait()
            previous = writes
        self.store.synchronize()

    def _initial_writes(self, key, part: str, master: torch.Tensor,
                        weight_records: bool) -> list:
        """A fresh part's records: its master weights (fp32 here) in their stored form and
        zero moments (Transformer Engine starts a scaled state at zero with scale 1)."""
        p, n = self.precision, master.numel()
        writes = []
        if p.remainders:
            hi, rem = split_flat(master)
            writes.append(self.store.put(("master", key, part), rem, tier=self.tier,
                                         kind="optim"))
            if weight_records:
                writes.append(self.store.put(("w", key, part), hi, tier=self.tier,
                                             kind="weights"))
        else:
            writes.append(self.store.put(("master", key, part),
                                         self._encode("master", key, part, master),
                                         tier=self.tier, kind="optim"))
        for name in ("exp_avg", "exp_avg_sq"):
            dtype = p.dtype(name)
            if dtype in SCALED:
                self._scales[(name, key, part)] = [1.0] * len(self._pieces(key, part))
            writes.append(self.store.put((name, key, part), torch.zeros(n, dtype=dtype),
                                         tier=self.tier, kind="optim"))
        return writes

    def _pieces(self, key, part: str) -> list[tuple[int, int, bool]]:
        """(start, stop, decay) of each parameter's piece of a part, from the part's start:
        what a scale spans and how the chunked update cuts its work."""
        cached = self._piece_cache.get((key, part))
        if cached is None:
            lay = self.layouts[key]
            lo, hi = self._bounds(lay)[PARTS.index(part)]
            cached = [(s.start - lo, s.stop - lo, seg.decay) for seg, s in lay.pieces(lo, hi)]
            self._piece_cache[(key, part)] = cached
        return cached

    def _encode(self, name: str, key, part: str, values: torch.Tensor) -> torch.Tensor:
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
        self._scales[(name, key, part)] = [quantize(x[a:b], dtype, out[a:b])
                                           for a, b, _ in self._pieces(key, part)]
        return out

    def _decode(self, name: str, key, part: str, stored: torch.Tensor,
                out: torch.Tensor) -> None:
        """A part's stored state (not remainders) as fp32 values into ``out``."""
        dtype = self.precision.dtype(name)
        if dtype not in SCALED:
            out.copy_(stored)
            return
        for (a, b, _), scale in zip(self._pieces(key, part), self._scales[(name, key, part)]):
            dequantize(stored[a:b], dtype, scale, out[a:b])

    # --- layout ----------------------------------------------------------------------
    def _bounds(self, lay: FlatLayout):
        return part_bounds(lay, self.alpha, self.dp)

    def state_bytes(self) -> int:
        """Bytes of master weights and moments this rank holds, each in its dtype (12 per
        parameter in fp32)."""
        return sum(self.precision.state_bytes * (hi - lo) for lay in self.layouts.values()
                   for lo, hi in self._bounds(lay))

    def grad_bytes(self) -> int:
        """Bytes of this rank's gradients waiting for their update, in their dtype."""
        return sum(self.precision.grad_bytes * (hi - lo) for lay in self.layouts.values()
                   for lo, hi in self._bounds(lay))

    # --- backward sweep ----------------------------------------------------------------
    def gradient_ready(self, key, grad: torch.Tensor) -> None:
        """``grad`` (the whole flat, fp32, any device) is this rank's final gradient of
        layout ``key`` for this step. Data parallel: its reduce-scatter (a collective:
        every rank calls this in the same order) is launched here and waited for at the
        next unit's gradient, so it runs during that unit's backward. Then the backward
        part runs at once unless clipping needs the global norm."""
        if self._hyper is None:
            self._hyper = StepHyper(self.iteration + 1, self.param_groups[0]["lr"],
                                    self.param_groups[0]["weight_decay"])
            self.collective_log = []
        if key in self._tied:
            self._launch_tied_sum(key, grad.detach().float())
            return
        pending = self.dp.reduce_scatter_mean_async(grad.detach().float())
        if self.dp.size == 1:  # nothing in flight: use the gradient now
            self._gradient_shard(key, pending.wait())
            return
        self.collective_log.append(("launch", key))
        self._drain_reductions()
        self._reducing.append((key, pending))

    def _drain_reductions(self) -> None:
        """Wait for the launched reduce-scatters, oldest first, and use their shards."""
        while self._reducing:
            key, pending = self._reducing.pop(0)
            with timeline.span(f"reduce-scatter {key}", "collective"):
                shard = pending.wait()
            self.collective_log.append(("wait", key))
            self._gradient_shard(key, shard)

    def _launch_tied_sum(self, key, grad: torch.Tensor) -> None:
        """Start summing the embedding copy's gradient with the other stage's. Not waited
        for here: the other stage reaches its copy at another point of the step (the first
        stage last of all), and a wait would stall the pipeline."""
        works = [dist.all_reduce(grad[seg.offset:seg.offset + seg.numel],
                                 group=self.embedding_group, async_op=True)
                 for seg in self._tied[key]]
        self._tied_pending.append((key, grad, works))

    def _finish_tied_sums(self) -> None:
        """At the step boundary: the summed embedding gradients take the usual path."""
        pending, self._tied_pending = self._tied_pending, []
        for key, grad, works in pending:
            for work in works:
                work.wait()
            self._gradient_shard(key, self.dp.reduce_scatter_mean_async(grad).wait())

    def _gradient_shard(self, key, shard: torch.Tensor) -> None:
        """This rank's shard of the averaged gradient of ``key`` (on the compute device): its
        overflow flag and norms computed there, without a host synchronisation (both are
        read once, at the step boundary); its parts handed to the store, which copies them
        off the device on its own stream into host buffers (host when they fit, else the
        optimizer's tier); and the backward part's update started when it may run now."""
        lay = self.layouts[key]
        start, end, _ = self.dp.shard(lay.numel)
        shard = shard.detach().float()
        if self.grad_scaler is not None:
            overflow = shard.isfinite().logical_not().any().float().reshape(1)
            # kept where the gradients are: a copy to or from the host would synchronise
            self._found_inf = overflow if self._found_inf is None else \
                torch.maximum(self._found_inf, overflow)
            # Unscaled once, here, as Megatron unscales main grads before the norm: the grad
            # records hold true gradients.
            shard = shard * self._inv_scale
        if self.precision.grad != torch.float32:
            # --main-grads-dtype bf16: stored and moved in bf16 (summed in fp32 on the
            # device); the norm is the stored gradient's, as Megatron's is its main grads'
            shard = shard.to(self.precision.grad)
            for seg, piece in lay.pieces(start, end):
                self._norms[seg.index] = torch.linalg.vector_norm(
                    shard[piece.start - start:piece.stop - start], dtype=torch.float32)
        else:
            for seg, piece in lay.pieces(start, end):
                self._norms[seg.index] = torch.linalg.vector_norm(
                    shard[piece.start - start:piece.stop - start])
        # Back-pressure on the device: the previous layout's gradient is copied out before
        # this one is handed over, so at most two layouts' gradients wait there.
        for handle in self._device_gradients:
            handle.wait()
        self._device_gradients = []
        for part, (lo, hi) in zip(PARTS, self._bounds(lay)):
            if hi == lo:
                continue
            handle = self._put_gradient(("grad", key, part), shard[lo - start:hi - start])
            if shard.is_cuda or emulated_device.active() is not None:
                self._device_gradients.append(handle)
            if part not in self._parts_waiting_for_step():
                self._submit(key, part, self._hyper)
            else:
                self._deferred[(key, part)] = self._hyper

    def _parts_waiting_for_step(self) -> tuple:
        """The parts whose update runs in the next forward sweep: the forward part, and
        the backward part too when clipping or loss scaling needs the step's norm or
        overflow flag first."""
        return PARTS if (self.clip_grad > 0 or self.grad_scaler is not None) else ("fwd",)

    def _put_gradient(self, key, part_of_shard: torch.Tensor):
        """A gradient waits for its update in the fastest tier with room: host when the pool
        has it now, else the optimizer's tier (the drive), so with clipping on (every
        update waits for the step's norm) the gradients stay off the drive when they fit."""
        if self.tier == "nvme":
            return self.store.put(key, part_of_shard, tier="host", kind="grad", spill="nvme")
        return self.store.put(key, part_of_shard, tier=self.tier, kind="grad")

    # --- step boundary -----------------------------------------------------------------
    def step(self):
        """The step boundary: the global gradient norm is known now. Returns Megatron's
        (update_successful, grad_norm, num_zeros_in_grad)."""
        self._drain_reductions()  # the last unit's gradient: the end of the backward sweep
        self._finish_tied_sums()
        emulated_device.host_read()   # the norms and the overflow flag are the device's
        if self.grad_scaler is not None:
            found = self.dp.max(self._found_inf.to("cpu") if self._found_inf is not None
                                else torch.zeros(1))
            if self.model_parallel_group is not None:
                found = all_reduce_on_backend(found, op=dist.ReduceOp.MAX,
                                              group=self.model_parallel_group)
            found_inf = bool(found[0] > 0)
            self.grad_scaler.update(found_inf)
            self._read_loss_scale()
            self._found_inf = None
            if found_inf:  # Megatron skips the step: drop this step's gradients
                for key, part in list(self._deferred):
                    self.store.delete(("grad", key, part))
                self._deferred.clear()
                self._hyper, self._norms = None, {}
                self._drop_read_ahead()
                return False, None, None
        # The 2-norm of the per-parameter norms, in parameter order, in fp32 (Megatron's
        # formula; on the CPU the same arithmetic as torch.nn.utils.clip_grad_norm_, on a
        # GPU each norm is the device's reduction, as in Megatron).
        norms = [self._norms[i] for i in sorted(self._norms) if i in self._in_norm]
        if self.dp.size == 1 and self.model_parallel_group is None:
            total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros([])
        else:  # squares of this rank's shard norms, summed over ranks (Megatron's way)
            squares = torch.stack(norms).square().sum() if norms else torch.zeros([])
            squares = self.dp.sum(squares.reshape(1))
            if self.model_parallel_group is not None:  # every stage's and TP rank's share
                squares = all_reduce_on_backend(squares, group=self.model_parallel_group)
            total = squares.sqrt()[0]
        total = total.to("cpu")   # the step's one read of the device (its norms)
        self._clip_coef = None
        if self.clip_grad > 0:
            # as Megatron's clip_grad_by_total_norm_fp32: scaled only by a coefficient below
            # 1 (times 1 changes no bit, and costs a pass over every gradient on the CPU)
            coef = clip_coefficient(self.clip_grad, total)
            self._clip_coef = coef if float(coef) < 1.0 else None
        self.iteration += 1
        self._hyper, self._norms = None, {}
        self._stop_read_ahead()
        return True, total.item(), None

    def _stop_read_ahead(self) -> list:
        """The step boundary: no more read-ahead for the forward sweep about to run.
        Returns the records read ahead this step."""
        with self._read_ahead_lock:
            keys = self._read_ahead_keys
            self._read_ahead_order = None
            self._read_ahead_next, self._read_ahead_keys = 0, []
        return keys

    def _drop_read_ahead(self) -> None:
        """A skipped step updates nothing: the state read ahead for it leaves host memory
        (the drive's copy stays), so it does not hold the pool through the next step."""
        for key in self._stop_read_ahead():
            if key in self.store:
                self.store.evict(key, tier="nvme")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in per-unit buffers that start at zero every step."""

    # --- forward sweep -----------------------------------------------------------------
    def start_update(self, key, soon: bool = False) -> None:
        """Start the deferred parts of ``key`` on the worker. ``soon``: the schedule reads
        the unit's weights next (one unit ahead of compute in the forward sweep)."""
        if any(k == key for k, _ in self._reducing):
            self._drain_reductions()
        for part in PARTS:
            hyper = self._deferred.pop((key, part), None)
            if hyper is not None:
                self._submit(key, part, hyper, clip_coef=self._clip_coef, soon=soon)

    def read_ahead_state(self, order: list) -> None:
        """Called at each unit of the backward sweep (``order``: the layouts in the order
        the next forward sweep updates them). Reads the master weights and moments of the
        layouts whose update will wait for the forward sweep into host memory, in that
        order, while the pool has room: the forward sweep, which also writes every updated
        state back, then reads none of it from the drive, and the backward sweep's spare
        drive time does the reading. One layout is read at a time, on the store's
        read-ahead workers (reads the device needs never queue behind them), and the next
        as soon as it is in, until the step boundary: the drive's slack is used as it
        comes, so the balance follows the measured I/O and compute, not a guess."""
        with self._read_ahead_lock:
            self._read_ahead_order = order
        self._read_ahead_one()

    def _read_ahead_one(self) -> None:
        """Issue the next layout's read-ahead unless one is running or the step boundary
        has passed; its completion issues the one after."""
        with self._read_ahead_lock:
            order = self._read_ahead_order
            if order is None or any(not h.done() for h in self._read_ahead):
                return
            deferred = self._parts_waiting_for_step()
            while self._read_ahead_next < len(order):
                key = order[self._read_ahead_next]
                self._read_ahead_next += 1
                parts = [p for p, (lo, hi) in zip(PARTS, self._bounds(self.layouts[key]))
                         if hi > lo and p in deferred]
                if parts:
                    keys = [(name, key, part) for part in parts
                            for name in STATES + (("w",) if self.precision.remainders else ())]
                    self._read_ahead = [self.store.prefetch(k, tier="host", if_room=True,
                                                            background=True) for k in keys]
                    self._read_ahead_keys += keys
                    break
            else:
                return
            handles = list(self._read_ahead)
        for handle in handles:   # the last one in issues the next layout's
            handle.add_done_callback(self._read_ahead_one)

    def pending(self, key, part: str | None = None) -> bool:
        """Whether an update of ``key`` (of its ``part`` only, when given) is deferred or
        running: its weights will change."""
        def matches(k, p):
            return k == key and (part is None or p == part)
        with self._lock:
            running = any(matches(k, p) and not f.done() for (k, p), f in self._running.items())
        return running or any(matches(k, p) for k, p in self._deferred)

    def finish_update(self, key, soon: bool = False, parts=PARTS) -> None:
        """Block until ``parts`` of ``key`` (every part) are updated: call before reading
        their weights (``soon``: as ``start_update``'s)."""
        self.start_update(key, soon)
        for part in parts:
            with self._lock:
                fut = self._running.pop((key, part), None)
            if fut is not None and not fut.done():
                t0 = time.perf_counter()
                with timeline.span("optimizer.wait", "wait", unit=str(key)):
                    fut.result()
                self.blocked_s += time.perf_counter() - t0
            elif fut is not None:
                fut.result()

    def wait_running(self) -> None:
        """Wait for the updates already running (those deferred stay deferred)."""
        with self._lock:
            running = list(self._running.values())
        for fut in running:
            fut.result()

    def flush(self) -> None:
        """Apply every pending update (before evaluation, a checkpoint, or the end)."""
        for key in self.layouts:
            self.finish_update(key)

    def state_dict(self, layouts: bool = True) -> dict:
        """The step count and the hyper-parameters (and the loss scaler's state), and with
        ``layouts`` this rank's shard of every layout's master weights and moments: what a
        checkpoint needs to resume exactly. The layouts together are this rank's whole
        optimizer shard: a checkpoint takes ``layouts=False`` and reads them one at a time
        with ``layout_state``."""
        self.flush()
        state = {"iteration": self.iteration, "alpha": self.alpha,
                 "param_groups": [dict(g) for g in self.param_groups]}
        if self.grad_scaler is not None:  # fp16: the loss scale and its growth/backoff counters
            state["grad_scaler"] = self.grad_scaler.state_dict()
        if layouts:
            state["layouts"] = {key: self.layout_state(key) for key in self.layouts}
        return state

    def layout_state(self, key, names=STATES) -> dict:
        """This rank's shard of layout ``key``'s master weights and both moments ({name:
        flat shard}; ``names`` of them), read back from their tier once its pending update
        is applied, as a checkpoint holds them (``Precision.checkpoint_dtype``: what
        Megatron-Core's distributed optimizer writes): the moments and an fp16 master in
        fp32, unscaled; under remainders the master's int16 remainders (they pair with the
        working weights saved beside them)."""
        self.finish_update(key)
        lay, p = self.layouts[key], self.precision
        start, end, _ = self.dp.shard(lay.numel)
        raw = {name: torch.empty(end - start, dtype=p.dtype(name)) for name in names}
        parts = [(part, lo, hi) for part, (lo, hi) in zip(PARTS, self._bounds(lay)) if hi > lo]
        handles = [self.store.get((name, key, part), out=raw[name][lo - start:hi - start])
                   for name in names for part, lo, hi in parts]
        for handle in handles:
            handle.wait()
        state = {}
        for name in names:
            if p.dtype(name) in (torch.float32, REMAINDER):
                state[name] = raw[name]
                continue
            state[name] = torch.empty(end - start, dtype=torch.float32)
            for part, lo, hi in parts:
                self._decode(name, key, part, raw[name][lo - start:hi - start],
                             state[name][lo - start:hi - start])
        return state

    def native_master(self, master: torch.Tensor, weights: torch.Tensor | None):
        """A checkpoint's master weights (one shard: fp32 values, or the int16 remainders of
        ``weights``, the bf16 working weights saved with them) as ``load_layout_state``
        takes them here, and the working weights that must go with them when they are not
        ``weights``: (master, new weights or None). Remainders into a run without them are
        joined with their weights (exact); fp32 masters into a run with them are split
        (exact), the working weights becoming the split's high halves (they differ from
        the saved ones only where a master lies exactly halfway between two bf16 values)."""
        remainders = master.dtype == REMAINDER
        if remainders and (weights is None or weights.dtype != torch.bfloat16):
            raise ValueError("master-weight remainders need the bf16 working weights saved "
                             "with them")
        if self.precision.remainders:
            if remainders:
                return master, None
            hi, rem = split_flat(master)
            same = weights is not None and weights.dtype == torch.bfloat16 and \
                torch.equal(hi.view(torch.int16), weights.reshape(-1).view(torch.int16))
            return rem, None if same else hi
        if remainders:
            return join_flat(weights, master), None
        return master.to(torch.float32), None

    def load_layout_state(self, key, state: dict) -> list:
        """Put ``layout_state(key)``'s shards back into the store (this rank's shard of the
        same layout): the moments as fp32 values (rounded to their dtype here, Transformer
        Engine's ``set_scaled_state``), the master as ``native_master`` gives it. Returns
        the puts' handles: ``state`` is read until they are done."""
        lay = self.layouts[key]
        start, end, _ = self.dp.shard(lay.numel)
        for name in STATES:
            if tuple(state[name].shape) != (end - start,):
                raise ValueError(f"checkpoint optimizer state {name} of unit {key} has shape "
                                 f"{tuple(state[name].shape)}, this rank's shard "
                                 f"{(end - start,)}")
        if (state["master"].dtype == REMAINDER) != self.precision.remainders:
            raise ValueError(f"master weights of unit {key} are {state['master'].dtype}: "
                             "convert them with native_master first")
        self.finish_update(key)
        handles = []
        for name in STATES:
            shard = state[name]
            for part, (lo, hi) in zip(PARTS, self._bounds(lay)):
                values = self._encode(name, key, part, shard[lo - start:hi - start])
                handles.append(self.store.put((name, key, part), values, tier=self.tier,
                                              kind="optim"))
        return handles

    def set_master_weights(self, key, flat: torch.Tensor) -> None:
        """Master weights of layout ``key`` from ``flat`` (the whole layout, any dtype and
        device): this rank's parts, in their stored form (under remainders: zero
        remainders of bf16 ``flat``, whose working-weight records the caller keeps). Before
        the first step only (--no-load-optim)."""
        if self.iteration or self._hyper is not None:
            raise RuntimeError("master weights can be replaced only before the first step")
        full = flat.detach().reshape(-1).to("cpu", torch.float32)
        for part, (lo, hi) in zip(PARTS, self._bounds(self.layouts[key])):
            values = split_flat(full[lo:hi])[1] if self.precision.remainders else full[lo:hi]
            self.store.put(("master", key, part), self._encode("master", key, part, values),
                           tier=self.tier, kind="optim")

    def load_state_dict(self, state: dict) -> None:
        """``state_dict()``'s state back; without "layouts" (a checkpoint loads them one at
        a time with ``load_layout_state``) only the step count and hyper-parameters."""
        if "layouts" in state and set(state["layouts"]) != set(self.layouts):
            raise KeyError("checkpoint optimizer state does not match the model's units "
                           f"({sorted(map(str, state['layouts']))} vs "
                           f"{sorted(map(str, self.layouts))}); was it saved with another "
                           "--snake-checkpoint-interval?")
        self.flush()
        self.iteration = state["iteration"]
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
            self._read_loss_scale()
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        for key, saved in state.get("layouts", {}).items():
            for handle in self.load_layout_state(key, saved):
                handle.wait()
        self.store.synchronize()

    def _read_loss_scale(self) -> None:
        """Megatron's scale is a device tensor that changes only in step(): read it there,
        at the step boundary, as the number the host-side shards are unscaled by (not in
        the backward sweep, where reading it would stall the host)."""
        if self.grad_scaler is not None:
            self._inv_scale = 1.0 / float(self.grad_scaler.scale)

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is not None:
            return self.grad_scaler.scale
        return torch.tensor(1.0)

    # --- the update ----------------------------------------------------------------------
    def _submit(self, key, part, hyper: StepHyper, clip_coef=None, soon=False) -> None:
        """Queue one part's update on the worker. ``soon``: a deferred part, run one unit
        ahead of its weights' next read (the new weights are kept close for it)."""
        with self._lock:
            previous = self._running.get((key, part))
        if previous is not None:  # its writes come first: the reads of this one follow them
            previous.result()
        job = {"key": key, "part": part, "reads": None}
        with self._lock:
            self._queued.append(job)
            if len(self._queued) == 1:   # the worker is free for it: read its inputs now
                job["reads"] = self._read_update_inputs(key, part)
            fut: Future = self._worker.submit(self._update, job, hyper, clip_coef, soon)
            self._running[(key, part)] = fut

    def _read_update_inputs(self, key, part) -> dict:
        """Start borrowing one part's state and gradient (handles): the update changes the
        host tier's bytes in place, so state read ahead into host memory is neither copied
        out nor copied again into staging on its way back to the drive. With master-weight
        remainders, the working weights (the masters' high halves) are read too."""
        reads = {name: self.store.borrow((name, key, part)) for name in STATES + ("grad",)}
        if self.precision.remainders:
            reads["w"] = self.store.get(("w", key, part), device="cpu")
        return reads

    def _next_job(self, job: dict) -> None:
        """On the worker, as ``job`` starts: read the inputs of the update queued after it,
        so its reads overlap this one's arithmetic; at most two updates' inputs are in
        memory however far the worker falls behind."""
        with self._lock:
            self._queued.remove(job)
            if job["reads"] is None:
                job["reads"] = self._read_update_inputs(job["key"], job["part"])
            if self._queued and self._queued[0]["reads"] is None:
                following = self._queued[0]
                following["reads"] = self._read_update_inputs(following["key"],
                                                              following["part"])

    def _update(self, job: dict, hyper: StepHyper, clip_coef, soon: bool) -> None:
        key, part = job["key"], job["part"]
        updated = False
        try:
            self._next_job(job)
            with timeline.span(f"update {key} {part}", "optimizer"):
                self._update_part(key, part, hyper, clip_coef, soon, job["reads"])
            updated = True
        finally:
            if job["reads"] is not None:
                self._end_loans(key, part, updated)

    def _end_loans(self, key, part: str, updated: bool) -> None:
        """The new state goes back to its tier and the gradient is deleted. After a
        failure the state is deleted too: its bytes may be half updated in place, and a
        later read must fail (KeyError) rather than return them; the update's error is
        raised by its future."""
        if ("grad", key, part) in self.store:
            self.store.delete(("grad", key, part))
        for name in STATES:
            if updated:
                self.store.give_back((name, key, part), tier=self.tier)
            else:
                self.store.delete((name, key, part))

    def _update_part(self, key, part: str, hyper: StepHyper, clip_coef, soon: bool,
                     reads: dict) -> None:
        t0 = time.perf_counter()
        lent = {name: h.wait() for name, h in reads.items()}
        self._phase("read", t0)
        if self.precision.fp32:
            self._update_in_place(key, part, hyper, clip_coef, lent)
            weights = lent["master"]
        else:
            t = time.perf_counter()
            weights = self._update_chunked(key, part, hyper, clip_coef, lent)
            self._phase("adamw", t)
        t = time.perf_counter()
        self.store.delete(("grad", key, part))   # its host buffers are free now
        if self.on_weights is not None:   # before the master's buffers are given back
            self.on_weights(key, part, weights, soon=soon)
        elif weights is not lent["master"]:   # remainders: the optimizer's own records
            self.store.put_converted(("w", key, part), weights, self.precision.params,
                                     tier=self.tier, kind="weights")
        self._phase("weights", t)
        self.update_s += time.perf_counter() - t0

    def _phase(self, name: str, since: float) -> None:
        self.update_phase_s[name] += time.perf_counter() - since

    def _update_in_place(self, key, part: str, hyper: StepHyper, clip_coef,
                         lent: dict) -> None:
        """Every state fp32: the fused kernel on the lent bytes, one view per parameter."""
        lay = self.layouts[key]
        lo, hi = self._bounds(lay)[PARTS.index(part)]
        # each a list of 1-D pieces, cut at the same elements (same dtype and size)
        t = time.perf_counter()
        if clip_coef is not None:
            for piece in lent["grad"]:
                piece.mul_(clip_coef)
        self._phase("clip", t)
        t = time.perf_counter()
        ranges: dict[bool, list] = {True: [], False: []}   # by weight decay
        for seg, piece in lay.pieces(lo, hi):
            ranges[seg.decay].append((piece.start - lo, piece.stop - lo, seg.offset - lo))
        sizes = [p.numel() for p in lent["master"]]
        step = torch.tensor(float(hyper.step))
        for decay, rs in ranges.items():
            if not rs:
                continue
            intervals = _intervals(sizes, rs)
            taken = {name: _take(lent[name], intervals) for name in STATES + ("grad",)}
            with timeline.span("fused adamw", "cpu adamw",
                               params=sum(b - a for a, b in intervals)):
                fused_adamw_(taken["master"][0], taken["grad"][0], taken["exp_avg"][0],
                             taken["exp_avg_sq"][0], step, lr=hyper.lr,
                             beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                             weight_decay=hyper.weight_decay if decay else 0.0)
            for name in STATES:
                _return_bridges(taken[name][1])
        self._phase("adamw", t)

    # --- the chunked update (precision-aware) -------------------------------------------
    def _update_chunked(self, key, part: str, hyper: StepHyper, clip_coef,
                        lent: dict) -> list[torch.Tensor]:
        """One part's update with states in their own dtypes: each parameter piece, in
        chunks of at most CHUNK_ELEMENTS cut at 16-element lines from its start, loaded into
        fp32 scratch (several small pieces share one batch), updated by the fused kernel
        (one tensor per chunk: the bits of the kernel on the whole piece), and rounded back
        into the lent records. A scaled state (fp16, fp8) takes its piece's absmax after the
        update: a piece longer than one chunk is computed twice, the first time for its
        absmax only. Returns the new working weights' pieces for ``on_weights``."""
        p = self.precision
        flats = {name: _Flat(lent[name]) for name in STATES + ("grad",)}
        pieces = self._pieces(key, part)
        n = pieces[-1][1] if pieces else 0
        if p.remainders:      # the working weights: the masters' high halves, replaced
            new_w = lent["w"].reshape(-1)
        elif p.master != torch.float32:
            new_w = torch.empty(n, dtype=p.params)
        else:
            new_w = None
        scaled = [name for name in STATES if p.dtype(name) in SCALED]
        scales_in = {name: self._scales[(name, key, part)] for name in scaled}
        scales_out = {name: list(scales_in[name]) for name in scaled}
        tasks = {True: [], False: []}                       # by weight decay
        for index, (a, b, decay) in enumerate(pieces):
            for c in range(a, b, CHUNK_ELEMENTS):
                tasks[decay].append((index, c, min(b, c + CHUNK_ELEMENTS)))
        long = {i for i, (a, b, _) in enumerate(pieces) if b - a > CHUNK_ELEMENTS}
        step = torch.tensor(float(hyper.step))
        with timeline.span("chunked adamw", "cpu adamw", params=n):
            for decay, todo in tasks.items():
                wd = hyper.weight_decay if decay else 0.0
                amax: dict = {}
                if scaled and long:   # first pass: the absmax of each long piece's states
                    for batch in self._batches([t for t in todo if t[0] in long]):
                        views = self._compute(batch, flats, lent, scales_in, clip_coef, step,
                                              hyper.lr, wd, first_pass=True)
                        for (index, _, _), view in zip(batch, views):
                            for name in scaled:
                                value = view[name].abs().max().to(torch.float32)
                                amax[(name, index)] = torch.maximum(
                                    amax.get((name, index), value), value)
                for batch in self._batches(todo):
                    views = self._compute(batch, flats, lent, scales_in, clip_coef, step,
                                          hyper.lr, wd)
                    for (index, a, b), view in zip(batch, views):
                        self._store_chunk(index, a, b, view, flats, new_w, scales_out,
                                          amax, long)
        for name in scaled:
            self._scales[(name, key, part)] = scales_out[name]
        return [new_w] if new_w is not None else lent["master"]

    @staticmethod
    def _batches(tasks: list):
        """Consecutive tasks whose chunks fit one scratch batch together."""
        batch, size = [], 0
        for task in tasks:
            length = task[2] - task[1]
            if batch and size + length > CHUNK_ELEMENTS:
                yield batch
                batch, size = [], 0
            batch.append(task)
            size += length
        if batch:
            yield batch

    @staticmethod
    def scratch_bytes() -> int:
        """Host memory of the chunked update's scratch buffers (5.5 MiB at 2^18 elements):
        fp32 master, moments and gradient, the int16 remainder and its int32 working copy."""
        return (4 * 4 + 2 + 4) * CHUNK_ELEMENTS

    def _scratch_buffers(self) -> dict:
        if self._scratch is None:   # made on the worker, kept for the run (scratch_bytes())
            self._scratch = {name: torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
                             for name in STATES + ("grad",)}
            self._scratch["rem"] = torch.empty(CHUNK_ELEMENTS, dtype=REMAINDER)
            self._scratch["i32"] = torch.empty(CHUNK_ELEMENTS, dtype=torch.int32)
        return self._scratch

    def _compute(self, batch: list, flats: dict, lent: dict, scales_in: dict, clip_coef,
                 step: torch.Tensor, lr: float, weight_decay: float,
                 first_pass: bool = False) -> list[dict]:
        """Load a batch of chunks into fp32, run the fused AdamW kernel on them (one tensor
        per chunk) and return each chunk's new values: views of the scratch buffers, or of
        the lent record itself where an fp32 state's chunk lies in one of its pieces (it
        is updated in place, as the all-fp32 update does). ``first_pass``: the results
        are only looked at (every input is copied, nothing changes)."""
        p, scratch = self.precision, self._scratch_buffers()
        views, offset = [], 0
        for index, a, b in batch:
            length = b - a
            view = {"in_place": set()}
            for name in STATES + ("grad",):
                dtype = p.dtype(name)
                target = scratch[name][offset:offset + length]
                if dtype == torch.float32 and not first_pass:
                    direct = flats[name].view(a, b)
                    if direct is not None:   # updated where it is stored
                        view[name] = direct
                        view["in_place"].add(name)
                        continue
                view[name] = target
                if dtype == REMAINDER:
                    rem = flats[name].view(a, b)
                    if rem is None:
                        rem = scratch["rem"][offset:offset + length]
                        flats[name].read(a, b, rem)
                    join_master(lent["w"].reshape(-1)[a:b], rem, target,
                                scratch["i32"][offset:offset + length])
                    continue
                flats[name].read(a, b, target, fp8=dtype == FP8)
                if dtype in SCALED:
                    target.mul_(torch.tensor(scales_in[name][index], dtype=torch.float32))
            if clip_coef is not None:
                view["grad"].mul_(clip_coef)
            views.append(view)
            offset += length
        fused_adamw_([v["master"] for v in views], [v["grad"] for v in views],
                     [v["exp_avg"] for v in views], [v["exp_avg_sq"] for v in views], step,
                     lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                     weight_decay=weight_decay)
        return views

    def _store_chunk(self, index: int, a: int, b: int, view: dict, flats: dict, new_w,
                     scales_out: dict, amax: dict, long: set) -> None:
        """Round one chunk's new fp32 values into their records (and the new working
        weights): remainders split exactly, the rest by Transformer Engine's rules."""
        p = self.precision
        if p.remainders:
            target = flats["master"].view(a, b)
            rem = target if target is not None else self._scratch["rem"][:b - a]
            split_master(view["master"], new_w[a:b], rem, self._scratch["i32"][:b - a])
            if target is None:
                flats["master"].write(a, b, rem)
        elif new_w is not None:   # fp16 master: the weights from the fp32 result (the kernel's)
            new_w[a:b].copy_(view["master"])
        for name in STATES:
            dtype = p.dtype(name)
            if dtype == REMAINDER or name in view["in_place"]:
                continue
            if dtype not in SCALED:
                flats[name].write(a, b, view[name])
                continue
            scale = scale_for(dtype, amax[(name, index)]) if index in long else None
            target = flats[name].view(a, b)
            out = target if target is not None else torch.empty(b - a, dtype=dtype)
            scales_out[name][index] = quantize(view[name], dtype, out, scale)
            if target is None:
                flats[name].write(a, b, out)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
