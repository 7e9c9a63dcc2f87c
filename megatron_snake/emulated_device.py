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

With a memory rate (``emulating(memory_bytes_per_s=...)``) what the device does in its
own memory is the device's work too, at that rate (a fused kernel's, streaming it), and
its bytes are not moved (nothing the emulated device computes reads them): the optimizer's
update of a layout whose state is the device's (the device share, run by the thread that
entered the block) and the cast of its new weights are kernels on the clock
(``memory_work``); a copy within the device's memory (``EmulatedCopies.within_device``:
a device-tier record read into a device buffer, a device value put onto the device tier)
is time on a copy engine of its own. Without one, that work runs on this machine's CPU,
the update and the cast on the training thread, holding up the schedule as no GPU kernel
would; the copies are made, with no host memory traffic counted.

The store sees all of this through one object, ``EmulatedCopies``: the copy strategy its
tiers are handed (storage/copies.py), which is the store's own until a block runs
``emulating()``.

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
_memory_bytes_per_s: float | None = None
_memory_copies: DeviceClock | None = None   # the copy engine within the device's memory
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


def memory_work(nbytes: int) -> tuple[float, float] | None:
    """Queue a kernel that streams ``nbytes`` of the device's memory on the clock, where a
    memory rate is set and the calling thread's tensors are the device's; returns its
    (start, end) host times, or None where the caller does the work itself."""
    rate = _memory_bytes_per_s
    if rate is None or not device_side():
        return None
    return _active.launch(nbytes / rate)


def host_read() -> None:
    """The host reads a device value here (``.item()``, ``.to("cpu")`` of a CUDA tensor):
    wait for the emulated device's queue, as the read would wait for the GPU's."""
    if _active is not None:
        _active.synchronize()


class EmulatedCopies:
    """The emulated device as a copy strategy (the interface of storage/copies.py's
    ``Copies``) around the store's own, ``base``. While a block runs ``emulating()``, the
    tensors of the thread that entered it are the device's (``device_side``): the event of
    such a put's source or get's ``out`` is a point on the clock, and with a host link a
    copy between the device and host memory is time on the link's engine for its direction
    and no CPU (``record(name, cat, start, end, **args)`` gets its span: the timeline's
    ``record``, which this module may not import). Outside such a block, and for all the
    rest, it is ``base``."""

    device_side = staticmethod(device_side)

    def __init__(self, base, record=None):
        self._base, self._record = base, record
        self._base_across = base.across

    def __getattr__(self, name):
        # what this strategy leaves to the base: looked up there once, then an attribute
        if name.startswith("__") or name in ("_base", "_record", "_base_across"):
            raise AttributeError(name)
        value = getattr(self._base, name)
        setattr(self, name, value)
        return value

    def caller_event(self, tensor):
        if tensor.is_cuda:
            return self._base.caller_event(tensor)
        return active().event() if device_side() else None

    def within_device(self, pairs, direction=None) -> None:
        """A copy within the device's memory, no host memory traffic, as on a GPU: with a
        memory rate, time on its copy engine (read and written) that the caller waits for,
        as a worker waits for its copy stream; else made here, the values right."""
        if _active is None:
            self._base.within_device(pairs, direction)
            return
        engine = _memory_copies
        if engine is not None:
            nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
            ClockEvent(engine.launch(2 * nbytes / _memory_bytes_per_s)[1]).synchronize()
            return
        for dst, src in pairs:
            dst.copy_(src)

    def convert_within_device(self, flat, pieces) -> None:
        """``flat`` <- the concatenation of ``pieces``, converted, all the device's memory:
        with a memory rate a kernel on the clock (``memory_work``), else made here."""
        nbytes = flat.numel() * flat.element_size() + sum(
            p.numel() * p.element_size() for p in pieces)
        span = memory_work(nbytes)   # None outside emulating() or without a memory rate
        if span is None:
            self._base.convert_within_device(flat, pieces)
        elif self._record is not None:
            self._record("device cast", "device", *span, thread="device",
                         seconds=span[1] - span[0], bytes=nbytes)

    def over_link(self, ready) -> bool:
        return _link is not None and device_side() and not isinstance(ready, ClockEvent)

    def from_device(self, ready) -> bool:
        return isinstance(ready, ClockEvent)

    def across(self, pairs, direction: str, device_side: bool, span: str | None = None):
        if device_side:
            nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
            on_link = link_copy(nbytes, direction)
            if on_link is not None:
                self.traffic.pairs(pairs, device_dst=direction == "h2d",
                                   device_src=direction == "d2h")
                if self._record is not None:
                    self._record(f"link {direction}", "link", *on_link,
                                 thread=f"link {direction}", bytes=nbytes,
                                 seconds=on_link[1] - on_link[0])
                return
        self._base_across(pairs, direction, device_side, span)


@contextmanager
def emulating(link_bytes_per_s: float | None = None,
              memory_bytes_per_s: float | None = None):
    """``with emulating() as clock:`` the device compute of the block is the clock's; with
    ``link_bytes_per_s`` its copies to and from host memory are a host link's, and with
    ``memory_bytes_per_s`` the device share's updates are its memory's (``memory_work``)."""
    global _active, _link, _device_thread, _memory_bytes_per_s, _memory_copies
    if _active is not None:
        raise RuntimeError("an emulated device is already running")
    if memory_bytes_per_s is not None and memory_bytes_per_s <= 0:
        raise ValueError(f"the emulated device's memory needs a rate > 0 bytes/s, "
                         f"got {memory_bytes_per_s}")
    link = HostLink(link_bytes_per_s) if link_bytes_per_s else None
    _active, _link, _device_thread = DeviceClock(), link, threading.current_thread()
    _memory_bytes_per_s = memory_bytes_per_s
    _memory_copies = DeviceClock() if memory_bytes_per_s else None
    try:
        yield _active
    finally:
        _active = _link = _device_thread = _memory_bytes_per_s = _memory_copies = None
