"""``--profile``: a torch profiler trace of iterations ``--profile-step-start`` (counted from
0, as in Megatron-LM) up to ``--profile-step-end``, on ``--profile-ranks``, written to
``--tensorboard-dir`` as ``rank<N>.iter<start>-<end>.pt.trace.json`` (TensorBoard's profiler
plugin, chrome://tracing and ui.perfetto.dev read it). It records CPU activity, and CUDA
kernels on a GPU; megatron_snake's own spans (sweeps, units, store waits) appear by name.
"""

from __future__ import annotations

import os

import torch

from megatron_snake.storage.safe_files import create_file
from megatron_snake.training.tracking import own_dir


class StepProfiler:
    def __init__(self, args, device: torch.device, rank: int):
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.folder, self.rank = args.tensorboard_dir, rank
        self.enabled = bool(args.profile) and rank in args.profile_ranks
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._activities, self._prof = activities, None
        if self.enabled:   # this rank's own --tensorboard-dir (node-local ones included)
            own_dir(self.folder, "--tensorboard-dir")

    def check_start(self, done: int, log) -> None:
        """A run resumed past --profile-step-start profiles nothing: say so."""
        if self.enabled and done > self.start:
            log(f"> --profile: nothing is profiled: this run resumes at iteration {done}, "
                f"after --profile-step-start {self.start}")

    def before_step(self, done: int) -> None:
        """``done``: iterations completed before the one about to run."""
        if self.enabled and done == self.start and self._prof is None:
            self._prof = torch.profiler.profile(activities=self._activities,
                                                record_shapes=True)
            self._prof.start()

    def after_step(self, done: int) -> str | None:
        """Stops at ``--profile-step-end`` (or the run's end, ``close``); returns the trace
        file's path when it was written now."""
        if self._prof is None or done < self.end:
            return None
        return self.close(done)

    def close(self, done: int) -> str | None:
        if self._prof is None:
            return None
        self._prof.stop()
        path = os.path.join(self.folder,
                            f"rank{self.rank}.iter{self.start}-{done}.pt.trace.json")
        part = path + ".part"
        os.close(create_file(part, what="--profile trace"))   # ours, never a planted link
        self._prof.export_chrome_trace(part)
        os.replace(part, path)
        self._prof = None
        return path
