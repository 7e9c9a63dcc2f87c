"""The emulated device's clock: what makes tools/bench_overlap.py's device run apart from
the host, as a GPU does.

A GPU runs the kernels the host queued, in order, while the host goes on; the host (or a
copy stream) waits only where it needs the device's result or must not overwrite what the
device still reads, through events. The emulated device (models/emulated_compute.py)
keeps that contract with a clock instead of kernels: launching work of ``s`` seconds moves
the time the device is free to ``max(now, free) + s`` and returns at once; an event is the
free time when it is recorded, and waiting on it sleeps until then. The tensor store records
such an event wherever it records a CUDA event on the caller's stream (a put's source, a
get's destination), so its workers copy a unit's output only once the device would have
computed it and fill a buffer only once the device would be done with it: the waits of a
GPU run, at the same places.

The device's memory is host memory here, so which tensors are the device's is told by the
thread: those the thread that entered ``emulating()`` (the one running the schedule, which
on a GPU launches the kernels) puts and gets; the optimizer's and the store's workers hold
host tensors, as they do on a GPU. With a host link (``emulating(link_bytes_per_s=...)``)
a copy between the device and host memory is what a GPU's copy engines make of it: time on
one engine per direction, ``bytes / rate``, and no CPU, as DMA takes none; its bytes are
not moved (the emulated device computes nothing from them). Without one, such copies are
CPU copies on this machine's cores.

Only a benchmark turns it on (``emulating``); it imports nothing of this package's, so
every layer may ask ``active()``.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class ClockEvent:
    """A point on the device's clock: the host time at which the work queued before it
    is done."""

    __slots__ = ("at",)

    def __init__(self, at: float):
        self.at = at

    def synchronize(self) -> None:
        delay = self.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class DeviceClock:
    """One in-order device queue (a GPU's compute stream), as host times."""

    def __init__(self):
        self.free_at = 0.0   # perf_counter time when the queued work is done
        self._lock = threading.Lock()

    def launch(self, seconds: float) -> tuple[float, float]:
        """Queue ``seconds`` of work; returns when it starts and ends (host times)."""
        with self._lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + seconds
            return start, self.free_at

    def event(self) -> ClockEvent:
        """An event after the work queued so far."""
        return ClockEvent(self.free_at)

    def synchronize(self) -> None:
        """Wait until the queued work is done (torch.cuda.synchronize)."""
        self.event().synchronize()


class HostLink:
    """The device's link to host memory (PCIe): one copy engine per direction."""

    def __init__(self, bytes_per_s: float):
        if bytes_per_s <= 0:
            raise ValueError(f"the emulated host link needs a rate > 0 bytes/s, "
                             f"got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self.engines = {"h2d": DeviceClock(), "d2h": DeviceClock()}


_active: DeviceClock | None = None
_link: HostLink | None = None
_device_thread: threading.Thread | None = None


def active() -> DeviceClock | None:
    """The clock while a block runs ``emulating()``, else None."""
    return _active


def device_side() -> bool:
    """Whether the calling thread's tensors are the emulated device's (see above)."""
    return _active is not None and threading.current_thread() is _device_thread


def has_link() -> bool:
    """Whether the device's copies to and from host memory are an emulated host link's."""
    return _link is not None


def link_copy(nbytes: int, direction: str) -> tuple[float, float] | None:
    """A copy of ``nbytes`` between the device and host memory (``direction`` "h2d" or
    "d2h") on the emulated host link: queued on that direction's engine, and the caller
    waits until it is done, as a store worker waits for its copy stream. Returns its
    (start, end) host times; None without a link (the caller copies the bytes itself)."""
    link = _link
    if link is None:
        return None
    start, end = link.engines[direction].launch(nbytes / link.bytes_per_s)
    ClockEvent(end).synchronize()
    return start, end


def host_read() -> None:
    """The host reads a device value here (``.item()``, ``.to("cpu")`` of a CUDA tensor):
    wait for the emulated device's queue, as the read would wait for the GPU's."""
    if _active is not None:
        _active.synchronize()


@contextmanager
def emulating(link_bytes_per_s: float | None = None):
    """``with emulating() as clock:`` the device compute of the block is the clock's, and
    with ``link_bytes_per_s`` its copies to and from host memory are a host link's."""
    global _active, _link, _device_thread
    if _active is not None:
        raise RuntimeError("an emulated device is already running")
    link = HostLink(link_bytes_per_s) if link_bytes_per_s else None
    _active, _link, _device_thread = DeviceClock(), link, threading.current_thread()
    try:
        yield _active
    finally:
        _active = _link = _device_thread = None
