"""Unit weights in the tensor store, on the compute device one unit at a time; gradients
accumulated per unit in fp32 and handed to the optimizer the moment they are final.

Implements the weight half of the schedule's ``UnitStore`` interface. A unit's working
weights are two records (the optimizer's backward and forward parts, so each part's update
can publish its weights on its own); ``acquire_unit`` waits for the unit's pending update,
reads both records into one device buffer and points the parameters at views of it;
``release_unit`` drops the buffer. While a unit is acquired for backward, each parameter's
gradient is added into an fp32 buffer (Megatron's ``main_grad`` arithmetic) by a
post-accumulate hook, and on release that buffer goes to the optimizer. Shared (tied)
parameters stay on the device, and so do the records of the ``pinned`` units (the store's
gpu tier): what the device memory limit leaves room for is not re-read from the drive.
"""

from __future__ import annotations

import functools

import torch

from megatron_snake.optim.adamw import STATES
from megatron_snake.optim.parts import PARTS, part_bounds
from megatron_snake.optim.precision import REMAINDER, split_flat
from megatron_snake.optim.unit_params import SHARED, UnitParams
from megatron_snake.schedule.unit_store import UnitStore


class SavedUnitMismatch(ValueError):
    """A saved unit's entry (a checkpoint's) is not this run's layout, record for record."""


class OffloadedUnits(UnitStore):
    def __init__(self, unit_params: UnitParams, store, optimizer, *, device: torch.device,
                 dtype: torch.dtype, tier: str = "nvme", pinned=(), initial=None,
                 host_keep_free: int | None = None):
        """Moves the parameters' values into the store. Build ``optimizer`` first: it
        takes its fp32 master copy from the parameters; it then publishes its updated
        weights here. ``pinned``: units whose records stay on the compute device.
        ``initial``: where the values are when the parameters were built out of memory
        (``InitialWeights``). ``host_keep_free``: the free host buffers the weights a unit
        reads next leave when they go to host memory (default: the store's)."""
        self.params, self.store, self.device = unit_params, store, device
        self.dtype, self.alpha, self.tier = dtype, optimizer.alpha, tier
        self.pinned = frozenset(pinned)
        self.host_keep_free = host_keep_free
        self.dp = optimizer.dp
        self.optimizer = optimizer
        optimizer.on_weights = self.publish
        optimizer.weights_sink = self.weights_sink
        self._grad_views: dict[int, torch.Tensor] = {}
        self._grads: dict = {}        # layout key -> fp32 device buffer, while accumulating
        # What a gradient buffer starts at: 0. tools/bench_overlap.py's emulated device
        # computes no gradient, so it sets a constant here for the clip to see a norm.
        self.gradient_fill = 0.0
        self._partial_grads: dict = {}  # layout key -> host sum of earlier snake groups
        self._shared_stale = False    # an update of the shared weights is not in place yet
        # the layouts in the order the forward sweep updates them
        self._update_order = [lay.key for unit in range(len(unit_params.units))
                              for lay in unit_params.layouts_owned_by(unit)]
        # master-weight remainders: a working weight is its master's high half, Transformer
        # Engine's split (round to nearest, ties away from zero), not torch's cast
        self.remainders = optimizer.precision.remainders
        previous: list = []
        for lay in unit_params.units:
            flat = self._initial_flat(lay, initial)
            writes = [store.put(("w", lay.key, part), flat[lo:hi], tier=self.tier_of(lay.key),
                                kind="weights") for part, (lo, hi) in self.record_parts(lay)]
            self._release_weights(lay)
            for write in previous:   # at most two units' values in memory at once
                write.wait()
            previous = writes
        if self.remainders and unit_params.shared.segments:
            # the shared weights stay resident; the optimizer reads their records too
            lay = unit_params.shared
            flat = self._initial_flat(lay, initial)
            for seg, view in zip(lay.segments, lay.views(flat)):
                seg.param.data.copy_(view.to(seg.param.device))
            self._put_shared_records(flat)
        for lay in unit_params.all_layouts():
            for seg in lay.segments:
                seg.param.register_post_accumulate_grad_hook(self._accumulate)
        store.synchronize()

    def _initial_flat(self, lay, initial) -> torch.Tensor:
        """A layout's first working weights, in the working dtype (under remainders, the
        high halves of the fp32 masters the optimizer took)."""
        dtype = torch.float32 if self.remainders else self.dtype
        flat = initial.flat(lay, dtype=dtype) if initial is not None else \
            lay.gather(dtype=dtype)
        return split_flat(flat)[0] if self.remainders else flat

    def _put_shared_records(self, flat: torch.Tensor) -> None:
        """This rank's working-weight records of the shared layout from its whole flat
        (the optimizer reads them under remainders; its updates replace them)."""
        lay = self.params.shared
        handles = [self.store.put(("w", lay.key, part), flat[lo:hi].to("cpu", self.dtype),
                                  tier=self.tier_of(lay.key), kind="weights")
                   for part, (lo, hi) in self.record_parts(lay)]
        for handle in handles:
            handle.wait()

    # --- gradients -----------------------------------------------------------------------
    def _accumulate(self, param: torch.nn.Parameter) -> None:
        self._grad_views[id(param)].add_(param.grad.view(-1))
        param.grad = None

    def _take_gradient(self, key):
        """Layout ``key``'s gradient buffer (None if it has none), and its parameters' views
        of it dropped: a view left behind would keep the whole buffer alive, so every unit's
        gradient would stay in memory until the next step."""
        grad = self._grads.pop(key, None)
        if grad is not None:
            lay = self.params.shared if key == SHARED else self.params.units[key]
            for seg in lay.segments:
                self._grad_views.pop(id(seg.param), None)
        return grad

    def _start_gradients(self, lay) -> None:
        if lay.key in self._grads or not lay.segments:
            return
        buf = torch.full((lay.numel,), self.gradient_fill, dtype=torch.float32,
                         device=self.device)
        self._grads[lay.key] = buf
        for seg in lay.segments:
            self._grad_views[id(seg.param)] = buf[seg.offset:seg.offset + seg.numel]

    # --- weights -------------------------------------------------------------------------
    def tier_of(self, key) -> str:
        """Where the working-weight records of layout ``key`` live."""
        return "gpu" if key in self.pinned else self.tier

    def pinned_bytes(self) -> int:
        """Device bytes the pinned units' records hold (this rank's shards)."""
        return sum(hi - lo for lay in self.params.units if lay.key in self.pinned
                   for _, (lo, hi) in self.record_parts(lay)) * \
            torch.tensor([], dtype=self.dtype).element_size()

    def _release_weights(self, lay) -> None:
        for seg in lay.segments:
            seg.param.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def record_parts(self, lay):
        """(part, (lo, hi)) of this rank's records of a layout, skipping empty parts."""
        bounds = part_bounds(lay, self.alpha, self.dp)
        return [(part, (lo, hi)) for part, (lo, hi) in zip(PARTS, bounds) if hi > lo]

    def _read_flat(self, lay) -> torch.Tensor:
        """The layout's whole flat of working weights on the compute device: this rank's
        records, all-gathered."""
        return self._gather(lay, *self._start_read(lay))

    def _start_read(self, lay, after_update: bool = False):
        """Issue the reads of this rank's records of a layout into a new device buffer;
        returns (buffer, handles). ``after_update``: each part's read is issued as soon as
        that part's update is done, so it runs while the next update does."""
        start, end, _ = self.dp.shard(lay.numel)
        # a new buffer: its copies run while the device computes the unit before
        local = self.store.new_buffer(end - start, self.dtype, self.device)
        handles = []
        for part, (lo, hi) in self.record_parts(lay):
            if after_update:
                self.optimizer.finish_update(lay.key, soon=True, parts=(part,))
            handles.append(self.store.get(("w", lay.key, part),
                                          out=local[lo - start:hi - start], new_out=True))
        return local, handles

    def _gather(self, lay, local, handles) -> torch.Tensor:
        for handle in handles:
            handle.wait()
        return self.dp.all_gather(local, lay.numel)

    def publish(self, key, part: str, master: list, soon: bool = False,
                name: str = "w") -> None:
        """The optimizer's callback (on its worker): new working weights for one part, from
        its fp32 master weights (consecutive 1-D pieces, read only during the call), as
        record ``(name, key, part)``. ``soon``: the unit is read next (a deferred update runs
        one unit ahead), so a unit whose weights live on the drive keeps them in host memory
        when it has room, until the backward sweep's read evicts them to the drive
        (``acquire_unit``). Another ``name`` than "w": weights kept apart until the
        optimizer renames them "w" (a speculative update's, under remainders), in host
        memory or on the drive, not on the device."""
        record, tier = (name, key, part), self.tier_of(key)
        # converted straight into host buffers when they go there (put_converted)
        if soon and key != SHARED and tier == "nvme" or name != "w" and tier == "gpu":
            self.store.put_converted(record, master, self.dtype, tier="host",
                                     kind="weights", spill="nvme",
                                     keep_free=self.host_keep_free)
        else:
            self.store.put_converted(record, master, self.dtype, tier=tier, kind="weights")
        if key == SHARED:   # read again before its next use (kept apart: once renamed)
            self._shared_stale = True

    def weights_sink(self, key, part: str, numel: int, soon: bool = False, name: str = "w",
                     lent=None):
        """The optimizer's other way to publish: the new record ``(name, key, part)`` of
        ``numel`` working weights lent to be written (``TensorStore.borrow_new``: 1-D pieces
        of the store's host buffers when it has room) and the call that stores it where
        ``publish`` would (``give_back``), so the update's kernel writes each new weight
        once, into the buffer the device or the drive reads. ``lent``: the record's pieces,
        borrowed already (``TensorStore.borrow``; under remainders the update replaces the
        old weights in place): returned with the call that gives it back. Else None where
        ``publish`` must make them: fp32 weights (the master itself), the shared layout
        (its resident parameters take them) and a speculative record of a device unit (kept
        in host memory). A unit read next whose weights live on the drive stays in host
        memory when they are in the pool's buffers, as ``publish`` keeps it, else goes to
        the drive."""
        record, tier = (name, key, part), self.tier_of(key)
        if lent is None:
            if self.dtype == torch.float32 or key == SHARED or name != "w" and tier == "gpu":
                return None
            lent = self.store.borrow_new(record, (numel,), self.dtype, kind="weights",
                                         tier=tier, keep_free=self.host_keep_free)
        if soon and key != SHARED and tier == "nvme" and self.store.lent_in_buffers(record):
            tier = "host"   # read next: kept where it was written, until the read evicts it
        return lent, functools.partial(self._give_back, record, tier)

    def _give_back(self, record, tier: str) -> None:
        """The end of ``weights_sink``'s loan: the record stored on ``tier``."""
        self.store.give_back(record, tier=tier)
        if record[1] == SHARED:   # read again before its next use, as ``publish`` marks it
            self._shared_stale = True

    def _refresh_shared(self, reads=None) -> None:
        """Updated shared weights into their resident parameters (a collective when data
        parallel: every rank does it at the same point of the schedule). ``reads``:
        ``_start_read``'s for the shared layout, when they are issued already."""
        lay = self.params.shared
        flat = self._gather(lay, *(reads or self._start_read(lay)))
        for seg, view in zip(lay.segments, lay.views(flat)):
            seg.param.data = view   # views of the new buffer, as a unit's are: no copy
        self._shared_stale = False

    def acquire_unit(self, unit, *, next_unit, for_backward):
        owned = self.params.layouts_owned_by(unit)
        for lay in owned:
            self.optimizer.start_update(lay.key, soon=True)
        if next_unit is not None and not for_backward:
            # Queued behind this unit's update, so the worker goes straight on to it while
            # this unit's weights are read and it computes (its inputs are read while this
            # update runs, before this unit's weights are asked for).
            for owned_next in self.params.layouts_owned_by(next_unit):
                self.optimizer.start_update(owned_next.key, soon=True)
        lay = self.params.units[unit]
        # At the start of a step the unit's and the shared layout's updates run back to
        # back, each waiting for the global norm: a part's weights are read while the
        # updates after it run, not after all of them.
        reads = self._start_read(lay, after_update=True)
        # Whether the shared weights change is known before their update is done, alike on
        # every data-parallel rank (their read is a collective): one is pending (asked
        # first: when it ends, it has marked them stale), or it is in place already.
        shared_reads = None
        if self.params.shared_owner == unit and (self.optimizer.pending(SHARED)
                                                 or self._shared_stale):
            shared_reads = self._start_read(self.params.shared, after_update=True)
        for owned_lay in owned:
            self.optimizer.finish_update(owned_lay.key, soon=True)
        if shared_reads is not None:
            self._refresh_shared(shared_reads)
        flat = self._gather(lay, *reads)
        # Weights in host memory (published there by their update, or read ahead, when the
        # pool had room) stay there from the forward read to the backward read, which moves
        # them down: the drive writes them once a step and never reads them back, and the
        # backward sweep's reads do not queue behind a write that waits for the forward
        # sweep's updated state. The backward read drops them (the pool is bounded).
        # Under remainders they stay (the next update reads them: they are its masters'
        # high halves), where the pool had room for them.
        if self.tier_of(unit) == "nvme" and for_backward and not self.remainders:
            for part in PARTS:
                if ("w", unit, part) in self.store:
                    self.store.evict(("w", unit, part), tier="nvme")
        for seg, view in zip(lay.segments, lay.views(flat)):
            seg.param.data = view
        if for_backward:
            # the drive is mostly idle in the backward sweep: read the optimizer state
            # the next forward sweep's updates need, one layout at a time
            self.optimizer.read_ahead_state(self._update_order)
            self._start_gradients(lay)
            if self.params.shared.segments:
                self._start_gradients(self.params.shared)
        # Prefetch the next unit's parts that are final: a part an update is about to
        # replace is published into host memory by that update (``publish``), so both
        # parts are close when the unit is read.
        if next_unit is not None and self.tier_of(next_unit) == "nvme":
            key = self.params.units[next_unit].key
            for part in PARTS:
                if ("w", next_unit, part) in self.store and \
                        not self.optimizer.pending(key, part):
                    self.store.prefetch(("w", next_unit, part), tier="host", if_room=True,
                                        keep_free=self.host_keep_free)

    def release_unit(self, unit, *, gradients_final):
        lay = self.params.units[unit]
        if gradients_final:
            for owned in self.params.layouts_owned_by(unit):
                grad = self._take_gradient(owned.key)
                if grad is not None:
                    held = self._partial_grads.pop(owned.key, None)
                    if held is not None:
                        grad.add_(held.to(grad.device))
                    self.optimizer.gradient_ready(owned.key, grad)
        elif lay.key in self._grads:  # a snake group's backward; later groups add to it
            self._spill_gradient(lay.key)
        self._release_weights(lay)

    def _spill_gradient(self, key) -> None:
        """Move a unit's partial gradient (the groups swept so far) off the device, so the
        device holds one unit's gradient at a time; the unit's next backward starts a fresh
        buffer, and the final release adds the two (the shared layout stays: its units
        span the whole sweep)."""
        grad = self._take_gradient(key).to("cpu")
        held = self._partial_grads.get(key)
        self._partial_grads[key] = grad if held is None else held.add_(grad)

    # --- checkpoints -------------------------------------------------------------------
    # A checkpoint is written and read one layout at a time (``checkpoint_units`` /
    # ``load_unit_state``), never as the whole model: ``resident_state_dict`` is what stays
    # in the module (shared parameters, buffers), ``unit_state`` one layout's shard of the
    # offloaded state. ``model_state_dict`` / ``load_model_state_dict`` take the whole
    # ``module.state_dict()`` (tests, a checkpoint of a run without --snake-offload).
    def _layout(self, key):
        return self.params.shared if key == SHARED else self.params.units[key]

    def layout_keys(self) -> list:
        """Every layout of the offloaded state, in the order a checkpoint writes them."""
        return [lay.key for lay in self.params.all_layouts()]

    def _offloaded_names(self, module: torch.nn.Module) -> set:
        """The ``state_dict`` names of the parameters kept in the store (units' layouts)."""
        name_of = {id(p): n for n, p in module.named_parameters()}
        return {name_of[id(seg.param)] for lay in self.params.units for seg in lay.segments}

    def sync_resident(self) -> None:
        """Every pending update applied, and the shared parameters' updated values in the
        module (a collective under data parallelism)."""
        self.optimizer.flush()
        if self._shared_stale:
            self._refresh_shared()

    def resident_state_dict(self, module: torch.nn.Module) -> dict:
        """``module.state_dict()`` without the parameters kept in the store: the shared
        parameters (updated first) and the buffers, which stay in the module."""
        self.sync_resident()
        offloaded = self._offloaded_names(module)
        return {k: v for k, v in module.state_dict().items() if k not in offloaded}

    def load_resident_state_dict(self, module: torch.nn.Module, state: dict) -> None:
        """``resident_state_dict``'s entries back into the module."""
        offloaded = self._offloaded_names(module)
        unexpected = [k for k in state if k in offloaded]
        missing, more = module.load_state_dict(state, strict=False)
        # (extra state: what Transformer Engine layers keep, empty in Megatron's own)
        missing = [k for k in missing if k not in offloaded and not k.endswith("_extra_state")]
        if missing or unexpected or more:
            raise KeyError(f"checkpoint does not match the model: missing {missing}, "
                           f"unexpected {unexpected + more}")

    def _weight_shard(self, lay) -> torch.Tensor:
        """This rank's records of a layout's working weights, as one flat CPU tensor."""
        start, end, _ = self.dp.shard(lay.numel)
        shard = torch.empty(end - start, dtype=self.dtype)
        handles = [self.store.get(("w", lay.key, part), out=shard[lo - start:hi - start])
                   for part, (lo, hi) in self.record_parts(lay)]
        for handle in handles:
            handle.wait()
        return shard

    def unit_state(self, key, optimizer: bool = True, states=STATES) -> dict:
        """Layout ``key``'s checkpoint entry, read from its tier: this rank's shard of its
        fp32 master weights and moments (``OffloadedAdamW.layout_state``; ``states`` of
        them) and, for a unit, of its working weights ("weights"; the shared weights are
        resident, in ``resident_state_dict``), with the layout's size, this rank's element
        range ("shard") and its parameters as [name, shape, offset, numel]."""
        lay = self._layout(key)
        if optimizer and states:
            state = self.optimizer.layout_state(key, states)   # waits for the update
        else:
            self.optimizer.finish_update(key)          # the weights saved are updated ones
            state = {}
        if key != SHARED:
            state["weights"] = self._weight_shard(lay)
        start, end, _ = self.dp.shard(lay.numel)
        state.update(numel=lay.numel, shard=[start, end],
                     segments=[[seg.name, list(seg.shape), seg.offset, seg.numel]
                               for seg in lay.segments])
        return state

    def checkpoint_units(self, optimizer: bool = True) -> dict:
        """{layout key: a function returning ``unit_state(key)``}: what a save streams
        (without the master weights and moments when ``optimizer`` is False)."""
        return {key: functools.partial(self.unit_state, key, optimizer)
                for key in self.layout_keys()}

    def check_saved_layouts(self, keys) -> None:
        """Refuse a checkpoint whose layouts are not this run's (another unit partition)."""
        if list(keys) != self.layout_keys():
            raise KeyError(f"checkpoint units {list(keys)} do not match the model's units "
                           f"{self.layout_keys()}; was it saved with another "
                           "--snake-checkpoint-interval?")

    def load_unit_state(self, key, state: dict, *, optimizer: bool = True) -> None:
        """Put ``unit_state(key)``'s entry back: the unit's working weights into the store
        and, with ``optimizer``, the master weights and moments; returns when the store has
        copied them (``state`` may be dropped then). An entry that is not this rank's
        shard of this layout, record for record, raises ``SavedUnitMismatch``. Master
        weights saved in another form than this run stores (fp32, or int16 remainders of
        the saved bf16 weights) are converted exactly (``OffloadedAdamW.native_master``);
        under remainders the working weights become the split's high halves."""
        self._put_saved_layout(key, state, optimizer)

    def load_shared_optimizer_state(self, state: dict) -> None:
        """``load_unit_state`` of the shared layout's optimizer state (its weights are
        resident: loaded into the module before this)."""
        self._put_saved_layout(SHARED, state, True)

    def _put_saved_layout(self, key, state: dict, optimizer: bool) -> None:
        self._check_saved_unit(key, state, optimizer)
        lay = self._layout(key)
        start, end, _ = self.dp.shard(lay.numel)
        flat = state["weights"] if key != SHARED else self._resident_shard(lay, start, end)
        if optimizer:
            master, new = self.optimizer.native_master(state["master"], flat)
            state = dict(state, master=master)
            flat = new if new is not None else flat
        handles = []
        if key != SHARED:
            handles += [self.store.put(("w", key, part), flat[lo - start:hi - start],
                                       tier=self.tier_of(key), kind="weights")
                        for part, (lo, hi) in self.record_parts(lay)]
        elif optimizer and self.remainders:
            # the optimizer reads these records (the masters' high halves); the resident
            # parameters take them at the next read, alike on every rank (a collective)
            handles += [self.store.put(("w", key, part), flat[lo - start:hi - start]
                                       .to("cpu", self.dtype).contiguous(),
                                       tier=self.tier_of(key), kind="weights")
                        for part, (lo, hi) in self.record_parts(lay)]
            self._shared_stale = True
        if optimizer:
            handles += self.optimizer.load_layout_state(key, state)
        for handle in handles:
            handle.wait()

    @staticmethod
    def _resident_shard(lay, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of a resident layout's parameters, flat, on the CPU."""
        parts = [seg.param.detach().reshape(-1)[span.start - seg.offset:span.stop - seg.offset]
                 .cpu() for seg, span in lay.pieces(start, end)]
        dtype = lay.segments[0].param.dtype if lay.segments else torch.float32
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)

    def _check_saved_unit(self, key, state: dict, optimizer: bool) -> None:
        """The layout's size, this rank's element range and the parameters saved must be
        this run's, and every record the save may write must have this rank's shard's
        shape and its own dtype: the working weights this run's, the optimizer's fp32."""
        lay = self._layout(key)
        start, end, _ = self.dp.shard(lay.numel)
        mine = [[seg.name, list(seg.shape), seg.offset, seg.numel] for seg in lay.segments]
        saved = state.get("segments")
        if state.get("numel") != lay.numel or state.get("shard") != [start, end] or \
                saved != mine:
            listed = saved if isinstance(saved, list) else []
            raise SavedUnitMismatch(
                f"unit {key} does not match this model (elements {state.get('shard')!r} of "
                f"{state.get('numel')!r} saved, {[start, end]} of {lay.numel} here; "
                f"parameters {[s[:2] for s in listed if s not in mine][:4]} saved, "
                f"{[s[:2] for s in mine if s not in listed][:4]} here)")
        # a checkpoint's optimizer states are fp32 (Megatron's), the master's may be the
        # int16 remainders of bf16 weights (the precision-aware optimizer's)
        records = {name: (torch.float32,) for name in STATES}
        if self.dtype == torch.bfloat16:
            records["master"] += (REMAINDER,)
        if key != SHARED:
            records["weights"] = (self.dtype,)
        needed = {"weights"} | (set(STATES) if optimizer else set())
        for name, value in state.items():
            if name in ("numel", "shard", "segments"):
                continue
            if name not in records:
                raise SavedUnitMismatch(f"unit {key} holds a record {name!r} that no save "
                                        "writes")
            if not (torch.is_tensor(value) and value.dtype in records[name] and
                    tuple(value.shape) == (end - start,)):
                shown = (f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
                         if torch.is_tensor(value) else type(value).__name__)
                allowed = " or ".join(str(d).removeprefix("torch.") for d in records[name])
                raise SavedUnitMismatch(
                    f"unit {key}'s record {name!r} is {shown}, where this run's is "
                    f"{allowed} [{end - start}]")
        missing = sorted(n for n in needed & set(records) if n not in state)
        if missing:
            raise SavedUnitMismatch(f"unit {key} lacks the record(s) {missing}"
                                    + (" (saved with --no-save-optim? pass --no-load-optim)"
                                       if set(missing) & set(STATES) else ""))

    def model_state_dict(self, module: torch.nn.Module) -> dict:
        """The whole ``module.state_dict()``, every offloaded parameter read back from the
        store one unit at a time, on the CPU (the model never has to fit on the device,
        but the result holds all of it: a checkpoint uses ``unit_state``)."""
        self.sync_resident()
        state = module.state_dict()
        name_of = {id(p): n for n, p in module.named_parameters()}
        for lay in self.params.units:
            # gathered on the compute device (NCCL gathers device tensors only), one unit
            # at a time, then brought to the CPU
            flat = self._read_flat(lay).cpu()
            for seg, view in zip(lay.segments, lay.views(flat)):
                state[name_of[id(seg.param)]] = view.clone()
        return state

    def load_model_state_dict(self, module: torch.nn.Module, state: dict) -> None:
        """Put a whole ``module.state_dict()`` back: offloaded parameters into the store,
        the rest (shared parameters, buffers) into the module."""
        name_of = {id(p): n for n, p in module.named_parameters()}
        for lay in self.params.units:
            names = [name_of[id(seg.param)] for seg in lay.segments]
            if not names:
                continue
            flat = torch.cat([state[n].reshape(-1).to(self.dtype) for n in names])
            for part, (lo, hi) in self.record_parts(lay):
                self.store.put(("w", lay.key, part), flat[lo:hi], tier=self.tier_of(lay.key),
                               kind="weights")
        offloaded = self._offloaded_names(module)
        self.load_resident_state_dict(module, {k: v for k, v in state.items()
                                               if k not in offloaded})
        self.store.synchronize()

    def reload_master_weights(self) -> None:
        """The optimizer's fp32 master weights from the working weights as they are now
        (after a --load --no-load-optim), layout by layout: Megatron's
        reload_model_params."""
        for lay in self.params.units:
            self.optimizer.set_master_weights(lay.key, self._read_flat(lay))
        if self.params.shared.segments:
            flat = self.params.shared.gather()
            self.optimizer.set_master_weights(self.params.shared.key, flat)
            if self.remainders:   # the records the optimizer reads: the loaded weights
                self._put_shared_records(flat)
        self.store.synchronize()

    def load_all(self) -> None:
        """Every pending update applied and every unit's weights back in its parameters
        (for evaluation outside the schedule, a checkpoint, or the end of training)."""
        self.sync_resident()
        for lay in self.params.units:
            flat = self._read_flat(lay)
            for seg, view in zip(lay.segments, lay.views(flat)):
                seg.param.data = view
