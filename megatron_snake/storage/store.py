"""TensorStore: the per-rank tensor store with three tiers, gpu (the compute device),
host (buffers of the pinned host pool) and nvme (swap files in `<offload-dir>/rank<N>/`).

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
"""

import contextlib
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

import megatron_snake.emulated_device as emulated_device
import megatron_snake.timeline as timeline
from megatron_snake.storage.directory import RankDir
from megatron_snake.storage.engine import make_engine
from megatron_snake.storage.errors import IntegrityError, OffloadDirError, OffloadIOError
from megatron_snake.storage.host_pool import DEFAULT_BUFFER_BYTES, HostBufferPool
from megatron_snake.storage.sizes import TIERS, gb
from megatron_snake.storage.swap_file import (REC_HEADER_BYTES, Checksum, SwapFile,
                                              check_record_header, key_hash, verify_record,
                                              write_record_header)

log = logging.getLogger("megatron_snake.storage")


def host_buffers_for(nbytes: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> int:
    """Host buffers a record of ``nbytes`` holds on the host tier: whole buffers, each
    carrying ``buffer_bytes - REC_HEADER_BYTES`` of it (what ``_segments`` cuts)."""
    return -(-int(nbytes) // (buffer_bytes - REC_HEADER_BYTES))


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


@dataclass
class Counters:
    """Bytes read/written per tier, engine requests, time callers were blocked, queue depth."""

    read: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    written: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    requests: int = 0
    blocked_s: float = 0.0
    prefetch_wait_s: float = 0.0   # the part of blocked_s spent on reads issued ahead of use
    queue_depth: int = 0
    max_queue_depth: int = 0
    spilled: int = 0   # host copies asked for only if there was room, and not made
    # kind -> tier -> [bytes read, bytes written]: which state moved (weights, optim, ...)
    by_kind: dict = field(default_factory=dict)

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, tier, nread=0, nwritten=0, requests=0, kind=None):
        with self._lock:
            self.read[tier] += nread
            self.written[tier] += nwritten
            self.requests += requests
            if kind is not None:
                per_tier = self.by_kind.setdefault(kind, {t: [0, 0] for t in TIERS})[tier]
                per_tier[0] += nread
                per_tier[1] += nwritten

    def snapshot(self) -> dict:
        """The byte and wait totals now, copied: what a log interval subtracts."""
        with self._lock:
            return dict(read=dict(self.read), written=dict(self.written),
                        blocked_s=self.blocked_s, prefetch_wait_s=self.prefetch_wait_s,
                        by_kind={k: {t: list(rw) for t, rw in tiers.items()}
                                 for k, tiers in self.by_kind.items()})

    def add_spilled(self):
        with self._lock:
            self.spilled += 1

    def add_blocked(self, seconds, prefetched=False):
        with self._lock:
            self.blocked_s += seconds
            if prefetched:
                self.prefetch_wait_s += seconds

    def inflight(self, delta):
        with self._lock:
            self.queue_depth += delta
            self.max_queue_depth = max(self.max_queue_depth, self.queue_depth)


@dataclass
class _Entry:
    key: object
    kind: str
    dtype: torch.dtype
    shape: tuple
    nbytes: int
    device: torch.device
    khash: int
    seq: int
    gpu: object = None           # tensor on the compute device
    host: list = None            # [HostBuffer] (record format: header + payload)
    host_sealed: bool = False    # host buffers carry headers with checksums
    nvme: list = None            # [(offset, length)] in the kind's swap file
    source: object = None        # the put's source while the put is running (forwarding)
    ready: object = None         # CUDA event: the source's producer finished (put)
    gds: bool = False            # the nvme copy is one GPUDirect record (gds.py)
    last: object = None          # future of the last operation on this key
    lent: bool = False           # borrow()ed: the caller may be changing it
    lent_copy: object = None     # what was lent when it was not lent in place


def _as_bytes(t):
    """A contiguous uint8 view of t's elements (t must be contiguous)."""
    return t.reshape(-1).view(torch.uint8)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    """t viewed as an integer dtype of the same item size, when there is one: copies of it
    are plain bit copies and work for dtypes torch has no copy kernel for (float4, bits*)."""
    it = _SAME_SIZE_INT.get(t.element_size())
    return t if it is None or t.dtype == it else t.view(it)


def _bitcopy(dst, src, non_blocking=False):
    """dst.copy_(src), bit-exact, for any dtype; converts only when the dtypes differ."""
    if dst.dtype == src.dtype:
        _bits(dst).copy_(_bits(src), non_blocking=non_blocking)
    else:
        dst.copy_(src, non_blocking=non_blocking)


def _on(stream):
    """torch.cuda.stream(stream), or nothing when there is no copy stream (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _host_event():
    """A CUDA event the host can wait on without spinning a core (the store's workers wait
    on copies while the main thread and the optimizer need the CPU)."""
    return torch.cuda.Event(blocking=True)


def _run_copy(stream, copy):
    """Run ``copy()`` on ``stream`` (the current stream when None) and block this worker
    until the device has done it. Returns what copy() returns."""
    with _on(stream):
        out = copy()
        done = _host_event()
        done.record()
    done.synchronize()
    return out


def _copy(stream, pairs):
    """dst <- src, bit for bit, for every (dst, src) of ``pairs``: where a GPU tensor is
    involved, all queued on ``stream`` and then waited for once; plain copies otherwise."""
    if any(dst.is_cuda or src.is_cuda for dst, src in pairs):
        _run_copy(stream, lambda: [_bitcopy(dst, src, non_blocking=True) for dst, src in pairs])
    else:
        for dst, src in pairs:
            _bitcopy(dst, src)


def _copy_concatenation(dsts, srcs) -> None:
    """Copy the concatenation of the 1-D tensors ``srcs`` into that of ``dsts`` (as many
    elements), converting their dtype, wherever the two are cut."""
    i = j = di = sj = 0
    while i < len(dsts) and j < len(srcs):
        n = min(dsts[i].numel() - di, srcs[j].numel() - sj)
        dsts[i][di:di + n].copy_(srcs[j][sj:sj + n])
        di, sj = di + n, sj + n
        if di == dsts[i].numel():
            i, di = i + 1, 0
        if sj == srcs[j].numel():
            j, sj = j + 1, 0


def _wait_for(stream, event):
    """Order ``stream``'s later work after ``event``; with no copy stream, block the host."""
    if event is None:
        return
    if stream is not None:
        stream.wait_event(event)
    else:
        event.synchronize()


def _contiguous(t):
    return t if t.is_contiguous() else _bits(t).contiguous().view(t.dtype)


def default_device() -> torch.device:
    """The store's device when none is given: the current GPU, else the CPU. Read from
    torch's C API: ``torch.cuda.current_device`` may be replaced in a process that also
    runs Megatron on the CPU (megatron_snake.compat)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch._C._cuda_getDevice())
    return torch.device("cpu")


class TensorStore:
    def __init__(self, offload_dir, rank=0, host_memory_limit=2 << 30, engine="auto",
                 device=None, buffer_bytes=DEFAULT_BUFFER_BYTES, queue_depth=32, io_threads=4,
                 workers=4, chunk_bytes=1 << 20, free_space_probe=None, write_probe=None,
                 pin_memory=None, max_queued_bytes=None):
        self.run_id = uuid.uuid4().bytes
        self.device = torch.device(device) if device is not None else default_device()
        dir_kwargs = {}
        if free_space_probe is not None:
            dir_kwargs["free_space_probe"] = free_space_probe
        if write_probe is not None:
            dir_kwargs["write_probe"] = write_probe
        self.dir = RankDir(offload_dir, rank, self.run_id, **dir_kwargs)
        self._closed = False
        try:
            self.gds = None
            if engine == "gds":
                from megatron_snake.storage.gds import GdsBackend
                self.gds = GdsBackend.create()   # None (and a log line) when GDS is unavailable
                engine = "auto"
            self.engine = make_engine(engine, queue_depth, io_threads, chunk_bytes)
            self.pool = HostBufferPool(host_memory_limit, buffer_bytes, pin_memory)
        except Exception:
            self.dir.close()
            raise
        self.checksum = Checksum()
        self.seg_payload = buffer_bytes - REC_HEADER_BYTES
        self.counters = Counters()
        self._entries = {}
        self._files = {}
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
        self._cuda = torch.cuda.is_available() and self.device.type == "cuda"
        self._d2h = self._h2d = None      # copy streams (CUDA only); None = current stream
        if self._cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        self._direct_logged = False
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
        self._check_tier(tier)
        self._check_spill(key, tier, spill)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({key!r}): expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_quantized or tensor.is_sparse or tensor.layout != torch.strided:
            raise TypeError(f"put({key!r}): only dense strided tensors can be stored")
        tensor = tensor.detach()           # the store keeps bytes, never autograd history
        nbytes = tensor.numel() * tensor.element_size()
        self._reserve_queue(nbytes)
        ready = self._record_ready(tensor)
        with self._lock:
            try:
                e, old = self._new_entry(key, kind, tensor.dtype, tuple(tensor.shape), nbytes,
                                         tensor.device)
            except RuntimeError:
                self._release_queue(nbytes)
                raise
            e.source, e.ready = tensor, ready
            prev = old.last if old is not None else None
            room = None if spill is None else self._room(keep_free)
            fut = self._writers_for(tier).submit(self._run_put, e, old, prev, tensor, tier,
                                                 ready, room)
            e.last = fut
        fut.add_done_callback(lambda _: self._release_queue(nbytes))
        return Handle(fut, self)

    def put_converted(self, key, pieces, dtype, tier="nvme", kind="misc", spill=None,
                      keep_free=None):
        """``put`` of the concatenation of the 1-D CPU tensors ``pieces`` as one 1-D record
        of ``dtype``, converted as it is copied. A record that may spill (``spill``) and
        has room in the host pool now is written on the calling thread straight into its
        buffers: no converted copy is made first and nothing queues behind other puts, so
        the record is in place when this returns (new weights from an update, read next).
        Otherwise the converted copy is made here and ``put``. The pieces may change once
        this returns; the handle is done when the record is stored."""
        self._check_tier(tier)
        self._check_spill(key, tier, spill)
        numel = sum(p.numel() for p in pieces)
        nbytes = numel * dtype.itemsize
        segs = self._segments(nbytes)
        # only a record that may spill: a planned host record holds planned buffers (acquire)
        bufs = self.pool.try_acquire_resident(len(segs), self._room(keep_free)) \
            if spill is not None and segs else None
        if bufs is None:
            flat = torch.empty(numel, dtype=dtype)
            _copy_concatenation([flat], pieces)
            return self.put(key, flat, tier=tier, kind=kind, spill=spill, keep_free=keep_free)
        stored = _Done()
        with timeline.span(f"put {kind}", "store", tier=tier, bytes=nbytes):
            try:
                with timeline.span(f"host write {kind}", "host copy", bytes=nbytes):
                    _copy_concatenation([self._payload(buf, b - a).view(dtype)
                                         for buf, (_, a, b) in zip(bufs, segs)], pieces)
                with self._lock:
                    e, old = self._new_entry(key, kind, dtype, (numel,), nbytes,
                                             torch.device("cpu"))
                    e.host, e.last = bufs, stored
            except BaseException:
                self.pool.release(bufs, resident=True)
                raise
            self.counters.add("host", nwritten=nbytes, kind=kind)
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
        e = _Entry(key, kind, dtype, shape, nbytes, device, key_hash(key), self._seq)
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
        device = self.device if device is None else torch.device(device)
        if not self._cuda or device != self.device:
            return torch.empty(shape, dtype=dtype, device=device)
        caller = torch.cuda.current_stream(self.device)
        with _on(self._h2d):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        buf.record_stream(caller)
        return buf

    def get(self, key, device=None, dtype=None, out=None, new_out=False):
        """Read `key` back; wait() returns a new tensor, or `out` filled. ``new_out``: out
        is (part of) a ``new_buffer`` nothing has used yet, so the read fills it without
        waiting for the device's queued work."""
        with self._lock:
            e = self._entry(key)
            device = torch.device(device) if device is not None else (
                out.device if out is not None else e.device)
            dst = self._new_dest(e, device, dtype, out)
            result = out if out is not None else dst if dtype in (None, e.dtype) else \
                self.new_buffer(e.shape, dtype, device)
            # out belongs to the caller's stream: our copy stream waits for the work queued
            # there, then fills it; buffers of our own (or a new_out) are new
            free = self._record_ready(dst) if out is not None and not new_out else None
            # One read of e.ready, then of e.source: the put's worker clears source, then
            # ready, without taking our lock.
            ready = e.ready
            source = e.source
            # the emulated device reading a worker's host tensor: a copy over its host link
            over_link = emulated_device.has_link() and emulated_device.device_side() and \
                not isinstance(ready, emulated_device.ClockEvent)
            if source is not None and not (source.is_cuda or dst.is_cuda or over_link):
                # forwarding: the put is still writing; serve it from memory right now
                return Handle(_Done(self._run_forward(source, None, None, dst, result)), self)
            if source is not None:           # forwarding, CUDA or the link: a copy stream's
                fut = self._readers.submit(self._run_forward, source, ready, free, dst,
                                           result, over_link)
            else:
                fut = self._readers.submit(self._run_get, e, e.last, free, dst, result,
                                           emulated_device.device_side())
                e.last = _completion(fut)   # later operations wait for it, without
                # holding the tensor it returns (the caller's, freed when the caller drops it)
        return Handle(fut, self)

    def prefetch(self, key, tier="host", if_room=False, background=False, keep_free=None):
        """Ensure a copy of `key` on `tier` (host or gpu), keeping the slower copy.
        ``if_room`` (host): only if the pool has room now, as a ``put`` with ``spill``
        and ``keep_free`` (else nothing happens: a prefetch that may be skipped never
        waits or raises). ``background``: a read-ahead for later, on workers of its own
        (reads needed soon never queue behind it)."""
        self._check_tier(tier)
        if if_room and tier != "host":
            raise ValueError(f"prefetch({key!r}): if_room applies to the host tier")
        room = self._room(keep_free) if if_room else None
        return self._chain(self._background if background else self._readers, key,
                           self._run_prefetch, tier, room)

    def borrow(self, key):
        """Lend ``key``'s value to the caller to change in place. wait() returns it as 1-D
        views, one per host buffer of its record (``_segments``): of the host tier's own
        bytes when it is there (no copy), else of a new tensor read from its tier. Two
        records of the same dtype and size are cut at the same elements. End the loan
        with ``give_back`` or ``delete``; until then any other operation on the key
        raises, so nothing reads or moves the bytes while they change."""
        with self._lock:
            e = self._entry(key)
            fut = self._readers.submit(self._run_borrow, e, e.last)
            e.last, e.lent = fut, True
        return Handle(fut, self)

    def give_back(self, key, tier="nvme"):
        """End ``borrow(key)``'s loan: the lent value, as changed, replaces the stored one
        on ``tier``, as a put of it would. Lent from the host tier, it is written from
        those buffers (to the drive with no staging copy; kept in place for ``host``)."""
        self._check_tier(tier)
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.lent:
                raise RuntimeError(f"give_back({key!r}): the key is not lent (borrow it first)")
        self._reserve_queue(e.nbytes)    # bounded as the put of the new value would be
        with self._lock:
            self._seq += 1   # a new value: its records carry a new sequence number
            e.lent = False
            fut = self._writers_for(tier).submit(self._run_give_back, e, e.last, tier,
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
        self._check_tier(tier)
        return self._chain(self._writers, key, self._run_evict, tier)

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
        return [t for t, v in (("gpu", e.gpu), ("host", e.host), ("nvme", e.nvme)) if v is not None]

    def location(self, key):
        """[(path, offset, length)] of key's nvme records (for tools and tests)."""
        e = self._entry(key)
        if e.last is not None:
            e.last.result()
        f = self._files.get(e.kind)
        return [(f.path, off, ln) for off, ln in (e.nvme or [])]

    def preallocate(self, kind, nbytes):
        """Check free space and grow `kind`'s swap file to hold nbytes now."""
        self.check_capacity(nbytes)
        self._file(kind).preallocate(nbytes)

    def host_buffers_for(self, nbytes: int) -> int:
        """Host buffers a record of ``nbytes`` holds while it lives on the host tier."""
        return host_buffers_for(nbytes, self.pool.buffer_bytes)

    def check_capacity(self, nbytes_planned):
        """Raise CapacityError unless nbytes_planned fit on the offload drive (with margin)."""
        held = sum(f.size for f in self._files.values())
        return self.dir.check_capacity(nbytes_planned, held)

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
                f"{self.engine.name}{'' if self._all_direct() else ' buffered'}")

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
        self.engine.close()
        if self.gds is not None:
            self.gds.close()
        left = []   # [(path, bytes, OSError)]
        for f in self._files.values():
            nbytes = f.size
            try:
                f.close(remove=remove_files)
            except OSError as exc:
                left.append((f.path, nbytes, exc))
        self.pool.close()
        left += self.dir.close()
        if left:
            raise self.dir.left_behind(left)

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

    def _writers_for(self, tier):
        """The workers of a write to ``tier``: memory, or the drive (a write to host that
        spills for want of room goes to the drive from the memory writers)."""
        return self._writers if tier == "nvme" else self._memory_writers

    def _check_tier(self, tier):
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; one of {TIERS}")

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
        return all(f.direct for f in self._files.values())

    def _file(self, kind):
        f = self._files.get(kind)
        if f is None:
            with self._lock:
                f = self._files.get(kind)
                if f is None:
                    path = os.path.join(self.dir.path, f"{kind}.swap")
                    f = SwapFile(path, kind, self.run_id, self.engine, self.checksum,
                                 block_size=max(4096, os.statvfs(self.dir.path).f_bsize))
                    if not f.direct and not self._direct_logged:
                        self._direct_logged = True
                        log.warning("offload dir %s: the file system does not support O_DIRECT "
                                    "(tmpfs?); using buffered I/O (page cache)", self.dir.path)
                    self._files[kind] = f
        return f

    def _record_ready(self, tensor):
        """An event after the work queued so far on ``tensor``'s stream (the caller's); on
        the emulated device of a benchmark, the point on its clock when ``tensor`` is the
        device's (emulated_device.py)."""
        if tensor.is_cuda:
            ev = _host_event()
            ev.record(torch.cuda.current_stream(tensor.device))
            return ev
        return emulated_device.active().event() if emulated_device.device_side() else None

    def _new_dest(self, e, device, dtype, out):
        """The tensor the bytes land in: out itself when it is contiguous with the stored
        dtype, else a new contiguous tensor (out is then filled with copy_)."""
        if out is not None:
            if tuple(out.shape) != e.shape:
                raise ValueError(f"get({e.key!r}): out has shape {tuple(out.shape)}, stored {e.shape}")
            if out.dtype == e.dtype and out.is_contiguous() and out.device == device:
                return out
        return self.new_buffer(e.shape, e.dtype, device)

    def _finish(self, dst, result):
        """Fill ``result`` (out, or the converted dtype) from dst on the copy stream: it is
        complete when this worker returns, whichever stream the caller is on."""
        if result is not dst:
            _copy(self._h2d, [(result, dst)])
        return result

    def _wait_prev(self, prev):
        if prev is not None:
            prev.result()

    def _segments(self, nbytes):
        n = self.seg_payload
        return [(i, a, min(a + n, nbytes)) for i, a in enumerate(range(0, nbytes, n))]

    # ---------------------------------------------------------------- copies

    @staticmethod
    def _payload(buf, n):
        """The first n payload bytes of a host buffer (after its record header)."""
        return buf.tensor[REC_HEADER_BYTES:REC_HEADER_BYTES + n]

    def _across(self, pairs, direction: str, device_side: bool, span: str | None = None):
        """dst <- src for ``pairs``, a copy between host memory and the compute device when
        ``device_side``: on the emulated device's host link when it has one (its time, no
        CPU: emulated_device.link_copy), else on the copy stream of ``direction`` ("h2d",
        "d2h"). ``span``: the timeline's name for the copy when this machine makes it."""
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        on_link = emulated_device.link_copy(nbytes, direction) if device_side else None
        if on_link is not None:
            timeline.record(f"link {direction}", "link", *on_link, thread=f"link {direction}",
                            bytes=nbytes, seconds=on_link[1] - on_link[0])
            return
        stream = self._h2d if direction == "h2d" else self._d2h
        with timeline.span(span, "host copy", bytes=nbytes) if span else contextlib.nullcontext():
            _copy(stream, pairs)

    def _contiguous_source(self, tensor, ready):
        if ready is not None:
            _wait_for(self._d2h, ready)
            if tensor.is_cuda:
                return _run_copy(self._d2h, lambda: _contiguous(tensor))
        return _contiguous(tensor)

    # ---------------------------------------------------------------- tier writers

    def _write_gpu(self, e, src):
        if src.is_cuda or self.device.type == "cuda":
            def copy():
                out = torch.empty(e.shape, dtype=e.dtype, device=self.device)
                _bitcopy(out, src, non_blocking=True)
                return out
            copy = _run_copy(self._h2d, copy)
        else:
            copy = torch.empty(e.shape, dtype=e.dtype, device=self.device)
            _bitcopy(copy, src)
        e.gpu = copy
        self.counters.add("gpu", nwritten=e.nbytes, kind=e.kind)

    def _host_buffers(self, e, segs, room):
        """Resident host buffers for e's segments. ``room`` None: wait for them (raise
        HostMemoryError when they could never fit); else only if they fit now with
        ``room`` buffers left free, else None."""
        if room is None:
            return self.pool.acquire(len(segs), resident=True, what=f"key {e.key!r}") \
                if segs else []
        bufs = self.pool.try_acquire_resident(len(segs), room)
        if bufs is None:
            self.counters.add_spilled()
        return bufs

    def _write_host(self, e, src_bytes, room=None, from_device=False):
        """Copy e to host buffers (``room``: as ``_host_buffers``). False when it was not
        written (no room)."""
        segs = self._segments(e.nbytes)
        bufs = self._host_buffers(e, segs, room)
        if bufs is None:
            return False
        self._write_host_buffers(e, src_bytes, segs, bufs, from_device)
        return True

    def _write_host_buffers(self, e, src_bytes, segs, bufs, from_device=False):
        try:
            self._across([(self._payload(buf, b - a), src_bytes[a:b])
                          for buf, (_, a, b) in zip(bufs, segs)], "d2h", from_device,
                         span=f"host write {e.kind}")
        except BaseException:
            self.pool.release(bufs, resident=True)
            raise
        e.host, e.host_sealed = bufs, False
        self.counters.add("host", nwritten=e.nbytes, kind=e.kind)

    def _seal(self, e, buf, seg, n):
        crc = self.checksum(buf.addr + REC_HEADER_BYTES, n)
        write_record_header(buf.addr, self.run_id, e.khash, e.seq, seg, n, crc)

    def _write_nvme(self, e, src_bytes=None, from_device=False):
        """Write e to its swap file, from src_bytes (staging buffers) or from e.host."""
        with timeline.span(f"drive write {e.kind}", "drive", bytes=e.nbytes):
            self._write_nvme_records(e, src_bytes, from_device)

    def _write_nvme_records(self, e, src_bytes, from_device):
        f = self._file(e.kind)
        segs = self._segments(e.nbytes)
        extents, pending = [], []      # pending: (request, buffer or None)
        loose = None                   # a staging buffer not yet in pending
        try:
            for seg, a, b in segs:
                n = b - a
                if src_bytes is None:
                    buf = e.host[seg]
                    if not e.host_sealed:
                        self._seal(e, buf, seg, n)
                else:
                    buf = loose = self._staging(pending)
                    self._across([(self._payload(buf, n), src_bytes[a:b])], "d2h", from_device)
                    self._seal(e, buf, seg, n)
                off, length = f.allocate(REC_HEADER_BYTES + n)
                extents.append((off, length))
                req = self.engine.write(f.fd, f.path, buf.addr, length, off)
                self.counters.inflight(+1)
                pending.append((req, loose))
                loose = None
            if src_bytes is None:
                e.host_sealed = True
            while pending:
                self._reap(pending)
        except BaseException:
            if loose is not None:
                self.pool.release([loose])
            self._drain(pending)
            for off, length in extents:
                f.free(off, length)
            raise
        e.nvme = extents
        self.counters.add("nvme", nwritten=e.nbytes, requests=len(segs), kind=e.kind)

    def _staging(self, pending):
        """A staging buffer; while none is free, finish this operation's oldest request
        first (so two operations can never hold each other's buffers)."""
        while True:
            buf = self.pool.try_acquire()
            if buf is not None:
                return buf
            if pending:
                self._reap(pending)
            else:
                return self.pool.acquire(1)[0]

    def _reap(self, pending, on_done=None):
        req, buf = pending.pop(0)
        try:
            req.wait()
            if on_done is not None:
                on_done(buf)
        finally:
            self.counters.inflight(-1)
            if buf is not None:
                self.pool.release([buf])

    def _drain(self, pending):
        for req, buf in pending:
            try:
                req.wait()
            except OffloadIOError:
                pass
            finally:
                self.counters.inflight(-1)
                if buf is not None:
                    self.pool.release([buf])
        pending.clear()

    def _write_nvme_gds(self, e, src_bytes):
        """One GPUDirect record: header block through the host engine, payload by kvikio."""
        from megatron_snake.storage.gds import HEADER_BLOCK, gpu_checksum

        f = self._file(e.kind)
        off, length = f.allocate(HEADER_BLOCK + e.nbytes)
        buf, = self.pool.acquire(1)
        try:
            with _on(self._d2h):       # off the compute stream
                crc = gpu_checksum(src_bytes)
            write_record_header(buf.addr, self.run_id, e.khash, e.seq, 0, e.nbytes, crc)
            req = self.engine.write(f.fd, f.path, buf.addr, HEADER_BLOCK, off)
            try:
                self.gds.write(f.path, src_bytes, off + HEADER_BLOCK)
            finally:
                req.wait()
        except BaseException:
            f.free(off, length)
            raise
        finally:
            self.pool.release([buf])
        e.nvme, e.gds = [(off, length)], True
        self.counters.add("nvme", nwritten=e.nbytes, requests=2, kind=e.kind)

    def _read_nvme_gds(self, e, dst_bytes):
        from megatron_snake.storage.gds import HEADER_BLOCK, gpu_checksum

        f = self._files[e.kind]
        (off, _), = e.nvme
        buf, = self.pool.acquire(1)
        try:
            try:
                self.engine.read(f.fd, f.path, buf.addr, HEADER_BLOCK, off).wait()
            except OffloadIOError as exc:
                if exc.short:
                    raise IntegrityError(f"key {e.key!r}: record in {f.path} is truncated: {exc}") from exc
                raise
            crc = check_record_header(buf.addr, self.run_id, e.khash, e.seq, 0, e.nbytes, e.key, f.path)
        finally:
            self.pool.release([buf])
        n = self.gds.read(f.path, dst_bytes, off + HEADER_BLOCK)
        if n != e.nbytes:
            raise IntegrityError(f"key {e.key!r}: record in {f.path} is truncated "
                                 f"(GDS read {n} of {e.nbytes} bytes)")
        with _on(self._h2d):           # off the compute stream
            got = gpu_checksum(dst_bytes)
        if got != crc:
            raise IntegrityError(f"key {e.key!r}: record in {f.path} is corrupt: GPU checksum "
                                 f"mismatch (stored {crc:x}, computed {got:x})")
        self.counters.add("nvme", nread=e.nbytes, requests=2, kind=e.kind)

    # ---------------------------------------------------------------- readers

    def _read_nvme(self, e, dst_bytes=None, into_host=None, to_device=False):
        """Read e's records; verify each; copy payloads to dst_bytes (``to_device``: the
        compute device's) or keep them in the given host buffers (into_host: list of
        buffers, one per segment)."""
        with timeline.span(f"drive read {e.kind}", "drive", bytes=e.nbytes):
            self._read_nvme_records(e, dst_bytes, into_host, to_device)

    def _read_nvme_records(self, e, dst_bytes, into_host, to_device):
        f = self._files[e.kind]
        segs = self._segments(e.nbytes)
        pending = []   # (request, staging buffer or None, seg, a, b, host buffer)

        def finish(item):
            req, buf, seg, a, b, hbuf = item
            try:
                try:
                    req.wait()
                except OffloadIOError as exc:
                    if exc.short:
                        raise IntegrityError(
                            f"key {e.key!r}: record {seg} in {f.path} is truncated: {exc}. "
                            "The data was NOT returned.") from exc
                    raise
                target = hbuf if hbuf is not None else buf
                verify_record(target.addr, self.run_id, e.khash, e.seq, seg, b - a,
                              self.checksum, e.key, f.path)
                if hbuf is None:
                    self._across([(dst_bytes[a:b], self._payload(buf, b - a))], "h2d",
                                 to_device)
            finally:
                self.counters.inflight(-1)
                if buf is not None:
                    self.pool.release([buf])

        try:
            for (seg, a, b), (off, length) in zip(segs, e.nvme):
                if into_host is not None:
                    hbuf, buf = into_host[seg], None
                else:
                    hbuf = None
                    buf = self.pool.try_acquire()
                    while buf is None:
                        if pending:
                            finish(pending.pop(0))
                            buf = self.pool.try_acquire()
                        else:
                            buf = self.pool.acquire(1)[0]
                try:
                    req = self.engine.read(f.fd, f.path, (hbuf or buf).addr, length, off)
                except BaseException:
                    if buf is not None:
                        self.pool.release([buf])
                    raise
                self.counters.inflight(+1)
                pending.append((req, buf, seg, a, b, hbuf))
            while pending:
                finish(pending.pop(0))
        except BaseException:
            self._drain([(req, buf) for req, buf, *_ in pending])
            raise
        self.counters.add("nvme", nread=e.nbytes, requests=len(segs), kind=e.kind)

    def _read_into(self, e, dst, to_device=False):
        """Fill the contiguous tensor dst (stored dtype/shape) from the fastest tier
        (``to_device``: dst is the compute device's)."""
        if e.nbytes == 0:
            return
        if e.gpu is not None:
            _copy(self._h2d, [(dst, e.gpu)])
            self.counters.add("gpu", nread=e.nbytes, kind=e.kind)
            return
        dst_bytes = _as_bytes(dst)
        if e.host is not None:
            self._across([(dst_bytes[a:b], self._payload(buf, b - a))
                          for buf, (_, a, b) in zip(e.host, self._segments(e.nbytes))],
                         "h2d", to_device, span=f"host read {e.kind}")
            self.counters.add("host", nread=e.nbytes, kind=e.kind)
            return
        if e.nvme is not None and e.gds:
            if dst.is_cuda:
                self._read_nvme_gds(e, dst_bytes)
            else:
                with _on(self._h2d):
                    tmp = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
                self._read_nvme_gds(e, tmp)
                _copy(self._h2d, [(dst_bytes, tmp)])
            return
        if e.nvme is not None:
            self._read_nvme(e, dst_bytes=dst_bytes, to_device=to_device)
            return
        raise KeyError(f"key {e.key!r} has no copy on any tier (deleted?)")

    # ---------------------------------------------------------------- operations (workers)

    def _free_entry(self, e):
        if e.host is not None:
            self.pool.release(e.host, resident=True)
            e.host = None
        self._drop_nvme(e)
        e.gpu = None

    def _drop_nvme(self, e):
        """Free e's swap-file extents (the drive's copy)."""
        if e.nvme is not None:
            f = self._files[e.kind]
            for off, length in e.nvme:
                f.free(off, length)
            e.nvme, e.gds = None, False

    def _run_put(self, e, old, prev, tensor, tier, ready, room=None):
        with timeline.span(f"put {e.kind}", "store", tier=tier, bytes=e.nbytes):
            self._put(e, old, prev, tensor, tier, ready, room)

    def _put(self, e, old, prev, tensor, tier, ready, room):
        try:
            try:
                self._wait_prev(prev)
            except Exception:  # noqa: BLE001 - the old value's failure is its own handle's
                pass
            if old is not None:
                self._free_entry(old)
            src = self._contiguous_source(tensor, ready)
            # the emulated device's tensors are the ones put with an event on its clock
            from_device = isinstance(ready, emulated_device.ClockEvent)
            if tier == "gpu":
                self._write_gpu(e, src)
                return
            if e.nbytes == 0:
                if tier == "host":
                    e.host = []
                else:
                    e.nvme = []
                return
            if tier == "host":
                written = self._write_host(e, _as_bytes(src), room=room,
                                           from_device=from_device)
                if written:
                    return   # else it may spill (room given) and there was none: the drive
            if self.gds is not None and src.is_cuda:
                self._write_nvme_gds(e, _as_bytes(src))
            else:
                self._write_nvme(e, src_bytes=_as_bytes(src), from_device=from_device)
        finally:
            e.source = e.ready = None

    def _run_forward(self, source, ready, free, dst, result, over_link=False):
        for ev in (ready, free):      # events exist only where a device tensor is involved
            _wait_for(self._h2d, ev)
        self._across([(dst, source)], "h2d", over_link)
        return self._finish(dst, result)

    def _run_get(self, e, prev, free, dst, result, to_device):
        with timeline.span(f"get {e.kind}", "store", bytes=e.nbytes):
            return self._get(e, prev, free, dst, result, to_device)

    def _get(self, e, prev, free, dst, result, to_device):
        self._wait_prev(prev)
        if e.gds and e.gpu is None and e.host is None and dst.is_cuda:
            # kvikio writes into dst outside any stream's order: wait here, on the host,
            # until the caller's stream is done with dst
            _wait_for(None, free)
        else:
            _wait_for(self._h2d, free)
        self._read_into(e, dst, to_device)
        return self._finish(dst, result)

    def _run_prefetch(self, e, prev, tier, room=None):
        with timeline.span(f"prefetch {e.kind}", "store", tier=tier, bytes=e.nbytes):
            self._prefetch(e, prev, tier, room)

    def _prefetch(self, e, prev, tier, room):
        self._wait_prev(prev)
        if tier == "nvme" or (tier == "gpu" and e.gpu is not None) or (tier == "host" and e.host is not None):
            if tier == "nvme" and e.nvme is None:
                self._run_evict(e, None, "nvme", drop=False)
            return
        if tier == "gpu":
            with _on(self._h2d):      # allocated for the copy stream
                dst = torch.empty(e.shape, dtype=e.dtype, device=self.device)
            self._read_into(e, dst)
            e.gpu = dst
            self.counters.add("gpu", nwritten=e.nbytes, kind=e.kind)
            return
        # host
        if e.gpu is not None or e.gds:
            src = e.gpu
            if src is None:
                with _on(self._h2d):
                    src = torch.empty(e.shape, dtype=e.dtype, device=self.device)
                self._read_into(e, src)
            self._write_host(e, _as_bytes(src), room=room)
            return
        segs = self._segments(e.nbytes)
        bufs = self._host_buffers(e, segs, room)
        if bufs is None:
            return
        try:
            self._read_nvme(e, into_host=bufs)
        except BaseException:
            self.pool.release(bufs, resident=True)
            raise
        e.host, e.host_sealed = bufs, True
        self.counters.add("host", nwritten=e.nbytes, kind=e.kind)

    def _run_evict(self, e, prev, tier, drop=True):
        self._wait_prev(prev)
        if tier == "gpu":
            return
        if tier == "host" and e.host is None:
            if e.gpu is None:
                return       # already below host: nothing faster to drop
            self._write_host(e, _as_bytes(e.gpu))
        if tier == "nvme" and e.nvme is None:
            if e.nbytes == 0:
                e.nvme = []
            elif e.host is not None:
                self._write_nvme(e)
            elif self.gds is not None and e.gpu.is_cuda:
                self._write_nvme_gds(e, _as_bytes(e.gpu))
            else:
                self._write_nvme(e, src_bytes=_as_bytes(e.gpu))
        if drop:
            e.gpu = None
            if tier == "nvme" and e.host is not None:
                self.pool.release(e.host, resident=True)
                e.host = None

    def _run_borrow(self, e, prev):
        with timeline.span(f"borrow {e.kind}", "store", bytes=e.nbytes):
            self._wait_prev(prev)
            size = torch.tensor([], dtype=e.dtype).element_size()
            segs = self._segments(e.nbytes)
            in_place = e.nbytes and self.seg_payload % size == 0
            if in_place and e.host is None and e.gpu is None and not e.gds:
                # Read into host buffers when the pool has room, as a prefetch would: lent
                # in place and written back from them, with no copy either way (copies
                # take the cores the drive's I/O shares).
                self._prefetch(e, None, "host", self._room(None))
            if e.host is not None and in_place:
                self.counters.add("host", nread=e.nbytes, kind=e.kind)
                return [self._payload(buf, b - a).view(e.dtype)
                        for buf, (_, a, b) in zip(e.host, segs)]
            flat = torch.empty(e.nbytes // size, dtype=e.dtype)
            self._read_into(e, flat.view(e.shape))
            e.lent_copy = flat
            return [flat[a // size:b // size] for _, a, b in segs]

    def _run_give_back(self, e, prev, tier, seq):
        with timeline.span(f"give back {e.kind}", "store", tier=tier, bytes=e.nbytes):
            self._give_back(e, prev, tier, seq)

    def _give_back(self, e, prev, tier, seq):
        self._wait_prev(prev)   # the borrow: if it failed, the stored value stays as it was
        e.seq = seq
        e.gpu = None                     # copies of the value before the change
        self._drop_nvme(e)
        copy, e.lent_copy = e.lent_copy, None
        if copy is None and tier in ("host", "nvme") and e.nbytes:
            e.host_sealed = False        # changed in place: sealed again when written
            if tier == "host":
                self.counters.add("host", nwritten=e.nbytes, kind=e.kind)
            else:
                self._write_nvme(e)
                self.pool.release(e.host, resident=True)
                e.host = None
            return
        if copy is None:                 # lent in place, stored on the device (or empty)
            copy = torch.empty(e.nbytes, dtype=torch.uint8)
            if e.nbytes:
                _copy(None, [(copy[a:b], self._payload(buf, b - a))
                             for buf, (_, a, b) in zip(e.host, self._segments(e.nbytes))])
        self._free_entry(e)
        self._put(e, None, None, copy.view(e.dtype).view(e.shape), tier, None, None)

    def _run_delete(self, e, prev):
        try:
            self._wait_prev(prev)
        except Exception:  # noqa: BLE001
            pass
        self._free_entry(e)
