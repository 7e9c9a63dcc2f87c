"""SSDTrain-style offload of the tensors autograd saves for backward.

    offloader = SavedTensorOffloader(store, tier="nvme", params=model.parameters())
    with offloader:                 # any region of autograd code
        loss = model(x).sum()
    loss.backward()                 # saved tensors come back from the tier, prefetched
    offloader.synchronize()         # every write landed (a failed write raises here)

Built on ``torch.autograd.graph.saved_tensors_hooks``:

- **pack** keeps parameters (ids given with ``params``, ``nn.Parameter`` objects, leaves
  that require grad, and anything sharing a parameter's storage), tensors smaller than
  ``min_bytes`` and non-plain tensors (subclasses, sparse, quantized, meta) as they are.
  Every other tensor is replaced by a small ``_Saved`` record (dtype, shape, stride, storage
  offset) pointing at a ``_Stored`` entry: the tensor's whole *storage*, written once,
  asynchronously, to the TensorStore tier.
- **dedup**: entries are keyed by storage (device, data_ptr). The key is trusted only while
  a weak reference to that very storage object is alive (torch keeps one Python object per
  live storage), so a freed storage whose address is reused is never mistaken for the old
  one. A tensor saved by two ops, or two views of one storage, cost one write; each save
  is rebuilt on unpack as a strided view of the one storage read back.
- **forwarding**: an unpack while the write is still running is served from memory by the
  store (the store keeps the put's source until the write is done).
- **prefetch**: entries are remembered in pack order; every unpack issues reads for the
  ``prefetch_depth`` live entries packed just before it (backward runs in roughly reverse
  pack order), so they are in memory when their turn comes.
- **lifetime**: an entry is deleted from the store when the last autograd reference to it
  is released (after its node's backward with ``retain_graph=False``; when the graph is
  freed otherwise). "Cancelled" here means: an entry whose consumers all finished before
  its write completed is never read from the tier; its delete is queued behind the write
  (the store cannot abort a started write), so the space is freed as soon as it lands.
- **counters**: ``stats`` (saves, writes, dedup hits, reads...), ``live``/``peak`` bytes
  per tier (entries on the tier; read-back copies on the compute device, "gpu"), and reads
  issued ahead are waited on as prefetches (the store's ``prefetch_wait_s``).

Bit-exact: bytes are copied, never converted, and the store checksums its records.
Like autograd, an in-place change to a saved tensor is refused at unpack (when the tensor
object is still alive to check). Double backward through unpacked tensors is not supported.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import weakref
from dataclasses import dataclass, field

import torch

KIND = "saved_activations"
_ids = itertools.count()


@dataclass
class SavedTensorStats:
    saves: int = 0            # pack calls
    kept: int = 0             # saves left in memory (parameters, small, unsupported)
    offloaded: int = 0        # saves replaced by a record
    unique_writes: int = 0    # storages written
    dedup_hits: int = 0       # offloaded saves that reused an entry (no write)
    prefetched: int = 0       # reads issued ahead of their unpack
    forwarded: int = 0        # reads issued while their write was still running
    cancelled: int = 0        # entries released before their write finished (never read)
    bytes_written: int = 0
    bytes_read: int = 0       # bytes requested back (forwarded reads included)


@dataclass(eq=False)
class _Stored:
    """One storage on the tier."""

    key: tuple
    slot: tuple                  # (device, data_ptr): the dedup key
    storage: weakref.ref         # identity guard for slot
    device: torch.device
    nbytes: int
    put: object                  # the store's put Handle
    index: int                   # position in pack order
    group: int = 0               # micro-batch it was packed in (the adaptive policy's)
    refs: int = 0                # live _Saved records pointing here
    fetch: object = None         # the store's get Handle once read back is issued
    prefetched: bool = False     # that read was issued ahead of the entry's unpack


@dataclass(eq=False)
class _Saved:
    """What autograd holds instead of an offloaded tensor: a view of a _Stored storage."""

    owner: "SavedTensorOffloader"
    entry: _Stored
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int
    version: int
    tensor: weakref.ref = field(repr=False)

    def __del__(self):
        # autograd drops the record after its node's backward (or with the graph)
        self.owner._release(self.entry)


class SavedTensorOffloader:
    # What the step asks of an offloader (training/step.py): whether this step keeps every
    # saved tensor to time them (``profiling``) and whether its plan offloads none of them
    # (``leaves_all``: the step runs without the hooks). This one offloads every candidate
    # and profiles nothing; the adaptive one (adaptive.py) answers from its plan.
    profiling = False
    leaves_all = False

    def __init__(self, store, tier: str = "nvme", *, params=(), min_bytes: int = 1 << 20,
                 prefetch_depth: int = 2, kind: str = KIND):
        if min_bytes < 1 or prefetch_depth < 0:
            raise ValueError("min_bytes must be >= 1 and prefetch_depth >= 0")
        self.store, self.tier, self.kind = store, tier, kind
        self.min_bytes, self.prefetch_depth = min_bytes, prefetch_depth
        self.stats = SavedTensorStats()
        self._name = f"saved{next(_ids)}"
        self._params = {}                   # id -> parameter (strong ref: ids stay unique)
        self._param_storages = set()        # (device, data_ptr) of parameter storages
        self.add_parameters(params)
        self._lock = threading.RLock()      # _release may run inside a locked section
        self._by_slot = {}                  # (device, data_ptr) -> _Stored
        self._order = []                    # _Stored in pack order (dead ones pruned lazily)
        self._live = 0
        self._seq = 0
        self._writes = collections.deque()  # put handles not yet known to be done
        # Bytes this offloader holds per tier: stored entries on `tier`, read-back copies on
        # the compute device ("gpu"); and the most of each since reset_peak().
        self.live = {"gpu": 0, tier: 0}
        self.peak = dict(self.live)
        self._hooks = []

    # ------------------------------------------------------------------ public API

    def add_parameters(self, params):
        """Never offload these (nor tensors sharing their storage)."""
        for p in params:
            self._params[id(p)] = p
        self._refresh_param_storages()

    def __enter__(self):
        self._refresh_param_storages()      # params may have moved (device, DDP buffers)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc):
        self._hooks.pop().__exit__(*exc)

    def synchronize(self):
        """Wait for every write issued so far; a failed write raises here."""
        with self._lock:
            writes, self._writes = list(self._writes), collections.deque()
        for handle in writes:
            handle.wait()

    # The step protocol ActivationOffloadStep follows; the adaptive policy
    # (offload/adaptive.py) profiles and plans by it, offloading everything needs none of it.

    def begin_step(self, forward_only: bool = False):
        pass

    def begin_microbatch(self):
        pass

    def end_step(self):
        pass

    def live_entries(self) -> int:
        return self._live

    def reset_peak(self):
        """Start a new peak (per training step) from what is held now."""
        with self._lock:
            self.peak = dict(self.live)

    def _hold(self, tier, nbytes):
        self.live[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.live[tier])

    # ------------------------------------------------------------------ hooks

    def _keep(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized \
                or t.device.type == "meta":
            return True                     # Parameter, subclasses, exotic layouts
        if id(t) in self._params or (t.is_leaf and t.requires_grad):
            return True
        if t.numel() * t.element_size() < self.min_bytes:
            return True
        return (t.device, t.untyped_storage().data_ptr()) in self._param_storages

    def _pack(self, t: torch.Tensor):
        self.stats.saves += 1
        if self._keep(t):
            self.stats.kept += 1
            return t
        return self._offload(t)

    def _offload(self, t: torch.Tensor) -> "_Saved":
        storage = t.untyped_storage()
        slot = (t.device, storage.data_ptr())
        with self._lock:
            self._reap_writes()
            entry = self._by_slot.get(slot)
            if entry is not None and entry.storage() is storage:
                self.stats.dedup_hits += 1
            else:
                entry = self._write(storage, slot, t.device)
            entry.refs += 1
            self.stats.offloaded += 1
        return _Saved(self, entry, t.dtype, tuple(t.shape), tuple(t.stride()),
                      t.storage_offset(), t._version, weakref.ref(t))

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved                    # kept as is
        t = saved.tensor()
        if t is not None and t._version != saved.version:
            raise RuntimeError(
                "saved-tensor offload: a tensor saved for backward was modified by an in-place "
                f"operation (version {saved.version} -> {t._version}, shape {saved.shape})")
        entry = saved.entry
        with self._lock:
            if entry.fetch is None:
                self._fetch(entry)
            self._prefetch_before(entry)
        data = entry.fetch.wait(prefetched=entry.prefetched)   # the storage as flat uint8
        return torch.empty(0, dtype=saved.dtype, device=data.device).set_(
            data.untyped_storage(), saved.offset, saved.shape, saved.stride)

    # ------------------------------------------------------------------ entries

    def _write(self, storage, slot, device) -> _Stored:
        with torch.no_grad():
            flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self._seq += 1
        key = (self._name, self._seq)
        put = self.store.put(key, flat, tier=self.tier, kind=self.kind)
        entry = _Stored(key, slot, weakref.ref(storage), device, flat.numel(), put,
                        len(self._order))
        self._by_slot[slot] = entry
        self._order.append(entry)
        self._writes.append(put)
        self._live += 1
        self._hold(self.tier, entry.nbytes)
        self.stats.unique_writes += 1
        self.stats.bytes_written += entry.nbytes
        return entry

    def _fetch(self, entry: _Stored):
        if not entry.put.done():
            self.stats.forwarded += 1
        entry.fetch = self.store.get(entry.key, device=entry.device)
        self._hold("gpu", entry.nbytes)
        self.stats.bytes_read += entry.nbytes

    def _prefetch_before(self, entry: _Stored):
        """Read ahead the prefetch_depth live entries packed just before `entry`."""
        seen = 0
        for i in range(entry.index - 1, -1, -1):
            if seen == self.prefetch_depth:
                break
            e = self._order[i]
            if e.refs == 0:
                continue
            seen += 1
            if e.fetch is None:
                self._fetch(e)
                e.prefetched = True
                self.stats.prefetched += 1

    def _release(self, entry: _Stored):
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if self._by_slot.get(entry.slot) is entry:
                del self._by_slot[entry.slot]
            if not entry.put.done():
                self.stats.cancelled += 1     # consumed from memory; the tier copy is unused
            if entry.fetch is not None:
                self._hold("gpu", -entry.nbytes)
            entry.fetch = None              # drop the read-back copy
            self._hold(self.tier, -entry.nbytes)
            self._live -= 1
            self.store.delete(entry.key)    # queued behind the write
            if len(self._order) > 64 and self._live < len(self._order) // 2:
                self._order = [e for e in self._order if e.refs > 0]
                for i, e in enumerate(self._order):
                    e.index = i

    def _reap_writes(self):
        """Surface a failed write at the next pack instead of at backward."""
        while self._writes and self._writes[0].done():
            self._writes.popleft().wait()

    def _refresh_param_storages(self):
        self._param_storages = {(p.device, p.untyped_storage().data_ptr())
                                for p in self._params.values() if p.numel()}


# ---------------------------------------------------------------------- Megatron's schedule

def offloaded_forward_step(forward_step_func, offloader: SavedTensorOffloader):
    """Wrap a pretrain_gpt-style ``forward_step(data_iterator, model, ...)`` so the model's
    forward and the returned loss function run under the offloader. Megatron runs the
    backward later, outside the context: the saved records carry the unpack hook with them."""

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator, model, *args):
        offloader.begin_microbatch()
        with offloader:
            output, loss_func = forward_step_func(data_iterator, model, *args)

        def offloaded_loss_func(*a, **kw):
            with offloader:
                return loss_func(*a, **kw)

        return output, offloaded_loss_func

    return forward_step
