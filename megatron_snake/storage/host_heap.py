"""How freed host memory leaves the process (glibc only; elsewhere these do nothing).

An offloaded run must give back what a unit frees, or its resident memory grows to the sum
of everything it ever held (measured: 2.1 GiB instead of 0.55 GiB for a 201M-parameter
model trained unit by unit). Returning every block of 1 MiB or more at once (a low mmap
threshold) bounds it, but then every activation-sized tensor is a fresh mapping: each use
page-faults and zeroes its pages, each free unmaps them (measured: a CPU step 1.2-1.5x
slower, a third of the run in system time). So blocks up to glibc's mmap ceiling stay in
its heap, where they are reused, and a thread gives the heap's free pages back to the OS
once the process has grown by a small retention since the last time
(``keep_heap_trimmed``); larger blocks are mapped and unmapped.
"""

import ctypes
import ctypes.util
import functools
import os
import threading
from contextlib import contextmanager

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4   # glibc mallopt parameters
MMAP_CEILING = 32 << 20          # glibc's largest mmap threshold on 64-bit
HEAP_RETAIN_BYTES = 128 << 20    # growth kept for reuse before the heap is trimmed
TRIM_CHECK_PERIOD_S = 0.05

# the heap is the process's, so is this: the least resident memory seen since the last
# trim, and whether freed memory is kept (keep_freed_host_memory)
_low_water, _keep = 0, False


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return libc


def bound_host_heap(mmap_threshold: int = MMAP_CEILING) -> bool:
    """Serve blocks of ``mmap_threshold`` bytes or more with their own mappings (returned
    to the OS when freed) and fix the threshold there (glibc otherwise raises it as large
    blocks are freed, keeping them). False where the C library is not glibc."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, HEAP_RETAIN_BYTES))


def keep_freed_host_memory() -> bool:
    """Never return freed memory to the OS, as a GPU's caching allocator keeps device
    memory (tools/bench_overlap.py's emulated device computes in host memory): no mappings
    of their own for large blocks, no trimming. False where the C library is not glibc."""
    global _keep
    libc = _libc()
    _keep = libc is not None and bool(libc.mallopt(_M_MMAP_MAX, 0)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))   # -1: never trim
    return _keep


def resident_bytes() -> int:
    """This process's resident memory now (the OS's count, as RSS)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim_host_heap(retain_bytes: int = HEAP_RETAIN_BYTES) -> bool:
    """Give the heap's free pages back to the OS once the process has grown more than
    ``retain_bytes`` above its low-water mark since the last trim (what it grew by is live
    memory or freed blocks kept for reuse); True if it trimmed. Costs one read of /proc
    when it does not."""
    global _low_water
    libc = _libc()
    if libc is None or _keep:
        return False
    now = resident_bytes()
    _low_water = min(_low_water, now) if _low_water else now
    if now - _low_water <= retain_bytes:
        return False
    release_free_heap()
    return True


def release_free_heap() -> None:
    """Give every free page of the heap back to the OS now, and make this the low-water
    mark ``trim_host_heap`` measures growth from."""
    global _low_water
    libc = _libc()
    if libc is not None and not _keep:
        libc.malloc_trim(0)
        _low_water = resident_bytes()


@contextmanager
def keep_heap_trimmed(retain_bytes: int = HEAP_RETAIN_BYTES,
                      period_s: float = TRIM_CHECK_PERIOD_S):
    """While open, a thread trims the heap whenever the process has grown more than
    ``retain_bytes`` since the last trim: wherever memory is freed (the build, a step, a
    checkpoint), what is not reused within a little goes back to the OS."""
    stop = threading.Event()

    def watch():
        while not stop.wait(period_s):
            trim_host_heap(retain_bytes)

    release_free_heap()
    thread = threading.Thread(target=watch, name="snake-heap-trim", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
