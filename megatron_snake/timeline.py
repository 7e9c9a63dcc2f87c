"""A timeline of training steps (``--snake-trace FILE``): one row per thread, showing the
compute of each (unit, micro-batch), each store worker's puts and gets with the drive and
host copies inside them, the optimizer worker's updates, collectives and the waits.

Written as a Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev, or draw
it with tools/plot_timeline.py); ``tools/bench_overlap.py`` reads the same spans to say
where a step's time goes. A span is also a ``torch.profiler`` range named ``snake/<name>``,
so a profiler trace (tools/gpu_trace.py) carries the same labels. While nothing records, a
span costs a global lookup and the profiler's range. Every layer records into it, so it
imports nothing of this package's.

Times are host wall-clock: exact for CPU work and the emulated device of
tools/bench_overlap.py; on a GPU a compute span is its launch, not its run (the device's
own timeline is the profiler's).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import torch


class Timeline:
    """Spans recorded from every thread between ``start`` and ``stop``."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.spans: list[dict] = []   # {name, cat, thread, start, end, args}: seconds from t0
        self.stopped = False          # spans ending later (on a worker) are not kept
        self._lock = threading.Lock()

    def add(self, name: str, cat: str, start: float, end: float, args: dict,
            thread: str | None = None) -> None:
        span = {"name": name, "cat": cat, "thread": thread or threading.current_thread().name,
                "start": start - self.t0, "end": end - self.t0, "args": args}
        with self._lock:
            if not self.stopped:
                self.spans.append(span)

    def chrome_trace(self) -> dict:
        """The spans in Chrome's trace-event format (complete events, microseconds)."""
        with self._lock:
            spans = list(self.spans)
        threads = sorted({s["thread"] for s in spans}, key=_thread_order)
        tid = {name: i for i, name in enumerate(threads)}
        pid = os.getpid()
        events = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid[name],
                   "args": {"name": name}} for name in threads]
        events += [{"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": i,
                    "args": {"sort_index": i}} for i in range(len(threads))]
        events += [{"ph": "X", "name": s["name"], "cat": s["cat"], "pid": pid,
                    "tid": tid[s["thread"]], "ts": s["start"] * 1e6,
                    "dur": (s["end"] - s["start"]) * 1e6, "args": s["args"]}
                   for s in spans]
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _thread_order(name: str):
    """The emulated device and its host link, the main thread, then compute-adjacent
    workers, then the store's pools."""
    for rank, prefix in enumerate(("device", "link", "MainThread", "snake-adamw",
                                   "snake-store-read", "snake-store-ahead", "snake-store-host",
                                   "snake-store-write")):
        if name.startswith(prefix):
            return rank, name
    return 8, name


_recording: Timeline | None = None


@contextmanager
def span(name: str, cat: str, **args):
    """Record ``name`` (category ``cat``: compute, sweep, weights, store, drive, host copy,
    optimizer, cpu adamw, collective, wait) on the calling thread's row while a timeline
    is recording. ``args`` (bytes, tier, ...) go into the trace."""
    timeline = _recording
    with torch.profiler.record_function(f"snake/{name}"):
        if timeline is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            timeline.add(name, cat, start, time.perf_counter(), args)


def record(name: str, cat: str, start: float, end: float, thread: str, **args) -> None:
    """Record a span known by its times (perf_counter) on row ``thread``: work that runs
    apart from the host's threads, as the emulated device's (emulated_device.py)."""
    timeline = _recording
    if timeline is not None:
        timeline.add(name, cat, start, end, args, thread=thread)


def start() -> Timeline:
    """Start recording into a new timeline (one at a time per process)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("a timeline is already recording")
    _recording = Timeline()
    return _recording


def stop() -> Timeline | None:
    """Stop recording; the timeline recorded (None if none was)."""
    global _recording
    timeline, _recording = _recording, None
    if timeline is not None:
        with timeline._lock:
            timeline.stopped = True
    return timeline


@contextmanager
def recording():
    """``with recording() as timeline:`` records the block's spans."""
    timeline = start()
    try:
        yield timeline
    finally:
        stop()
