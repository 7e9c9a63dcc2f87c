"""The store's counters: bytes read and written per tier (and per kind of state), drive
requests, time callers were blocked, the drive's queue depth. The tiers count their own
traffic here, under their names."""

import threading
from dataclasses import dataclass, field

from megatron_snake.storage.sizes import TIERS


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
