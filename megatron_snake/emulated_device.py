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


_active: DeviceClock | None = None


def active() -> DeviceClock | None:
    """The clock while a block runs ``emulating()``, else None."""
    return _active


def host_read() -> None:
    """The host reads a device value here (``.item()``, ``.to("cpu")`` of a CUDA tensor):
    wait for the emulated device's queue, as the read would wait for the GPU's."""
    if _active is not None:
        _active.synchronize()


@contextmanager
def emulating():
    """``with emulating() as clock:`` the device compute of the block is the clock's."""
    global _active
    if _active is not None:
        raise RuntimeError("an emulated device is already running")
    _active = DeviceClock()
    try:
        yield _active
    finally:
        _active = None
