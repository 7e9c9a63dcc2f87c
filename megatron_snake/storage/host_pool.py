"""Host buffer pool: a fixed number of page-aligned (pinned when CUDA is present) buffers
under a hard byte limit (--snake-host-memory-limit). Callers wait for a free buffer; memory
never grows past the limit. Buffers are created on first use and then reused forever.

Two uses share the pool:
  staging   a buffer held while one record moves between a tensor and a swap file;
            always given back when that I/O completes, so waiting for one always ends;
  resident  buffers that hold a key on the `host` tier until it is evicted or deleted.
A resident request that could never be met (the limit minus what is already resident,
keeping one buffer for staging) raises HostMemoryError at once instead of waiting forever.
"""

import os
import threading
import time

import torch

import megatron_snake.timeline as timeline
from megatron_snake.storage.errors import HostMemoryError
from megatron_snake.storage.sizes import size

PAGE = 4096
DEFAULT_BUFFER_BYTES = 8 << 20
# --snake-host-memory-limit's default (``default_pool_bytes``): at most this much, and
# room for this many buffers of drive staging besides the state's records: the store's
# drive I/O runs on 4 read, 4 write and 2 read-ahead workers, each holding a staging
# buffer per record segment in flight, so 16 let them all move with a few pipelining.
DEFAULT_POOL_CAP_BYTES = 2 << 30
STAGING_BUFFERS = 16


def default_pool_bytes(state_buffers: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES, *,
                       cap_bytes: int = DEFAULT_POOL_CAP_BYTES) -> int:
    """``--snake-host-memory-limit``'s default, the one rule for it: room for
    ``state_buffers`` (the host buffers the run's state may hold: its host tiers, and what
    may spill to host memory; the caller counts them, ``preflight.host_pool_default``)
    and ``STAGING_BUFFERS`` for the drive's I/O, at most ``cap_bytes``, in whole buffers
    and never fewer than the 2 a pool needs (``check_host_memory_limit``)."""
    cap = max(2, int(cap_bytes) // buffer_bytes)
    return max(2, min(cap, int(state_buffers) + STAGING_BUFFERS)) * buffer_bytes


def physical_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory_limit(limit_bytes, buffer_bytes=DEFAULT_BUFFER_BYTES, *,
                            physical_bytes: int | None = None) -> int:
    """``--snake-host-memory-limit`` must hold at least two buffers (one resident or
    staging, one always free for staging) and, for a pool on a machine with
    ``physical_bytes`` of memory, fit in that memory (a larger limit bounds nothing: the
    pool would be killed or swapped out before it reached it); returns how many it holds."""
    count = int(limit_bytes) // buffer_bytes
    if count < 2:
        raise HostMemoryError(
            f"--snake-host-memory-limit {limit_bytes} bytes holds fewer than 2 host buffers "
            f"of {buffer_bytes >> 20} MiB; give at least {2 * buffer_bytes >> 20}MiB")
    if physical_bytes is not None and limit_bytes > physical_bytes:
        raise HostMemoryError(
            f"--snake-host-memory-limit {size(limit_bytes)} is more than this machine's "
            f"physical memory ({size(physical_bytes)}); give at most that, less what the "
            "rest of the run needs")
    return count


class HostBuffer:
    """One page-aligned buffer: .tensor (uint8, nbytes long), .addr (its address)."""

    __slots__ = ("index", "tensor", "addr", "nbytes", "_base", "planned")

    def __init__(self, index, nbytes, pin):
        self.index, self.nbytes = index, nbytes
        self.planned = False   # held by a record the placement planned for the host tier
        # pinned: cudaHostAlloc memory is page aligned and torch's host allocator rounds
        # sizes up to a power of two, so ask for exactly nbytes (a power of two by default)
        self._base = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pin else None
        if self._base is None or self._base.data_ptr() % PAGE:
            self._base = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
        if not pin:
            # resident from the start, as pinned memory is: the first copy or update into a
            # buffer does not also fault its pages in (about 60 ms per 37 MB here), which
            # would land on whatever work happens to use the buffer first
            self._base.zero_()
        skip = (-self._base.data_ptr()) % PAGE
        self.tensor = self._base[skip:skip + nbytes]
        self.addr = self.tensor.data_ptr()
        assert self.addr % PAGE == 0


class HostBufferPool:
    def __init__(self, limit_bytes, buffer_bytes=DEFAULT_BUFFER_BYTES, pin=None):
        if buffer_bytes % PAGE:
            raise ValueError(f"host buffer size {buffer_bytes} is not a multiple of {PAGE}")
        count = check_host_memory_limit(limit_bytes, buffer_bytes,
                                        physical_bytes=physical_memory_bytes())
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self.limit_bytes, self.buffer_bytes, self.count = int(limit_bytes), buffer_bytes, count
        self._free = []          # created, not in use
        self._created = 0
        self._resident = 0
        # Buffers the placement planned for host-tier records (weights or optimizer state
        # on ``host``, unit inputs planned there): those not yet taken are kept from
        # records that may go to the drive instead (``try_acquire_resident``).
        self.reserved = 0
        self._planned_in_use = 0
        self._cv = threading.Condition()
        # counters
        self.peak_in_use = 0
        self.waits = 0
        self.wait_seconds = 0.0

    @property
    def in_use(self):
        return self._created - len(self._free)

    @property
    def allocated_bytes(self):
        """Host memory the pool holds now (never above limit_bytes, plus one page per buffer)."""
        return self._created * self.buffer_bytes

    @property
    def resident(self):
        return self._resident

    def _take(self, n):
        out = []
        for _ in range(n):
            if self._free:
                out.append(self._free.pop())
            else:
                out.append(HostBuffer(self._created, self.buffer_bytes, self.pin))
                self._created += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return out

    def _available(self):
        return len(self._free) + (self.count - self._created)

    def try_acquire(self):
        """One staging buffer, or None at once when none is free."""
        with self._cv:
            return self._take(1)[0] if self._available() >= 1 else None

    def acquire(self, n=1, resident=False, what=""):
        """n buffers, waiting (never failing) while other I/O holds them."""
        with self._cv:
            if resident and n > self.count - self._resident - 1:
                raise HostMemoryError(
                    f"{what or 'a host-tier tensor'} needs {n} host buffers of "
                    f"{self.buffer_bytes >> 20} MiB but only {self.count - self._resident - 1} "
                    f"of {self.count} can ever be free (--snake-host-memory-limit "
                    f"{self.limit_bytes} bytes, {self._resident} resident); evict to nvme or "
                    "raise --snake-host-memory-limit")
            if n > self.count:
                raise HostMemoryError(f"{n} buffers asked, the pool has {self.count}")
            if self._available() < n:
                self.waits += 1
                t0 = time.perf_counter()
                with timeline.span("pool.wait", "wait", buffers=n):
                    while self._available() < n:
                        self._cv.wait()
                self.wait_seconds += time.perf_counter() - t0
            out = self._take(n)
            if resident:
                self._resident += n
                self._planned_in_use += n
                for buf in out:
                    buf.planned = True
            return out

    def unclaimed_reservation(self) -> int:
        """Planned host buffers not taken yet: what the planned records may still need."""
        return max(0, self.reserved - self._planned_in_use)

    def try_acquire_resident(self, n: int, keep_free: int):
        """n resident buffers if they fit now with ``keep_free`` buffers still free for
        staging (created or not), besides the planned buffers not taken yet, else None at
        once: a record that may go to a slower tier instead (``TensorStore.put``'s
        ``spill``) never waits for host memory, nor takes what the plan counts on."""
        with self._cv:
            # at least one buffer stays free: the drive's I/O needs one to make progress
            if self._available() - n - self.unclaimed_reservation() < max(1, keep_free):
                return None
            self._resident += n
            return self._take(n)

    def release(self, buffers, resident=False):
        with self._cv:
            for buf in buffers:
                if buf.planned:
                    buf.planned = False
                    self._planned_in_use -= 1
            self._free.extend(buffers)
            if resident:
                self._resident -= len(buffers)
            self._cv.notify_all()

    def close(self):
        with self._cv:
            self._free.clear()
            self._created = 0
