"""AdamW with its state offloaded per unit, stepped unit by unit, overlapped with compute.

Every flat layout (a unit's parameters, or the shared ones) keeps its master weights and
both moments in the tensor store, cut into a *backward part* and a *forward part*, each its
own record (``optim/parts.py``). When a unit's gradient is final in the backward sweep, the
backward part is updated at once on a CPU worker thread (``optim/update_worker.py``) while
the GPU goes on with the next unit; the forward part waits for the next forward sweep and is
applied, one unit ahead of compute, before the unit's weights are read. With gradient
clipping on, no part can run before the global gradient norm is known at the step
boundary, so both parts run in the next forward sweep. Either way every unit is updated
before its next read (no staleness) and each state byte is read and written once per step.

This module is the optimizer's interface and its step: the gradients as they become final
(data-parallel reduce-scatters, the tied embedding's sum, per-parameter norms on the
device), the step boundary (global norm, clip coefficient, fp16 overflow), and the forward
sweep's deferred updates and the read-ahead of their state. The arithmetic of one part is
``optim/host_update.py``; the checkpoint state ``optim/optimizer_checkpoint.py``. Weight
decay follows Megatron (none on biases and 1-D parameters); ``param_groups`` lets
Megatron's OptimizerParamScheduler set lr and wd.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_snake.errors import FlagError
import megatron_snake.emulated_device as emulated_device
import megatron_snake.timeline as timeline
from megatron_snake.optim.adamw import (STATES, HostAdamW, check_clip_grad, clip_coefficient,
                                        megatron_param_groups)
from megatron_snake.optim.cpu_threads import check_optimizer_threads
from megatron_snake.optim.dp_shards import DataParallel, all_reduce_on_backend
from megatron_snake.optim.host_update import HostUpdate
from megatron_snake.optim.optimizer_checkpoint import CheckpointState
from megatron_snake.optim.parts import PARTS, PartStates, check_alpha, next_key
from megatron_snake.optim.precision import Precision, split_flat
from megatron_snake.optim.unit_params import UnitParams
from megatron_snake.optim.update_worker import UpdateWorker
from megatron_snake.storage.copies import describe_per_parameter


def check_device_optimizer_share(value: str, precision_aware: bool = False) -> str:
    """``--snake-device-optimizer-share``: auto, or the share F (0 to 1) of the parameters
    whose optimizer state and update are on the device; returned normalised ("auto", or
    F as a string). The precision-aware optimizer's states stay on the host."""
    if value == "auto":
        return value
    try:
        share = float(value)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise FlagError(f"--snake-device-optimizer-share must be auto or a share from 0 to 1, "
                        f"got {value!r}")
    if share and precision_aware:
        raise FlagError("--snake-device-optimizer-share: the device share runs Megatron's fp32 "
                        "optimizer; with --use-precision-aware-optimizer the states stay on "
                        "the host: give 0 or auto, or drop --use-precision-aware-optimizer")
    return repr(share)


@dataclass(frozen=True)
class StepHyper:
    """What one step's update of every part uses, fixed when the step's first gradient is
    final (the scheduler moves lr only after the step)."""

    step: int
    lr: float
    weight_decay: float


class OffloadedAdamW(CheckpointState, HostAdamW):
    def __init__(self, unit_params: UnitParams, store, *, lr: float, weight_decay: float,
                 beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 clip_grad: float = 0.0, alpha: float = 0.0, tier: str = "nvme",
                 on_weights=None, dp: DataParallel = DataParallel(), grad_scaler=None,
                 model_parallel_group=None, embedding_group=None, initial=None,
                 precision: Precision | None = None, weight_records: bool = True,
                 threads: int | None = None, speculate=(), device_share=()):
        """``initial``: where the parameters' values are when they are not in memory
        (``offload.initial_weights.InitialWeights``); by default they are read from the
        parameters. ``precision``: the dtype each state is stored in (default: every one
        fp32). With master-weight remainders the master's high half is the working-weight
        record ``("w", key, part)``: the update changes it in place and gives it back
        (where ``weights_sink``'s owner says, else to the optimizer's tier: ``on_weights``
        then publishes only a speculative update's); ``weight_records``: write every
        layout's first one here (``OffloadedUnits`` writes them itself). ``threads``: the update's CPU threads
        (default: ``cpu_threads.default_optimizer_threads``). ``speculate``: the layouts
        whose backward part is updated at once even when the step's norm or overflow flag
        must be known first (``_gradient_shard``; none by default). ``device_share``: the
        layouts whose state lives on the compute device (the store's gpu tier) and whose
        updates run there, on the calling thread's stream: Megatron's own optimizer on the
        device, for the share of the model the device has room for (none by default)."""
        check_alpha(alpha)
        check_clip_grad(clip_grad)
        self.layouts = {lay.key: lay for lay in unit_params.all_layouts()}
        self.store, self.tier = store, tier
        self.precision = precision or Precision()
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.clip_grad, self.alpha, self.dp = clip_grad, alpha, dp
        self.states = PartStates(self.layouts, alpha, dp, self.precision)
        self.device_layouts = frozenset(device_share)
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
        # part's update whose weights ``weights_sink`` does not take (nor, under
        # remainders, the update changes in place); soon: the weights are read next in this
        # sweep (a deferred part), not a sweep later.
        self.on_weights = on_weights
        self.param_groups = megatron_param_groups(lr, weight_decay)
        self.iteration = 0           # completed steps
        # the store's host traffic at the end of the first step, and step boundaries since:
        # the whole-run summary's bytes per parameter per step, warm-up left out
        self._traffic_since: dict | None = None
        self._traffic_steps = 0
        self._hyper: StepHyper | None = None
        self._norms: dict[int, torch.Tensor] = {}  # parameter index -> its gradient's norm
        self._clip_coef: torch.Tensor | None = None
        self._deferred: dict = {}    # (key, part) -> StepHyper, waiting for the next forward
        # a layout updated on the device needs no speculation: its update is quick there
        self.speculate = frozenset(speculate) - self.device_layouts \
            if self.precision.speculable else frozenset()
        self._speculated: dict = {}  # (key, part) -> StepHyper, updated out of place
        # whether the last step kept its speculative state (the clip did not bind, nothing
        # overflowed): a clip that binds tends to bind again (warm-up, mock data), so a step
        # after one that bound does not speculate, and wastes no update on it
        self._last_step_kept = True
        # parts updated speculatively, and those of them updated again (the clip bound or
        # an fp16 gradient overflowed), over the run
        self.speculated = self.speculation_misses = 0
        self._reducing: list = []    # [(key, PendingShard)]: reduce-scatters in flight
        self.collective_log: list = []  # this step's ("launch"|"wait", key), in order
        self._read_ahead: list = []     # handles of the state read ahead last
        self._read_ahead_keys: list = []  # every record read ahead this step
        self._read_ahead_next = 0       # position in the forward order, this step
        self._read_ahead_order = None   # that order while the backward sweep reads ahead
        self._read_ahead_lock = threading.Lock()   # the chain runs on the store's workers
        self._device_gradients: list = []  # puts of the last gradient still on the device
        threads = check_optimizer_threads(threads)
        self.host_update = HostUpdate(self.states, beta1=beta1, beta2=beta2, eps=eps,
                                      threads=threads, traffic=store.copies.traffic)
        self.weights_sink = None   # OffloadedUnits.weights_sink, with on_weights
        self.updates = UpdateWorker(store, self.host_update, tier_of=self.tier_of,
                                    threads=threads, publish=self._publish,
                                    weights_sink=self._weights_sink)
        previous: list = []
        for key, lay in self.layouts.items():
            master = initial.flat(lay, dtype=torch.float32) if initial is not None else \
                lay.gather(device="cpu", dtype=torch.float32)  # the full flat
            writes = []
            for part, (lo, hi) in zip(PARTS, self.states.bounds(lay)):
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
            writes.append(self.store.put(("master", key, part), rem, tier=self.tier_of(key),
                                         kind="optim"))
            if weight_records:
                writes.append(self.store.put(("w", key, part), hi, tier=self.tier_of(key),
                                             kind="weights"))
        else:
            writes.append(self.store.put(("master", key, part),
                                         self.states.encode("master", key, part, master),
                                         tier=self.tier_of(key), kind="optim"))
        for name in ("exp_avg", "exp_avg_sq"):
            self.states.start_at_zero(name, key, part)
            writes.append(self.store.put((name, key, part), torch.zeros(n, dtype=p.dtype(name)),
                                         tier=self.tier_of(key), kind="optim"))
        return writes

    def tier_of(self, key) -> str:
        """Where layout ``key``'s state lives: the device for the device share, else the
        optimizer's tier."""
        return "gpu" if key in self.device_layouts else self.tier

    def state_bytes(self) -> int:
        """Bytes of master weights and moments this rank holds, each in its dtype."""
        return self.states.state_bytes()

    def grad_bytes(self) -> int:
        """Bytes of this rank's gradients waiting for their update, in their dtype."""
        return self.states.grad_bytes()

    @property
    def threads(self) -> int:
        """The update's CPU threads."""
        return self.updates.threads

    @property
    def update_s(self) -> float:
        """Seconds the worker spent updating; ``blocked_s``: the seconds the caller waited
        for an update it needed (1 - blocked_s / update_s of a step is hidden)."""
        return self.updates.update_s

    @property
    def blocked_s(self) -> float:
        return self.updates.blocked_s

    @property
    def update_phase_s(self) -> dict:
        """``update_s`` by phase (``UPDATE_PHASES``)."""
        return self.updates.update_phase_s

    def counters(self) -> dict:
        """What the log reports of the updates, cumulative: seconds updating and waited
        for (``update_s``, ``blocked_s``), speculative parts and those updated again."""
        return {"update_s": self.update_s, "blocked_s": self.blocked_s,
                "speculated": self.speculated, "misses": self.speculation_misses}

    def log_fields(self, since: dict) -> str:
        """``--snake-log-details``' optimizer fields since ``since`` (``counters()``)."""
        now = self.counters()
        d = {k: now[k] - since[k] for k in now}
        hidden = 1.0 - d["blocked_s"] / d["update_s"] if d["update_s"] else 1.0
        text = (f"optimizer update (interval) {d['update_s']:.2f} s, hidden {hidden:.1%}")
        if self.speculate:
            text += (f" | speculative parts (interval) {d['speculated']}, updated again "
                     f"{d['misses']}")
        return text

    def summary(self) -> str:
        """The whole run's updates, for the line after the last step."""
        c = self.counters()
        hidden = 1.0 - c["blocked_s"] / c["update_s"] if c["update_s"] else 1.0
        line = (f"> optimizer (whole run): updates {c['update_s']:.2f} s on {self.threads} "
                f"CPU thread(s), {hidden:.1%} hidden behind compute")
        if self.speculate:
            line += (f"; speculative updates {c['speculated']} parts, {c['misses']} of them "
                     "updated again (the clip bound, or an fp16 step was skipped)")
        return line + f"\n> host memory traffic (whole run): {self.host_traffic()}"

    def _publish(self, key, part: str, weights: list, lent: dict, soon: bool,
                 name: str) -> None:
        """A part's new working weights for record ``(name, key, part)`` (the worker's
        ``publish``): to ``on_weights``, or under remainders to the optimizer's own
        working-weight records."""
        if self.on_weights is not None:
            self.on_weights(key, part, weights, soon=soon, name=name)
        elif self.precision.remainders:   # the masters' high halves: the optimizer's records
            self.store.put_converted((name, key, part), weights, self.precision.params,
                                     tier=self.tier_of(key), kind="weights")

    def _weights_sink(self, key, part: str, numel: int, soon: bool, name: str, lent=None):
        """The worker's ``weights_sink``: ``on_weights``' owner's, when it has one. Without
        one, working weights changed in place (``lent``, under remainders) go back to the
        optimizer's own records' tier."""
        if self.weights_sink is not None:
            return self.weights_sink(key, part, numel, soon=soon, name=name, lent=lent)
        if lent is None:
            return None
        return lent, lambda: self.store.give_back((name, key, part), tier=self.tier_of(key))

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
        for part, (lo, hi) in zip(PARTS, self.states.bounds(lay)):
            if hi == lo:
                continue
            handle = self._put_gradient(("grad", key, part), shard[lo - start:hi - start])
            if shard.is_cuda or emulated_device.active() is not None:
                self._device_gradients.append(handle)
            if part == "bwd" and not self._needs_step():
                self.updates.submit(key, part, self._hyper, inline=key in self.device_layouts)
            elif part == "bwd" and key in self.speculate and self._last_step_kept:
                # Speculation, then validation (SuperOffload): updated now as if the clip
                # coefficient were 1 and no gradient overflowed, out of place; the step
                # boundary keeps the new state, or updates the part again from the old.
                self.updates.submit(key, part, self._hyper, speculative=True)
                self._speculated[(key, part)] = self._hyper
            else:
                self._deferred[(key, part)] = self._hyper

    def _needs_step(self) -> bool:
        """Whether an update needs the step's norm (the clip) or overflow flag first."""
        return self.clip_grad > 0 or self.grad_scaler is not None

    def _waits_for_step(self, key, part: str) -> bool:
        """Whether the part's update is left for the next forward sweep at its gradient:
        the forward part always, the backward part when the step's norm or overflow flag
        is needed and the layout does not speculate."""
        return part == "fwd" or (self._needs_step() and key not in self.speculate)

    def _put_gradient(self, key, part_of_shard: torch.Tensor):
        """A gradient waits for its update in the fastest tier with room: host when the pool
        has it now, else the optimizer's tier (the drive), so with clipping on (every
        update waits for the step's norm) the gradients stay off the drive when they fit;
        on the device with the layout's state there."""
        if key[1] in self.device_layouts:
            return self.store.put(key, part_of_shard, tier="gpu", kind="grad")
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
        speculated, self._speculated = self._speculated, {}
        for key, part in speculated:   # the backward sweep's last updates (unit 0's next)
            self.updates.finish(key, part)
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
                self._drop_read_ahead()   # before the weights are made again from that state
                self._discard_speculation(speculated, skipped=True)
                self._last_step_kept = False
                self._count_traffic()
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
        self._last_step_kept = self._clip_coef is None
        if self._clip_coef is None:   # what the speculation assumed: its state is the step's
            self._commit_speculation(speculated)
        else:
            self._discard_speculation(speculated, skipped=False)
        self.iteration += 1
        self._hyper, self._norms = None, {}
        self._stop_read_ahead()
        self._count_traffic()
        return True, total.item(), None

    def _count_traffic(self) -> None:
        if self._traffic_since is None:
            self._traffic_since = self.store.copies.traffic.snapshot()
        else:
            self._traffic_steps += 1

    def host_traffic(self) -> str:
        """Host memory read and written per parameter of this rank per step, by pass, over
        the steps after the first (``storage.copies.HostTraffic``)."""
        params = sum(lay.numel for lay in self.layouts.values())
        if self._traffic_since is None or not self._traffic_steps or not params:
            return "no step"
        return describe_per_parameter(self.store.copies.traffic.per_parameter_step(
            self._traffic_since, params, self._traffic_steps))

    def _commit_speculation(self, speculated: dict) -> None:
        """The state the speculative updates wrote out of place becomes the parts' state;
        their gradients are done with."""
        names = STATES + (("w",) if self.precision.remainders else ())
        for key, part in speculated:
            for name in names:
                self.store.rename(next_key(name, key, part), (name, key, part))
            self.states.commit_next(key, part)
            self.store.delete(("grad", key, part))
        self.speculated += len(speculated)

    def _discard_speculation(self, speculated: dict, skipped: bool) -> None:
        """The speculative updates assumed wrongly: their state is deleted and the parts'
        state is as it was. A step the clip scales updates each part again, from that
        state and its gradient, in the next forward sweep (as a deferred part); a skipped
        step (an fp16 overflow) updates nothing, and the working weights the speculative
        updates published are made again from the old master weights (under remainders
        they were kept apart)."""
        names = STATES + (("w",) if self.precision.remainders else ())
        for (key, part), hyper in speculated.items():
            for name in names:
                self.store.delete(next_key(name, key, part))
            self.states.drop_next(key, part)
            if skipped:
                self.store.delete(("grad", key, part))
                if not self.precision.remainders:
                    # every part: the resident shared weights are read again whole, and a
                    # part never updated yet has no working-weight record
                    for other, _, _ in self.states.parts(key):
                        self.updates.republish(key, other)
            else:
                self._deferred[(key, part)] = hyper
        self.speculated += len(speculated)
        self.speculation_misses += len(speculated)

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
                self.updates.submit(key, part, hyper, clip_coef=self._clip_coef, soon=soon,
                                    inline=key in self.device_layouts)

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
            while self._read_ahead_next < len(order):
                key = order[self._read_ahead_next]
                self._read_ahead_next += 1
                parts = [p for p, (lo, hi) in zip(PARTS, self.states.bounds(self.layouts[key]))
                         if hi > lo and self._waits_for_step(key, p)
                         and key not in self.device_layouts]
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
        return self.updates.running(key, part) or any(
            k == key and (part is None or p == part) for k, p in self._deferred)

    def finish_update(self, key, soon: bool = False, parts=PARTS) -> None:
        """Block until ``parts`` of ``key`` (every part) are updated: call before reading
        their weights (``soon``: as ``start_update``'s)."""
        self.start_update(key, soon)
        for part in parts:
            self.updates.finish(key, part)

    def wait_running(self) -> None:
        """Wait for the updates already running (those deferred stay deferred)."""
        self.updates.wait_running()

    def flush(self) -> None:
        """Apply every pending update (before evaluation, a checkpoint, or the end)."""
        for key in self.layouts:
            self.finish_update(key)

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

    def close(self) -> None:
        self.updates.close()
