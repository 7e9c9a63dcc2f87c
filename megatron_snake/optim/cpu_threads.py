"""How many CPU threads the host optimizer's update runs on (``--snake-optimizer-threads``).

The update runs on its own worker thread, and torch runs each of its kernels on an OpenMP
team of that thread's intra-op threads. By default torch gives every thread a team as large
as the machine, so while an update runs its team holds every core, and the training thread
(which launches the GPU's kernels from Python) and the store's workers take cores from it:
a team member that loses its core holds up the whole team at the kernel's end, and the
training thread launches late, so the device waits for the host. DeepSpeed's ZenFlow gives
its optimizer half the cores (``pt_reserved_cores_perc`` 0.5) for the same reason, and so
does the default here. ``tools/bench_optimizer_threads.py`` measures both sides of it.

torch's thread count is kept per thread (the OpenMP team size of the thread that calls
``torch.set_num_threads``); the call also sets the default that threads started later take,
which ``limit_this_thread`` puts back, so only the optimizer's worker changes.
"""

from __future__ import annotations

import os
import threading

import torch

from megatron_snake.errors import FlagError

FLAG = "--snake-optimizer-threads"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a launcher's binding counts)."""
    return len(os.sched_getaffinity(0))


def default_optimizer_threads() -> int:
    """Half the usable cores, at most torch's intra-op threads (which OMP_NUM_THREADS sets),
    at least one."""
    return max(1, min(usable_cores() // 2, torch.get_num_threads()))


def check_optimizer_threads(threads: int | None) -> int:
    """The flag's value, or its default when not given; FlagError names the flag."""
    if threads is None:
        return default_optimizer_threads()
    cores = usable_cores()
    if not 1 <= threads <= cores:
        raise FlagError(f"{FLAG} must be between 1 and the {cores} cores this process may "
                        f"use, got {threads}")
    return threads


def limit_this_thread(threads: int) -> None:
    """Run the calling thread's torch kernels on ``threads`` threads, leaving every other
    thread's count, and the default of threads started later, as they were."""
    default = torch.get_num_threads()   # this thread's: the default, if it had none yet
    torch.set_num_threads(threads)
    if default != threads:   # the default back, from a thread whose own count is then moot
        restore = threading.Thread(target=torch.set_num_threads, args=(default,),
                                   name="snake-threads-default")
        restore.start()
        restore.join()
