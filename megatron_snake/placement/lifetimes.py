"""What the placement planner (plan.py) is given: a compute timeline and tensor lifetimes.

The schedule reports, during its first iterations (`--snake-profile-iters`), each compute
interval it runs (one per unit x micro-batch x sweep, say) and which tracked tensors each
interval produces and uses:

    rec = LifetimeRecorder()
    rec.begin(("F", unit, mb))           # before the unit runs
    rec.used(("ckpt", unit, mb))          # it reads this checkpoint
    rec.produced(("ckpt", unit + 1, mb), out.nbytes)
    rec.end(("F", unit, mb))
    rec.step()                            # at the end of each profiled iteration
    timeline, lifetimes = rec.finish()

Events are identified by their position in the timeline; a lifetime says in which event a
tensor is produced and in which later events it is used. On a GPU an event's duration is the
device's: CUDA events recorded on the compute stream at begin and end, read once at the end
of each iteration (the host's clock would time kernel launches, not kernels).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    """One compute interval: its name, how long it runs and the memory it needs while it
    runs besides the tracked tensors (weights of the unit, transient activations)."""

    name: object
    seconds: float
    working_bytes: int = 0


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)

    def __len__(self):
        return len(self.events)

    def bounds(self) -> list[float]:
        """Start time of every event, then the end of the last: len(events) + 1 values."""
        out, t = [0.0], 0.0
        for e in self.events:
            t += e.seconds
            out.append(t)
        return out


@dataclass(frozen=True)
class TensorLifetime:
    """A tracked tensor: produced in event `produced_at`, read in the (later) events `uses`."""

    key: object
    nbytes: int
    produced_at: int
    uses: tuple[int, ...] = ()

    @property
    def accesses(self) -> tuple[int, ...]:
        return (self.produced_at, *self.uses)


def validate(lifetimes: list[TensorLifetime], timeline: Timeline) -> None:
    """Raise ValueError unless every lifetime is consistent with the timeline."""
    n, seen = len(timeline), set()
    for lt in lifetimes:
        if lt.key in seen:
            raise ValueError(f"tensor {lt.key!r} appears twice in the lifetimes")
        seen.add(lt.key)
        if lt.nbytes < 0:
            raise ValueError(f"tensor {lt.key!r}: negative size {lt.nbytes}")
        acc = lt.accesses
        if not all(0 <= a < n for a in acc):
            raise ValueError(f"tensor {lt.key!r}: event index out of range 0..{n - 1}: {acc}")
        if any(b <= a for a, b in zip(acc, acc[1:])):
            raise ValueError(f"tensor {lt.key!r}: uses must follow production, strictly "
                             f"increasing: {acc}")
    for e in timeline.events:
        if e.seconds < 0 or e.working_bytes < 0:
            raise ValueError(f"event {e.name!r}: negative duration or working set")


class _HostClock:
    """Durations on the host's clock (the compute device is the CPU)."""

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return end - start


class _CudaClock:
    """Durations on the device: timing events on the current (compute) stream, read after
    the iteration's work is done, so profiling adds no host synchronisation per event."""

    def mark(self):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class LifetimeRecorder:
    """Records one or more iterations; `finish` returns the timeline (durations averaged over
    the iterations after the first, which is warm-up, when there are several with the same
    events) and the lifetimes of the last iteration. ``device``: the compute device, whose
    clock times the events (a CUDA device's own, else the host's)."""

    def __init__(self, device=None):
        cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
        self._clock = _CudaClock() if cuda else _HostClock()
        self._iters: list[tuple[list[Event], dict]] = []
        self._reset()

    def _reset(self):
        self._events: list[Event] = []
        self._marks: list = []      # (start, end) clock marks of each event, read at step()
        self._tensors: dict = {}    # key -> [nbytes, produced_at, [uses]]
        self._open = None           # (name, start mark)

    def begin(self, name) -> None:
        if self._open is not None:
            raise RuntimeError(f"begin({name!r}) while event {self._open[0]!r} is open")
        self._open = (name, self._clock.mark())

    def end(self, name, working_bytes: int = 0) -> None:
        if self._open is None or self._open[0] != name:
            raise RuntimeError(f"end({name!r}) does not match the open event "
                               f"{None if self._open is None else self._open[0]!r}")
        self._marks.append((self._open[1], self._clock.mark()))
        self._events.append(Event(name, 0.0, int(working_bytes)))  # duration read at step()
        self._open = None

    def _current(self, what, key) -> int:
        if self._open is None:
            raise RuntimeError(f"{what}({key!r}) outside begin()/end()")
        return len(self._events)   # the index the open event will get

    def produced(self, key, nbytes: int) -> None:
        idx = self._current("produced", key)
        if key in self._tensors:
            raise ValueError(f"tensor {key!r} produced twice in one iteration")
        self._tensors[key] = [int(nbytes), idx, []]

    def used(self, key) -> None:
        idx = self._current("used", key)
        rec = self._tensors.get(key)
        if rec is None:
            raise KeyError(f"used({key!r}): this tensor was never produced in this iteration")
        if idx != rec[1] and (not rec[2] or rec[2][-1] != idx):   # one use per event
            rec[2].append(idx)

    def step(self) -> None:
        """End of one profiled iteration."""
        if self._open is not None:
            raise RuntimeError(f"step() while event {self._open[0]!r} is open")
        if self._events:
            events = [Event(e.name, self._clock.seconds(start, end), e.working_bytes)
                      for e, (start, end) in zip(self._events, self._marks)]
            self._iters.append((events, self._tensors))
        self._reset()

    def finish(self) -> tuple[Timeline, list[TensorLifetime]]:
        self.step()
        if not self._iters:
            raise ValueError("nothing was recorded")
        events, tensors = self._iters[-1]
        names = [e.name for e in events]
        same = [ev for ev, _ in self._iters if [e.name for e in ev] == names]
        if len(same) > 1:
            same = same[1:]        # the first iteration is warm-up
        timeline = Timeline([
            Event(e.name, statistics.fmean(it[i].seconds for it in same),
                  max(it[i].working_bytes for it in same))
            for i, e in enumerate(events)])
        lifetimes = [TensorLifetime(k, nb, p, tuple(u)) for k, (nb, p, u) in tensors.items()]
        return timeline, lifetimes
