"""The copy strategy: how the tiers' bytes cross between host memory and the compute
device, and what a copy waits for. The tiers (tiers/) are handed one and never ask where
the device is.

``Copies`` is a real device's: on a GPU every copy involving device memory is queued on
one of two copy streams of the store's (``"h2d"``, ``"d2h"``) and the worker blocks on an
event until the device has made it; the caller's stream is respected with events (a put
waits for the work queued before it, a get's ``out`` for its readers). On a CPU they are
plain copies. The emulated device of tools/bench_overlap.py is another strategy around
this one (``emulated_device.EmulatedCopies``): its events are points on its clock and its
copies go over its host link.

``HostTraffic`` counts the bytes of host memory the run's passes read and write (the
strategy's copies, the drive's I/O and checksums, the optimizer's update), the figure
docs/overlap.md's "Each byte once" sets a minimum for.

The rest are the bit-exact copy helpers the tiers share.
"""

import contextlib
import threading

import torch

import megatron_snake.timeline as timeline


def as_bytes(t):
    """A contiguous uint8 view of t's elements (t must be contiguous)."""
    return t.reshape(-1).view(torch.uint8)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """t viewed as an integer dtype of the same item size, when there is one: copies of it
    are plain bit copies and work for dtypes torch has no copy kernel for (float4, bits*)."""
    it = _SAME_SIZE_INT.get(t.element_size())
    return t if it is None or t.dtype == it else t.view(it)


def bitcopy(dst, src, non_blocking=False):
    """dst.copy_(src), bit-exact, for any dtype; converts only when the dtypes differ."""
    if dst.dtype == src.dtype:
        bits(dst).copy_(bits(src), non_blocking=non_blocking)
    else:
        dst.copy_(src, non_blocking=non_blocking)


def contiguous(t):
    return t if t.is_contiguous() else bits(t).contiguous().view(t.dtype)


@contextlib.contextmanager
def on_stream(stream):
    """Make ``stream`` this thread's current stream on its device for the block (nothing
    when there is no copy stream: CPU). Not ``torch.cuda.stream``: that asks
    ``torch.cuda.current_device``, which a process also running Megatron on the CPU has
    replaced (megatron_snake.compat); every call here names the stream's own device."""
    if stream is None:
        yield
        return
    device = torch._C._cuda_getDevice()   # set_stream makes the stream's device current
    previous = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)
        torch._C._cuda_setDevice(device)


def empty_on(device: torch.device, shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on ``device`` itself, past any torch-function mode: in a process that
    also runs Megatron on the CPU, the thread that does maps device="cuda" to the CPU
    (megatron_snake.compat), and the store's buffers must still be on its GPU."""
    with torch._C.DisableTorchFunction():
        return torch.empty(shape, dtype=dtype, device=device)


def host_event():
    """A CUDA event the host can wait on without spinning a core (the store's workers wait
    on copies while the main thread and the optimizer need the CPU)."""
    return torch.cuda.Event(blocking=True)


def run_copy(stream, copy):
    """Run ``copy()`` on ``stream`` (the current stream when None) and block this worker
    until the device has done it. Returns what copy() returns."""
    with on_stream(stream):
        out = copy()
        done = host_event()
        done.record()
    done.synchronize()
    return out


def copy_pairs(stream, pairs):
    """dst <- src, bit for bit, for every (dst, src) of ``pairs``: where a GPU tensor is
    involved, all queued on ``stream`` and then waited for once; plain copies otherwise."""
    if any(dst.is_cuda or src.is_cuda for dst, src in pairs):
        run_copy(stream, lambda: [bitcopy(dst, src, non_blocking=True) for dst, src in pairs])
    else:
        for dst, src in pairs:
            bitcopy(dst, src)


def copy_concatenation(dsts, srcs) -> None:
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


def wait_for(stream, event):
    """Order ``stream``'s later work after ``event``; with no copy stream, block the host."""
    if event is None:
        return
    if stream is not None:
        stream.wait_event(event)
    else:
        event.synchronize()


def default_device() -> torch.device:
    """The store's device when none is given: the current GPU, else the CPU. Read from
    torch's C API: ``torch.cuda.current_device`` may be replaced in a process that also
    runs Megatron on the CPU (megatron_snake.compat)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch._C._cuda_getDevice())
    return torch.device("cpu")


class HostTraffic:
    """Bytes of host memory read and written, by pass: ``update`` (the optimizer's kernel:
    each stream it reads or writes), ``copy`` (a copy within host memory: both sides),
    ``crossing`` (a copy between host memory and the device: the host side; on a machine
    without a GPU or an emulated device, the device's memory is host memory and its copies
    are ``copy``), ``drive`` (the drive's DMA into and out of the host buffers) and
    ``checksum`` (the drive records' checksums, written and verified)."""

    PASSES = ("update", "copy", "crossing", "drive", "checksum")

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = dict.fromkeys(self.PASSES, 0)

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[kind] += int(nbytes)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.bytes)

    def per_parameter_step(self, since: dict, params: int, steps: int = 1) -> dict:
        """Bytes per parameter per step, by pass, since the snapshot ``since``."""
        now = self.snapshot()
        return {k: (now[k] - since[k]) / params / steps for k in now}

    def pairs(self, pairs, device_dst: bool = False, device_src: bool = False) -> None:
        """Count a copy of ``pairs`` (dst, src): a side is host memory unless it is a GPU
        tensor or the caller says it is the device's (an emulated device's tensors)."""
        for dst, src in pairs:
            dst_host = not (dst.is_cuda or device_dst)
            src_host = not (src.is_cuda or device_src)
            if not (dst_host or src_host):
                continue
            nbytes = (dst.numel() * dst.element_size() if dst_host else 0) + \
                (src.numel() * src.element_size() if src_host else 0)
            self.add("copy" if dst_host and src_host else "crossing", nbytes)


def describe_per_parameter(per: dict) -> str:
    """Bytes per parameter per step by pass (``HostTraffic.per_parameter_step``) in words:
    the total first, then each pass that moved any."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in per.items() if v)
    return f"{sum(per.values()):.1f} B per parameter per step ({parts or 'none'})"


class Copies:
    """A real device's copies (see the module's docstring). ``direction`` names a copy
    stream: ``"h2d"`` (into the device), ``"d2h"`` (out of it), or None (the current one;
    on the host, a wait blocks it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = torch.cuda.is_available() and device.type == "cuda"
        self.d2h = self.h2d = None      # copy streams (CUDA only); None = current stream
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        self._streams = {"h2d": self.h2d, "d2h": self.d2h, None: None}
        self.traffic = HostTraffic()

    # ---------------------------------------------------------------- the caller's thread

    def caller_event(self, tensor):
        """An event after the work queued so far on ``tensor``'s stream (the caller's), or
        None when no device work can be pending on it."""
        if tensor.is_cuda:
            ev = host_event()
            ev.record(torch.cuda.current_stream(tensor.device))
            return ev
        return None

    def device_side(self) -> bool:
        """Whether the calling thread's CPU tensors are the device's (only an emulated
        device's are: a real one's are told by ``is_cuda``)."""
        return False

    def over_link(self, ready) -> bool:
        """Whether the device reads a put's source still being written (its event
        ``ready``) over a host link, as a copy stream would, rather than as a CPU copy."""
        return False

    # ---------------------------------------------------------------- a worker's

    def from_device(self, ready) -> bool:
        """Whether a put's source is the device's memory (its ``caller_event`` was
        ``ready``) where ``is_cuda`` does not tell (an emulated device's)."""
        return False

    def wait(self, event, direction) -> None:
        """Order the copies of ``direction`` after ``event`` (None: block this thread)."""
        wait_for(self._streams[direction], event)

    def copy(self, pairs, direction=None) -> None:
        """dst <- src for ``pairs`` on the copy stream of ``direction``, done on return."""
        self.traffic.pairs(pairs)
        copy_pairs(self._streams[direction], pairs)

    def within_device(self, pairs, direction=None) -> None:
        """dst <- src for ``pairs``, both the compute device's memory (the device tier's
        records and the device's buffers), as ``copy``: on a GPU no host memory is touched;
        on a machine without one the device's memory is host memory, and counted so."""
        self.copy(pairs, direction)

    def convert_within_device(self, flat, pieces) -> None:
        """``flat`` <- the concatenation of the 1-D ``pieces``, converted to its dtype, all
        the compute device's memory (a cast on the device: no host memory touched)."""
        copy_concatenation([flat], pieces)

    def run(self, fn, direction):
        """``fn()`` on the copy stream of ``direction``, done on return; what it returns."""
        return run_copy(self._streams[direction], fn)

    def on(self, direction):
        """A context running the device work inside it on the copy stream of ``direction``."""
        return on_stream(self._streams[direction])

    def across(self, pairs, direction: str, device_side: bool, span: str | None = None):
        """dst <- src for ``pairs``, a copy between host memory and the compute device when
        ``device_side`` (here as any other: the copy stream of ``direction``). ``span``: the
        timeline's name for the copy when this machine makes it."""
        stream = self._streams[direction]
        self.traffic.pairs(pairs, device_dst=device_side and direction == "h2d",
                           device_src=device_side and direction == "d2h")
        if span is None:
            copy_pairs(stream, pairs)
            return
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        with timeline.span(span, "host copy", bytes=nbytes):
            copy_pairs(stream, pairs)

    def contiguous_source(self, tensor, ready):
        """A put's source as a contiguous tensor, once its producer is done (``ready``)."""
        if ready is not None:
            wait_for(self.d2h, ready)
            if tensor.is_cuda:
                return run_copy(self.d2h, lambda: contiguous(tensor))
        return contiguous(tensor)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on the device for a copy stream's copies (made on the "h2d" one)."""
        with on_stream(self.h2d):
            return empty_on(self.device, shape, dtype)

    def new_buffer(self, shape, dtype: torch.dtype, device=None) -> torch.Tensor:
        """``TensorStore.new_buffer``: on a GPU made on the copy stream and marked as used
        by the caller's stream."""
        device = self.device if device is None else torch.device(device)
        if not self.cuda or device != self.device:
            return torch.empty(shape, dtype=dtype, device=device)
        caller = torch.cuda.current_stream(self.device)
        with on_stream(self.h2d):
            buf = empty_on(self.device, shape, dtype)
        buf.record_stream(caller)
        return buf
