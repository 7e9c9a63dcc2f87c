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
``torch.set_num_threads``); the call also sets the default that a thread takes at its first
torch kernel, which ``limit_this_thread`` puts back at once, so only the worker changes. A
thread whose first kernel falls inside that window (microseconds, once per worker, when the
worker starts: ``budgeted_worker`` starts it as the optimizer is built) takes the budget.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_snake.errors import FlagError

FLAG = "--snake-optimizer-threads"
_default_lock = threading.Lock()   # one limit_this_thread at a time: each restores the default


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
    with _default_lock:
        default = torch.get_num_threads()   # this thread's: the default, if it had none yet
        torch.set_num_threads(threads)
        if default != threads:   # the default back, from a thread whose own count is moot
            restore = threading.Thread(target=torch.set_num_threads, args=(default,),
                                       name="snake-threads-default")
            restore.start()
            restore.join()


def budgeted_worker(threads: int, name: str) -> ThreadPoolExecutor:
    """One worker thread whose torch kernels run on ``threads`` threads, started now (a
    failure to start is raised here, not at its first task)."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                initializer=limit_this_thread, initargs=(threads,))
    worker.submit(int).result()
    return worker
