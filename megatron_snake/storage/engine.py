"""The I/O engine: native (csrc/engine.c: io_uring or a pthread pool, bound by
csrc/snake_aio.c) or a pure-Python fallback (threads + os.preadv/os.pwritev), behind one
small interface.

    eng = make_engine("auto")                      # logs which engine it picked and why
    req = eng.write(fd, path, addr, nbytes, offset) # async; addr is a raw address
    req.wait()                                     # raises OffloadIOError(path, offset, length, errno)

Requests are split into `chunk_bytes` pieces with at most `queue_depth` pieces in flight;
submitting blocks (back-pressure) when the queue is full.
"""

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from megatron_snake.storage.errors import OffloadIOError

log = logging.getLogger("megatron_snake.storage")

READ, WRITE = 0, 1
_OP_NAME = {READ: "read", WRITE: "write"}

try:  # built by setup.py; absent when the build failed or was skipped
    from megatron_snake import _snake_aio as _native
    _NATIVE_IMPORT_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the build
    _native = None
    _NATIVE_IMPORT_ERROR = exc


def native_available():
    return _native is not None


class Request:
    """One submitted read or write. wait() returns None or raises OffloadIOError."""

    __slots__ = ("_engine", "_handle", "op", "path", "offset", "length", "_result")

    def __init__(self, engine, handle, op, path, offset, length):
        self._engine, self._handle = engine, handle
        self.op, self.path, self.offset, self.length = op, path, offset, length
        self._result = None

    def done(self):
        return self._result is not None or self._engine._done(self._handle)

    def wait(self):
        if self._result is None:
            self._result = self._engine._wait(self._handle)
        err, err_off, nbytes_done = self._result
        if err != 0:
            detail = "" if err > 0 else (
                f"end of file after {nbytes_done} of {self.length} bytes (file truncated?)")
            raise OffloadIOError(_OP_NAME[self.op], self.path, err_off if err > 0 else self.offset,
                                 self.length, err, detail)


class _Engine:
    name = "?"

    def read(self, fd, path, addr, nbytes, offset):
        return Request(self, self._submit(READ, fd, addr, nbytes, offset), READ, path, offset, nbytes)

    def write(self, fd, path, addr, nbytes, offset):
        return Request(self, self._submit(WRITE, fd, addr, nbytes, offset), WRITE, path, offset, nbytes)


class NativeEngine(_Engine):
    def __init__(self, backend="uring", queue_depth=32, threads=4, chunk_bytes=1 << 20):
        self._e = _native.Engine(backend, queue_depth, threads, chunk_bytes)
        self.backend = backend
        self.queue_depth, self.chunk_bytes = queue_depth, chunk_bytes
        self.name = f"native-{backend}"

    def _submit(self, op, fd, addr, nbytes, offset):
        return self._e.submit(op, fd, addr, nbytes, offset)

    def _wait(self, handle):
        return self._e.wait(handle)

    def _done(self, handle):
        return self._e.done(handle)

    @property
    def inflight(self):
        return self._e.inflight

    def close(self):
        self._e.close()


class PythonEngine(_Engine):
    """Fallback: a thread pool running os.preadv/os.pwritev (they release the GIL)."""

    name = "python"

    def __init__(self, queue_depth=32, threads=4, chunk_bytes=1 << 20):
        self.queue_depth, self.chunk_bytes = queue_depth, chunk_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="snake-pyio")
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._lock = threading.Lock()
        self._inflight = 0

    @property
    def inflight(self):
        return self._inflight

    def _chunk(self, op, fd, addr, nbytes, offset):
        try:
            view = memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")
            done = 0
            while done < nbytes:
                try:
                    if op == READ:
                        n = os.preadv(fd, [view[done:]], offset + done)
                    else:
                        n = os.pwritev(fd, [view[done:]], offset + done)
                except InterruptedError:
                    continue
                except OSError as exc:
                    return (exc.errno or 5, offset + done, done)
                if n == 0:
                    return (-1, offset + done, done)
                done += n
            return (0, 0, done)
        finally:
            with self._lock:
                self._inflight -= 1
            self._slots.release()

    def _submit(self, op, fd, addr, nbytes, offset):
        futures, pos = [], 0
        while pos < nbytes:
            n = min(self.chunk_bytes, nbytes - pos)
            self._slots.acquire()
            with self._lock:
                self._inflight += 1
            futures.append(self._pool.submit(self._chunk, op, fd, addr + pos, n, offset + pos))
            pos += n
        return futures

    def _wait(self, futures):
        err, err_off, total = 0, 0, 0
        for f in futures:
            e, off, n = f.result()
            total += n
            if e != 0 and err == 0:
                err, err_off = e, off
        return (err, err_off, total)

    def _done(self, futures):
        return all(f.done() for f in futures)

    def close(self):
        self._pool.shutdown(wait=True)


def make_engine(kind="auto", queue_depth=32, threads=4, chunk_bytes=1 << 20):
    """kind: auto | native | uring | threads | python. Logs the engine it picked."""
    if kind not in ("auto", "native", "uring", "threads", "python"):
        raise ValueError(f"unknown I/O engine {kind!r} (auto|native|uring|threads|python)")
    if kind == "python":
        log.info("offload I/O engine: pure-Python fallback (asked for)")
        return PythonEngine(queue_depth, threads, chunk_bytes)
    if _native is None:
        if kind != "auto":
            raise RuntimeError(
                f"I/O engine {kind!r} asked for but megatron_snake._snake_aio is not built "
                f"({_NATIVE_IMPORT_ERROR}); install liburing-dev and a C compiler, then "
                "`pip install -e . --no-build-isolation`")
        log.warning("offload I/O engine: native engine not built (%s); using the pure-Python "
                    "fallback (threads + os.preadv/os.pwritev), expect lower bandwidth",
                    _NATIVE_IMPORT_ERROR)
        return PythonEngine(queue_depth, threads, chunk_bytes)
    if kind in ("auto", "native", "uring"):
        try:
            eng = NativeEngine("uring", queue_depth, threads, chunk_bytes)
            log.info("offload I/O engine: native io_uring (queue depth %d, %d KiB requests)",
                     queue_depth, chunk_bytes >> 10)
            return eng
        except OSError as exc:
            if kind == "uring":
                raise
            log.warning("offload I/O engine: io_uring unavailable (%s); using the native "
                        "thread pool", exc)
    # a blocking thread keeps one request in flight: queue_depth threads match the ring
    nthreads = max(threads, queue_depth)
    eng = NativeEngine("threads", queue_depth, nthreads, chunk_bytes)
    log.info("offload I/O engine: native thread pool (%d threads = queue depth)", nthreads)
    return eng


def crc32c_native():
    """The native crc32c function (addr, nbytes, crc=0) or None when not built."""
    return None if _native is None else _native.crc32c
