"""When to stop early: Megatron-LM's ``--exit-signal-handler`` and ``--exit-duration-in-mins``.

A scheduler preempts a job with SIGTERM and a grace period. With ``--exit-signal-handler``
the signal only sets a flag; the iteration in progress finishes, and then every rank agrees
(one all-reduce) to save and leave. The caller exits normally, so the offload files are
removed on the way out and the process ends with status 0.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

from megatron_snake.errors import FlagError


class ExitConditions:
    """The early-exit conditions of one run; ``check`` is called after each iteration."""

    def __init__(self, *, signal_handler: bool, duration_minutes: float | None,
                 device: torch.device, started: float | None = None):
        self.duration_s = None if duration_minutes is None else 60.0 * duration_minutes
        self.device = device
        self.started = time.monotonic() if started is None else started
        self._received = None
        self._handling = signal_handler
        if signal_handler:
            if threading.current_thread() is not threading.main_thread():
                raise FlagError("--exit-signal-handler: Python delivers signals to the main "
                                "thread only; call pretrain from it, or drop the flag")
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._received = signal.Signals(signum).name

    def check(self) -> str | None:
        """Why the run must stop now (the same answer on every rank), or None."""
        if not self._handling and self.duration_s is None:
            return None      # nothing to agree on: no collective per iteration
        local = [self._received is not None,
                 self.duration_s is not None and
                 time.monotonic() - self.started > self.duration_s]
        flags = torch.tensor(local, dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # one rank's signal or clock stops them all at the same iteration
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, out_of_time = flags.tolist()
        if signalled:
            return (f"{self._received or 'SIGTERM'} received "
                    f"{'' if self._received else 'by another rank '}(--exit-signal-handler)")
        if out_of_time:
            return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        return None

    def close(self) -> None:
        """Give SIGTERM back its previous handler."""
        if self._handling:
            signal.signal(signal.SIGTERM, self._previous)
            self._handling = False
