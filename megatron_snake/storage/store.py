"""TensorStore: the per-rank tensor store with three tiers, gpu (the compute device),
host (buffers of the pinned host pool) and nvme (swap files in `<offload-dir>/rank<N>/`,
striped over several offload directories when it is given a list: one per drive).

    with TensorStore(offload_dir, rank=0, host_memory_limit=4 << 30) as store:
        store.put(("w", 3), tensor, tier="nvme").wait()     # async: returns a Handle
        t = store.get(("w", 3), device="cuda").wait()       # back as a new tensor
        store.prefetch(("w", 3), tier="host")                # copy up, keep the nvme copy
        store.evict(("w", 3), tier="nvme")                   # move down to nvme
        store.delete(("w", 3))
        print(store.summary())

Semantics.
- put copies: once its handle is done the caller may reuse the tensor (do not modify it
  before: same contract as a non_blocking copy). Any dtype/shape/stride, 0-d, empty.
- A key may have copies on several tiers at once (they are identical); get reads the
  fastest. Operations on one key run in the order they were called; different keys run
  concurrently on `workers` threads.
- get of a key whose put is still writing is served from the put's source tensor
  (forwarding: no wait for the drive).
- get returns a contiguous tensor of the stored shape (on `device`, default the device the
  tensor was put from; `dtype` converts), or fills `out` (any stride) and returns it.
- borrow lends a value to be changed in place (the CPU optimizer's update): the bytes on
  the host tier themselves, no copy, or a copy when it has none there; give_back stores
  the changed value (from the host buffers it was lent from: no staging copy). While lent,
  any operation on the key but give_back and delete raises.
- Every nvme record is checksummed; a mismatch raises IntegrityError naming key and file.
- GPU<->host copies run on their own CUDA streams; the caller's stream is respected with
  events (put waits for the work queued before it; get's result is complete when wait()
  returns).

Structure. Each tier is an object (tiers/: device, host, drive, GDS drive) that writes,
reads and drops a record's copy and counts its bytes; the bytes cross between host memory
and the device through the copy strategy the tiers are handed (copies.py; the emulated
device's, emulated_device.EmulatedCopies, by default). This module keeps the keys and
their records (record.py), the order of each key's operations (its worker pools, one
chain per key) and the placement: which tier a put goes to or spills to, and the moves up
(prefetch, borrow) and down (evict, give_back) between tiers.
"""

import logging
import math
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import megatron_snake.emulated_device as emulated_device
import megatron_snake.timeline as timeline
from megatron_snake.storage.copies import Copies, copy_concatenation, default_device
from megatron_snake.storage.counters import Counters
from megatron_snake.storage.errors import OffloadDirError
from megatron_snake.storage.host_pool import DEFAULT_BUFFER_BYTES, HostBufferPool
from megatron_snake.storage.record import Record
from megatron_snake.storage.sizes import TIERS, gb
from megatron_snake.storage.swap_file import key_hash
from megatron_snake.storage.tiers import DeviceTier, HostTier, host_buffers_for, open_drive

log = logging.getLogger("megatron_snake.storage")

__all__ = ["TensorStore", "Handle", "Counters", "host_buffers_for", "default_device"]


class Handle:
    """The result of an asynchronous store operation. wait() -> tensor (get) or None."""

    def __init__(self, future, store):
        self._future, self._store = future, store

    def done(self):
        return self._future.done()

    def add_done_callback(self, fn) -> None:
        """Call ``fn()`` when the operation is done (at once if it is), on the thread that
        finishes it."""
        self._future.add_done_callback(lambda _: fn())

    def wait(self, prefetched=False):
        """The result, once done. ``prefetched``: this read was issued ahead of its use, so
        any time blocked here is also counted as waiting for a prefetch (it arrived late)."""
        if self._future.done():        # nothing to wait for: count no time
            return self._future.result()
        t0 = time.perf_counter()
        with timeline.span("store.wait", "wait", prefetched=prefetched):
            result = self._future.result()
        self._store.counters.add_blocked(time.perf_counter() - t0, prefetched)
        return result


def _completion(future):
    """A future that completes (or fails) with ``future`` but holds no result."""
    done = Future()

    def settle(f):
        exc = f.exception()
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    future.add_done_callback(settle)
    return done


class _Done:
    """An already finished future."""

    def __init__(self, value=None):
        self._value = value

    def done(self):
        return True

    def result(self):
        return self._value

    def add_done_callback(self, fn):
        fn(self)


class TensorStore:
    def __init__(self, offload_dir, rank=0, host_memory_limit=2 << 30, engine="auto",
                 device=None, buffer_bytes=DEFAULT_BUFFER_BYTES, queue_depth=32, io_threads=4,
                 workers=4, chunk_bytes=1 << 20, free_space_probe=None, write_probe=None,
                 pin_memory=None, max_queued_bytes=None, copies=None):
        """``offload_dir``: a directory, or a list of them (one per drive: the drive tier is
        striped over them). ``copies``: the copy strategy the tiers are handed (copies.py);
        by default the device's own, which follows the emulated device's clock while a
        benchmark runs one (``emulated_device.EmulatedCopies``)."""
        self.run_id = uuid.uuid4().bytes
        self.device = torch.device(device) if device is not None else default_device()
        dir_kwargs = {}
        if free_space_probe is not None:
            dir_kwargs["free_space_probe"] = free_space_probe
        if write_probe is not None:
            dir_kwargs["write_probe"] = write_probe
        self.counters = Counters()
        self.copies = copies if copies is not None else emulated_device.EmulatedCopies(
            Copies(self.device), record=timeline.record)
        # the drive first: its directory's errors (missing, unwritable, in use) come first
        self._drive = open_drive(offload_dir, rank, self.run_id, self.copies, self.counters,
                                 engine, queue_depth, io_threads, chunk_bytes, **dir_kwargs)
        self.dir, self.engine, self.gds = self._drive.dir, self._drive.engine, self._drive.gds
        self.dirs = [d.dir for d in self._drive.drives]   # every rank directory, dir first
        self._closed = False
        try:
            self.pool = HostBufferPool(host_memory_limit, buffer_bytes, pin_memory)
        except Exception:
            self._drive.close()
            raise
        self._host = HostTier(self.pool, self.copies, self.counters)
        self._drive.stage_through(self._host)
        self._gpu = DeviceTier(self.device, self.copies, self.counters)
        self._stack = (self._gpu, self._host, self._drive)    # fastest first
        self._tier = {t.name: t for t in self._stack}
        assert tuple(self._tier) == TIERS
        self._entries = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._deleting = set()     # futures of deletes not yet done (their entries are gone)
        # Reads and writes have their own workers, so a read needed soon (the next unit's
        # weights) never queues behind hundreds of MB of background writes. Each pool is
        # first-in first-out and an operation waits only for the one before it on its key,
        # which was submitted earlier: the oldest unfinished operation can always run.
        self._readers = ThreadPoolExecutor(max_workers=workers,
                                           thread_name_prefix="snake-store-read")
        self._writers = ThreadPoolExecutor(max_workers=workers,
                                           thread_name_prefix="snake-store-write")
        # Writes into memory (host or device tier: a gradient or a unit input leaving the
        # device, which waits for them) have workers of their own too: they never queue
        # behind hundreds of MB of drive writes (the forward sweep's updated state).
        self._memory_writers = ThreadPoolExecutor(max_workers=2,
                                                  thread_name_prefix="snake-store-host")
        # Read-ahead that may be skipped (``prefetch(if_room=True)``: state a later sweep
        # needs) has two workers of its own: a read needed now never queues behind it.
        self._background = ThreadPoolExecutor(max_workers=2,
                                              thread_name_prefix="snake-store-ahead")
        # Back-pressure: a put holds its source tensor until it is copied out, so callers
        # wait while the puts queued ahead of theirs hold more than this (default: the
        # host pool's limit). Memory stays bounded when the drive is slower than the
        # producer (gradients, updated weights) instead of growing with the model.
        self.max_queued_bytes = host_memory_limit if max_queued_bytes is None \
            else max_queued_bytes
        self._queued_bytes = 0
        self._queued_cv = threading.Condition()
        self.queued_waits = 0      # puts that waited for the queue to drain
        # Host buffers a put with ``spill`` leaves free (the drive's staging, and host
        # records the placement planned); the offloaded state sets it from its plan.
        self.spill_keep_free = max(1, self.pool.count // 4)

    # ================================================================ public API

    def put(self, key, tensor, tier="nvme", kind="misc", spill=None, keep_free=None):
        """Store a copy of `tensor` under `key` on `tier`; replaces any previous value.
        ``spill``: with tier "host", the tier the copy goes to instead when the host pool
        has no room for it now, rather than waiting or raising: host when it fits, the
        drive when not. Room means ``keep_free`` buffers (default ``spill_keep_free``:
        the drive's staging and the host records the placement planned) stay free."""
        target = self._tier_named(tier)
        self._check_spill(key, tier, spill)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_quantized or tensor.is_sparse or tensor.layout != torch.strided:
            raise TypeError(f"put({key!r}): only dense strided tensors can be stored")
        tensor = tensor.detach()           # the store keeps bytes, never autograd history
        nbytes = tensor.numel() * tensor.element_size()
        self._reserve_queue(nbytes)
        ready = self.copies.caller_event(tensor)
        with self._lock:
            try:
                e, old = self._new_entry(key, kind, tensor.dtype, tuple(tensor.shape), nbytes,
                                         tensor.device)
            except RuntimeError:
                self._release_queue(nbytes)
                raise
            # a get while the put runs is served from its source (forwarding), but not
            # when the put goes onto the device: the read then waits for that copy and
            # copies on the device, where forwarding would cross the link a second time
            if target is not self._gpu:
                e.source, e.ready = tensor, ready
            prev = old.last if old is not None else None
            room = None if spill is None else self._room(keep_free)
            fut = self._writers_for(target).submit(self._run_put, e, old, prev, tensor,
                                                   target, ready, room)
            e.last = fut
        fut.add_done_callback(lambda _: self._release_queue(nbytes))
        return Handle(fut, self)

    def put_converted(self, key, pieces, dtype, tier="nvme", kind="misc", spill=None,
                      keep_free=None):
        """``put`` of the concatenation of the 1-D tensors ``pieces`` as one 1-D record
        of ``dtype``, converted as it is copied. A record that may spill (``spill``) and
        has room in the host pool now is written on the calling thread straight into its
        buffers: no converted copy is made first and nothing queues behind other puts, so
        the record is in place when this returns (new weights from an update, read next).
        Otherwise the converted copy is made here and ``put``. The pieces may change once
        this returns; the handle is done when the record is stored."""
        self._tier_named(tier)
        self._check_spill(key, tier, spill)
        numel = sum(p.numel() for p in pieces)
        nbytes = numel * dtype.itemsize
        # only a record that may spill: a planned host record holds planned buffers (acquire)
        bufs = self._host.take_for_converted(nbytes, self._room(keep_free)) \
            if spill is not None else None
        if bufs is None:
            # converted on the device when the pieces are there (an update on the device);
            # else in pinned memory when it goes to a GPU: a copy from pageable memory moves
            # at a few GB/s through the driver's bounce buffer and holds a CPU core meanwhile
            # (an H200 step spent 1.0 s on 6.3 GB of them); pinned, it is a DMA at the
            # link's rate, and torch's caching host allocator reuses the buffer
            where = pieces[0].device if pieces else torch.device("cpu")
            if where.type != "cpu" or self.copies.device_side():   # (an emulated device's)
                flat = torch.empty(numel, dtype=dtype, device=where)
                self.copies.convert_within_device(flat, pieces)
            else:
                pin = tier == "gpu" and self.device.type == "cuda"
                flat = torch.empty(numel, dtype=dtype, pin_memory=pin)
                self.copies.traffic.add("copy", numel * flat.element_size() + sum(
                    piece.numel() * piece.element_size() for piece in pieces))
                copy_concatenation([flat], pieces)
            return self.put(key, flat, tier=tier, kind=kind, spill=spill, keep_free=keep_free)
        stored = _Done()
        with timeline.span(f"put {kind}", "store", tier=tier, bytes=nbytes):
            try:
                self._host.convert_into(bufs, pieces, dtype, nbytes, kind)
                with self._lock:
                    e, old = self._new_entry(key, kind, dtype, (numel,), nbytes,
                                             torch.device("cpu"))
                    e.last = stored
                    self._host.keep(e, bufs)
            except BaseException:
                self._host.release(bufs)
                raise
            # the old value: nothing can be queued on it now (it left _entries under the
            # lock); freed at once when nothing is, else after its operations, as deleted
            if old is not None and (old.last is None or old.last.done()):
                self._free_entry(old)
            elif old is not None:
                with self._lock:
                    self._forget(old)
        return Handle(stored, self)

    def _new_entry(self, key, kind, dtype, shape, nbytes, device):
        """A new value of ``key`` in ``_entries`` (called holding ``_lock``), and the value it
        replaces. A value lent to be changed in place is never replaced (RuntimeError)."""
        old = self._entries.get(key)
        if old is not None and old.lent:
            self._entry(key)               # raises, naming the key
        self._seq += 1
        e = Record(key, kind, dtype, shape, nbytes, device, key_hash(key), self._seq)
        self._entries[key] = e
        return e, old

    def _check_spill(self, key, tier, spill) -> None:
        if spill is not None and (tier != "host" or spill != "nvme"):
            raise ValueError(f"put({key!r}): spill={spill!r} applies to tier 'host' and "
                             "spills to 'nvme'")

    def _reserve_queue(self, nbytes: int) -> None:
        """Wait until the queued puts leave room for ``nbytes`` more (one put is always let
        through, however large, so nothing waits forever)."""
        with self._queued_cv:
            if self._queued_bytes and self._queued_bytes + nbytes > self.max_queued_bytes:
                self.queued_waits += 1
                with timeline.span("queue.wait", "wait"):
                    while self._queued_bytes and \
                            self._queued_bytes + nbytes > self.max_queued_bytes:
                        self._queued_cv.wait()
            self._queued_bytes += nbytes

    def _release_queue(self, nbytes: int) -> None:
        with self._queued_cv:
            self._queued_bytes -= nbytes
            self._queued_cv.notify_all()

    def new_buffer(self, shape, dtype: torch.dtype, device=None) -> torch.Tensor:
        """A buffer for reads (``get`` makes its own with it; a caller passes part of one
        as ``out`` with ``new_out=True``). On a GPU it is made on the store's copy stream,
        so the copies that fill it need not wait for the work queued on the caller's stream
        (a buffer made there may reuse memory that work still reads: the device would
        drain before every read), and marked as used by the caller's stream, so its memory
        is not reused before that stream is done with it."""
        return self.copies.new_buffer(shape, dtype, device)

    def get(self, key, device=None, dtype=None, out=None, new_out=False):
        """Read `key` back; wait() returns a new tensor, or `out` filled. ``new_out``: out
        is (part of) a ``new_buffer`` nothing has used yet, so the read fills it without
        waiting for the device's queued work."""
        copies = self.copies
        with self._lock:
            e = self._entry(key)
            device = torch.device(device) if device is not None else (
                out.device if out is not None else e.device)
            dst = self._new_dest(e, device, dtype, out)
            result = out if out is not None else dst if dtype in (None, e.dtype) else \
                copies.new_buffer(e.shape, dtype, device)
            # out belongs to the caller's stream: our copy stream waits for the work queued
            # there, then fills it; buffers of our own (or a new_out) are new
            free = copies.caller_event(dst) if out is not None and not new_out else None
            # One read of e.ready, then of e.source: the put's worker clears source, then
            # ready, without taking our lock.
            ready = e.ready
            source = e.source
            # the emulated device reading a worker's host tensor: a copy over its host link
            over_link = copies.over_link(ready)
            if source is not None and not (source.is_cuda or dst.is_cuda or over_link):
                # forwarding: the put is still writing; serve it from memory right now
                return Handle(_Done(self._run_forward(source, None, None, dst, result)), self)
            if source is not None:           # forwarding, CUDA or the link: a copy stream's
                fut = self._readers.submit(self._run_forward, source, ready, free, dst,
                                           result, over_link)
            else:
                fut = self._readers.submit(self._run_get, e, e.last, free, dst, result,
                                           copies.device_side())
                e.last = _completion(fut)   # later operations wait for it, without
                # holding the tensor it returns (the caller's, freed when the caller drops it)
        return Handle(fut, self)

    def prefetch(self, key, tier="host", if_room=False, background=False, keep_free=None):
        """Ensure a copy of `key` on `tier` (host or gpu), keeping the slower copy.
        ``if_room`` (host): only if the pool has room now, as a ``put`` with ``spill``
        and ``keep_free`` (else nothing happens: a prefetch that may be skipped never
        waits or raises). ``background``: a read-ahead for later, on workers of its own
        (reads needed soon never queue behind it)."""
        target = self._tier_named(tier)
        if if_room and tier != "host":
            raise ValueError(f"prefetch({key!r}): if_room applies to the host tier")
        room = self._room(keep_free) if if_room else None
        return self._chain(self._background if background else self._readers, key,
                           self._run_prefetch, target, room)

    def borrow(self, key, on_host=False):
        """Lend ``key``'s value to the caller to change in place. wait() returns it as 1-D
        views, one per host buffer of its record (the host tier's segments): of the host
        tier's own bytes when it is there (no copy), else of a new tensor read from its
        tier; a value on the device tier is lent as its device tensor (one view), in place,
        or with ``on_host`` (the CPU changes it) as a host copy read from it, which
        ``give_back`` copies there again. Two records of the same dtype and size on the
        host are cut at the same elements. End the loan with ``give_back``, ``end_loan`` or
        ``delete``; until then any other operation on the key raises, so nothing reads or
        moves the bytes while they change."""
        with self._lock:
            e = self._entry(key)
            fut = self._readers.submit(self._run_borrow, e, e.last, on_host)
            e.last, e.lent = fut, True
        return Handle(fut, self)

    def borrow_new(self, key, shape, dtype: torch.dtype, kind="misc", tier="nvme",
                   keep_free=None):
        """Lend a new value of ``key`` for the caller to write (an update written out of
        place), as ``borrow`` lends one to change: 1-D views of its dtype, one per host
        buffer, of buffers of the pool, else of a new tensor; returned at once. For
        ``tier`` "host" the buffers are the placement's (waited for, as a host-tier put's);
        for another tier they are taken only when the pool has room now (``keep_free``
        left free). End the loan with ``give_back`` (stored from those buffers) or
        ``delete``. A value ``key`` had is replaced, as by a put."""
        shape = tuple(shape)
        size = torch.tensor([], dtype=dtype).element_size()
        nbytes = size * math.prod(shape)
        in_place = nbytes and self._host.seg_payload % size == 0
        bufs = None
        if in_place and tier == "host":
            bufs = self._host.pool.acquire(len(self._host.segments(nbytes)), resident=True,
                                           what=f"key {key!r}")
        elif in_place:
            bufs = self._host.take_for_converted(nbytes, self._room(keep_free))
        with self._lock:
            try:
                e, old = self._new_entry(key, kind, dtype, shape, nbytes, torch.device("cpu"))
            except BaseException:
                if bufs is not None:
                    self._host.release(bufs)
                raise
            e.lent = True
            if bufs is not None:
                e.host, e.sealed = bufs, False
            if old is not None:
                self._forget(old)
        if bufs is not None:
            return self._host.payloads(e)
        # pinned where it goes to a GPU, as put_converted's copy: a DMA, not the driver's
        # bounce buffer
        flat = torch.empty(nbytes // size if size else 0, dtype=dtype,
                           pin_memory=tier == "gpu" and self.device.type == "cuda")
        e.lent_copy = flat
        return [flat[a // size:b // size] for _, a, b in self._host.segments(nbytes)]

    def lent_in_buffers(self, key) -> bool:
        """Whether the loan of ``key`` (``borrow_new``, or ``borrow`` once its wait() has
        returned) is of host buffers of the pool (else of a tensor)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.lent:
                raise RuntimeError(f"lent_in_buffers({key!r}): the key is not lent")
            return e.lent_copy is None and not e.lent_gpu

    def end_loan(self, key):
        """End ``borrow(key)``'s loan of a value the caller did not change: its copies stay
        as they were (a copy lent when it had none on the host tier is dropped)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.lent:
                raise RuntimeError(f"end_loan({key!r}): the key is not lent (borrow it first)")
            e.lent, e.lent_copy, e.lent_gpu = False, None, False
            if e.last is not None:   # the borrow's future holds the lent pieces
                e.last = _completion(e.last)

    def rename(self, src, dst):
        """``src``'s value becomes ``dst``'s, and ``src`` is forgotten: no byte moves, the
        operations queued on it run on, and ``dst``'s value before is deleted (after its
        own operations). Neither may be lent."""
        with self._lock:
            e = self._entry(src)
            old = self._entries.get(dst)
            if old is not None and old.lent:
                self._entry(dst)           # raises, naming the key
            del self._entries[src]
            e.key = dst                    # its messages name it; its records keep khash
            self._entries[dst] = e
            if old is not None:
                self._forget(old)

    def give_back(self, key, tier="nvme"):
        """End ``borrow(key)``'s loan: the lent value, as changed, replaces the stored one
        on ``tier``, as a put of it would. Lent from the host tier, it is written from
        those buffers (to the drive with no staging copy; kept in place for ``host``)."""
        target = self._tier_named(tier)
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.lent:
                raise RuntimeError(f"give_back({key!r}): the key is not lent (borrow it first)")
        self._reserve_queue(e.nbytes)    # bounded as the put of the new value would be
        with self._lock:
            self._seq += 1   # a new value: its records carry a new sequence number
            e.lent = False
            fut = self._writers_for(target).submit(self._run_give_back, e, e.last, target,
                                                   self._seq)
            e.last = fut
        fut.add_done_callback(lambda _: self._release_queue(e.nbytes))
        return Handle(fut, self)

    def _room(self, keep_free):
        """The free host buffers a copy made only if there is room must leave."""
        return max(1, self.spill_keep_free if keep_free is None else keep_free)

    def evict(self, key, tier="nvme"):
        """Move `key` down to `tier`: write it there if it is not there yet, then drop the
        copies on faster tiers."""
        target = self._tier_named(tier)
        return self._chain(self._writers, key, self._run_evict, target)

    def delete(self, key):
        """Forget `key` and free its space on every tier (after its pending operations)."""
        with self._lock:
            e = self._entries.pop(key, None)
            if e is None:
                return Handle(_Done(), self)
            e.lent = False             # a loan ends with the value deleted
            fut = self._forget(e)
        return Handle(fut, self)

    def _forget(self, e):
        """Free an entry no longer in ``_entries`` once its pending operations are done
        (called holding ``_lock``)."""
        fut = self._writers.submit(self._run_delete, e, e.last)
        e.last = fut
        # the entry is gone from _entries: synchronize() finds its delete here
        self._deleting.add(fut)
        fut.add_done_callback(self._deleting.discard)
        return fut

    def __contains__(self, key):
        return key in self._entries

    def keys(self):
        return list(self._entries)

    def tiers(self, key):
        """The tiers that hold a copy of key now (after its pending operations)."""
        e = self._entry(key)
        if e.last is not None:
            e.last.result()
        return [t.name for t in self._stack if t.holds(e)]

    def location(self, key):
        """[(path, offset, length)] of key's nvme records (for tools and tests)."""
        e = self._entry(key)
        if e.last is not None:
            e.last.result()
        return self._drive.location(e)

    def preallocate(self, kind, nbytes):
        """Check free space and grow `kind`'s swap file to hold nbytes now."""
        self.check_capacity(nbytes)
        self._drive.preallocate(kind, nbytes)

    def host_buffers_for(self, nbytes: int) -> int:
        """Host buffers a record of ``nbytes`` holds while it lives on the host tier."""
        return self._host.buffers_for(nbytes)

    def check_capacity(self, nbytes_planned, also=None):
        """Raise CapacityError unless nbytes_planned, striped over the offload drives, fit
        (with margin); ``also``: {rank directory path: bytes} more on that directory's file
        system alone (the --save checkpoints)."""
        return self._drive.check_capacity(nbytes_planned, also)

    def synchronize(self):
        """Wait for every pending operation (errors are raised by their own handles)."""
        with self._lock:
            pending = [e.last for e in self._entries.values() if e.last is not None]
            pending += list(self._deleting)
        for f in pending:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - reported by the operation's handle
                pass

    def summary(self):
        c = self.counters
        return (f"io: nvme r {gb(c.read['nvme'])} w {gb(c.written['nvme'])} | "
                f"host r {gb(c.read['host'])} w {gb(c.written['host'])} | "
                f"gpu r {gb(c.read['gpu'])} w {gb(c.written['gpu'])} | req {c.requests} | "
                f"blocked {c.blocked_s:.2f} s (pool waits {self.pool.wait_seconds:.2f} s) | "
                f"qd {c.queue_depth} max {c.max_queue_depth} | host pool "
                f"{self.pool.in_use}/{self.pool.count} x {self.pool.buffer_bytes >> 20} MiB | "
                f"{self._drive.describe()}")

    def close(self, remove_files=True):
        """Wait for pending work, remove the swap files and the lock (clean exit). A file
        that cannot be removed (the directory's permissions changed during the run) is
        reported after everything else is closed, in one OffloadDirError naming the files."""
        if self._closed:
            return
        self._closed = True
        self.synchronize()
        for pool in (self._readers, self._writers, self._memory_writers, self._background):
            pool.shutdown(wait=True)
        left = self._drive.close(remove_files)   # [(path, bytes, OSError)]
        self.pool.close()
        if left:
            raise self._drive.left_behind(left)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except OffloadDirError as err:
            if exc is None:
                raise
            # the error that ended the run is the one to see; the files left are logged
            log.error("%s", err)

    # ================================================================ helpers

    def _writers_for(self, target):
        """The workers of a write to ``target``: memory, or the drive (a write to host that
        spills for want of room goes to the drive from the memory writers)."""
        return self._memory_writers if target.memory else self._writers

    def _tier_named(self, tier):
        t = self._tier.get(tier) if isinstance(tier, str) else None
        if t is None:
            raise ValueError(f"unknown tier {tier!r}; one of {TIERS}")
        return t

    def _entry(self, key):
        e = self._entries.get(key)
        if e is None:
            raise KeyError(f"tensor store (rank dir {self.dir.path}) has no key {key!r}")
        if e.lent:
            raise RuntimeError(f"tensor store key {key!r} is lent (borrow); give it back or "
                               "delete it first")
        return e

    def _chain(self, pool, key, fn, *args):
        with self._lock:
            e = self._entry(key)
            fut = pool.submit(fn, e, e.last, *args)
            e.last = fut
        return Handle(fut, self)

    def _all_direct(self):
        return self._drive.all_direct()

    def _new_dest(self, e, device, dtype, out):
        """The tensor the bytes land in: out itself when it is contiguous with the stored
        dtype, else a new contiguous tensor (out is then filled with copy_)."""
        if out is not None:
            if tuple(out.shape) != e.shape:
                raise ValueError(f"get({e.key!r}): out has shape {tuple(out.shape)}, stored {e.shape}")
            if out.dtype == e.dtype and out.is_contiguous() and out.device == device:
                return out
        return self.copies.new_buffer(e.shape, e.dtype, device)

    def _finish(self, dst, result):
        """Fill ``result`` (out, or the converted dtype) from dst on the copy stream: it is
        complete when this worker returns, whichever stream the caller is on."""
        if result is not dst:
            self.copies.copy([(result, dst)], "h2d")
        return result

    def _wait_prev(self, prev):
        if prev is not None:
            prev.result()

    def _read_into(self, e, dst, to_device=False, free=None):
        """Fill the contiguous tensor dst (stored dtype/shape) from the fastest tier, once
        ``free`` (the caller's event on dst) allows (``to_device``: dst is the compute
        device's)."""
        if e.nbytes:
            for tier in self._stack:
                if getattr(e, tier.name) is not None:
                    tier.read_into(e, dst, to_device, free)
                    return
        self.copies.wait(free, "h2d")
        if e.nbytes:
            raise KeyError(f"key {e.key!r} has no copy on any tier (deleted?)")

    def _free_entry(self, e):
        for tier in self._stack:
            tier.drop(e)

    # ================================================================ operations (workers)

    def _run_put(self, e, old, prev, tensor, target, ready, room=None):
        with timeline.span(f"put {e.kind}", "store", tier=target.name, bytes=e.nbytes):
            self._put(e, old, prev, tensor, target, ready, room)

    def _put(self, e, old, prev, tensor, target, ready, room):
        try:
            try:
                self._wait_prev(prev)
            except Exception:  # noqa: BLE001 - the old value's failure is its own handle's
                pass
            if old is not None:
                self._free_entry(old)
            src = self.copies.contiguous_source(tensor, ready)
            if not e.nbytes:
                target.write_empty(e, src)
                return
            # the emulated device's tensors are the ones put with an event on its clock
            from_device = self.copies.from_device(ready)
            if not target.write(e, src, from_device, room):
                # it may spill (room given) and the host had none: the drive
                self._drive.write(e, src, from_device)
        finally:
            e.source = e.ready = None

    def _run_forward(self, source, ready, free, dst, result, over_link=False):
        # events exist only where a device tensor is involved
        if ready is not None:
            self.copies.wait(ready, "h2d")
        if free is not None:
            self.copies.wait(free, "h2d")
        self.copies.across([(dst, source)], "h2d", over_link)
        return self._finish(dst, result)

    def _run_get(self, e, prev, free, dst, result, to_device):
        with timeline.span(f"get {e.kind}", "store", bytes=e.nbytes):
            return self._get(e, prev, free, dst, result, to_device)

    def _get(self, e, prev, free, dst, result, to_device):
        self._wait_prev(prev)
        self._read_into(e, dst, to_device, free)
        return self._finish(dst, result)

    def _run_prefetch(self, e, prev, target, room=None):
        with timeline.span(f"prefetch {e.kind}", "store", tier=target.name, bytes=e.nbytes):
            self._prefetch(e, prev, target, room)

    def _prefetch(self, e, prev, target, room):
        self._wait_prev(prev)
        if target is self._drive:
            if e.nvme is None:
                self._run_evict(e, None, target, drop=False)
            return
        if target.holds(e):
            return
        if target is self._gpu:
            dst = self.copies.empty(e.shape, e.dtype)    # allocated for the copy stream
            self._read_into(e, dst)
            self._gpu.keep(e, dst)
            return
        # host: straight from the drive's records into host buffers when it can
        if e.gpu is None and self._drive.fills_host(e):
            bufs = self._host.buffers(e, room)
            if bufs is None:
                return
            try:
                self._drive.read_into_host(e, bufs)
            except BaseException:
                self._host.release(bufs)
                raise
            self._host.keep(e, bufs, sealed=True)
            return
        src = e.gpu
        if src is None:                  # a GDS record: through device memory
            src = self.copies.empty(e.shape, e.dtype)
            self._read_into(e, src)
        self._host.write(e, src, room=room)

    def _run_evict(self, e, prev, target, drop=True):
        self._wait_prev(prev)
        if target is self._gpu:
            return
        if target is self._host and e.host is None:
            if e.gpu is None:
                return       # already below host: nothing faster to drop
            self._host.write(e, e.gpu)
        if target is self._drive and e.nvme is None:
            if not e.nbytes:
                self._drive.write_empty(e, None)
            elif e.host is not None:
                self._drive.write_from_host(e)
            else:
                self._drive.write(e, e.gpu)
        if drop:
            self._gpu.drop(e)
            if target is self._drive:
                self._host.drop(e)

    def _run_borrow(self, e, prev, on_host=False):
        with timeline.span(f"borrow {e.kind}", "store", bytes=e.nbytes):
            self._wait_prev(prev)
            if e.gpu is not None and not on_host:   # the device's tensor: changed there
                e.lent_gpu = True
                return [e.gpu.reshape(-1)]
            size = torch.tensor([], dtype=e.dtype).element_size()
            in_place = e.nbytes and self._host.seg_payload % size == 0
            if in_place and e.host is None and e.gpu is None and self._drive.fills_host(e):
                # Read into host buffers when the pool has room, as a prefetch would: lent
                # in place and written back from them, with no copy either way (copies
                # take the cores the drive's I/O shares).
                self._prefetch(e, None, self._host, self._room(None))
            if e.host is not None and in_place:
                return self._host.lend(e)
            # pinned when it comes from a GPU (and goes back to it): DMAs both ways
            flat = torch.empty(e.nbytes // size, dtype=e.dtype,
                               pin_memory=e.gpu is not None and self.device.type == "cuda")
            self._read_into(e, flat.view(e.shape))
            e.lent_copy = flat
            return [flat[a // size:b // size] for _, a, b in self._host.segments(e.nbytes)]

    def _run_give_back(self, e, prev, target, seq):
        with timeline.span(f"give back {e.kind}", "store", tier=target.name, bytes=e.nbytes):
            self._give_back(e, prev, target, seq)

    def _give_back(self, e, prev, target, seq):
        self._wait_prev(prev)   # the borrow: if it failed, the stored value stays as it was
        e.seq = seq
        if e.lent_gpu:                   # changed on the device: other copies are stale
            e.lent_gpu = False
            self._host.drop(e)
            self._drive.drop(e)
            if target is not self._gpu:
                changed, e.gpu = e.gpu, None
                self._put(e, None, None, changed.view(e.shape), target, None, None)
            return
        self._gpu.drop(e)                # copies of the value before the change
        self._drive.drop(e)
        copy, e.lent_copy = e.lent_copy, None
        if copy is None and target is not self._gpu and e.nbytes:
            # lent in place: the host buffers hold the new value
            self._host.changed(e, kept=target is self._host)
            if target is self._drive:
                self._drive.write_from_host(e)
                self._host.drop(e)
            return
        if copy is None and e.nbytes:
            # lent in place, stored on the device: copied there from the host buffers
            self._gpu.write_pieces(e, self._host.payloads(e))
            self._host.drop(e)
            return
        if copy is None:                 # empty
            copy = self._host.copy_out(e)
        self._free_entry(e)
        self._put(e, None, None, copy.view(e.dtype).view(e.shape), target, None, None)

    def _run_delete(self, e, prev):
        try:
            self._wait_prev(prev)
        except Exception:  # noqa: BLE001
            pass
        self._free_entry(e)
