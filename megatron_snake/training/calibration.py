"""This machine's rates, measured the way a run uses them: the compute device on one unit of
the model, the drive through the store, host copies, the fused CPU AdamW and collectives.
tools/calibrate.py writes them as a planner profile; tools/bench_overlap.py uses them for
its roofline.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
import torch.distributed as dist

from megatron_snake.optim.adamw import fused_adamw_
from megatron_snake.optim.cpu_threads import budgeted_worker, check_optimizer_threads

MiB = 1 << 20


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drive_rates(store, nbytes: int = 256 * MiB, record: int = 64 * MiB) -> dict:
    """Write and read ``nbytes`` through ``store`` to its drive, as 64 MiB records (the
    store's own engine, checksums and queue depth): bytes/s each way."""
    data = torch.empty(record, dtype=torch.uint8).random_()
    keys = [("calibration", i) for i in range(nbytes // record)]
    start = time.perf_counter()
    for handle in [store.put(k, data, tier="nvme", kind="calibration") for k in keys]:
        handle.wait()
    write = time.perf_counter() - start
    start = time.perf_counter()
    for handle in [store.get(k) for k in keys]:
        handle.wait()
    read = time.perf_counter() - start
    for key in keys:
        store.delete(key).wait()
    return {"write": nbytes / write, "read": nbytes / read}


def keep_drive_busy(store, stop: threading.Event, record: int = 16 * MiB) -> None:
    """Write and read records through ``store`` to its drive until ``stop`` is set (the
    I/O of a step, for timing compute beside it)."""
    data = torch.ones(record, dtype=torch.uint8)
    keys = [("calibration-busy", i) for i in range(4)]
    while not stop.is_set():
        for handle in [store.put(k, data, tier="nvme", kind="calibration") for k in keys]:
            handle.wait()
        for handle in [store.get(k) for k in keys]:
            handle.wait()
    for key in keys:
        store.delete(key).wait()


def copy_rate(nbytes: int = 256 * MiB, device: torch.device | None = None) -> float:
    """Bytes/s of a copy from host memory: into host memory (what a host-tier put or get
    does), or onto ``device`` from pinned memory (a GPU's host-to-device copies)."""
    cuda = device is not None and device.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device if cuda else "cpu")
    times = []
    for _ in range(3):
        synchronize(dst.device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        synchronize(dst.device)
        times.append(time.perf_counter() - start)
    return nbytes / min(times)


def adamw_rate(numel: int = 32 * MiB, threads: int | None = None) -> float:
    """Fused CPU AdamW parameters/s, on a worker with the optimizer's thread budget
    (``threads``, default ``--snake-optimizer-threads``'s default), as the update runs."""
    p, g, m, v = (torch.rand(numel) for _ in range(4))
    step = torch.tensor(1.0)

    def best_of_three() -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fused_adamw_([p], [g], [m], [v], step, lr=1e-4, beta1=0.9, beta2=0.999,
                         weight_decay=0.01, eps=1e-8)
            times.append(time.perf_counter() - start)
        return min(times)

    worker = budgeted_worker(check_optimizer_threads(threads), "snake-calibrate-adamw")
    try:
        return numel / worker.submit(best_of_three).result()
    finally:
        worker.shutdown()


def update_rate(numel: int = 32 * MiB, threads: int | None = None, *, clip: bool = True,
                weights_dtype: torch.dtype | None = torch.bfloat16) -> float:
    """Parameters/s of the whole host update of one part, as a run with fp32 state does it
    (``clip``: the gradient times a clip coefficient below 1; the fused AdamW; the new
    master weights converted into ``weights_dtype``, none for fp32 weights), on a worker
    with the optimizer's thread budget. The fused AdamW alone (``adamw_rate``) is about
    half of it: the update is priced at this rate, not that one."""
    p, g, m, v = (torch.rand(numel) for _ in range(4))
    out = torch.empty(numel, dtype=weights_dtype) if weights_dtype is not None else None
    step = torch.tensor(1.0)
    coef = torch.tensor(0.5)

    def best_of_three() -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            if clip:
                g.mul_(coef)
            fused_adamw_([p], [g], [m], [v], step, lr=1e-4, beta1=0.9, beta2=0.999,
                         weight_decay=0.01, eps=1e-8)
            if out is not None:
                out.copy_(p)
            times.append(time.perf_counter() - start)
        return min(times)

    worker = budgeted_worker(check_optimizer_threads(threads), "snake-calibrate-update")
    try:
        return numel / worker.submit(best_of_three).result()
    finally:
        worker.shutdown()


def unit_seconds(units, unit: int, hidden: torch.Tensor, ctx, repeats: int = 3
                 ) -> tuple[float, float]:
    """(forward, forward + backward) seconds of ``unit`` of ``units`` (a GPTUnits) on one
    micro-batch whose input is ``hidden``, medians over ``repeats`` after one warm-up."""
    fwd, both = [], []
    for i in range(repeats + 1):
        synchronize(hidden.device)
        start = time.perf_counter()
        out = units.forward_unit(unit, hidden, ctx)
        synchronize(hidden.device)
        middle = time.perf_counter()
        out.float().square().mean().backward()
        synchronize(hidden.device)
        end = time.perf_counter()
        units.gpt.zero_grad(set_to_none=True)
        hidden.grad = None
        if i:
            fwd.append(middle - start)
            both.append(end - start)
    return statistics.median(fwd), statistics.median(both)


def matmul_tflops(n: int, dtype: torch.dtype, device: torch.device, repeats: int = 3) -> float:
    """TFLOP/s of an n x n matmul: the device's dense rate in ``dtype``."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / min(times[1:]) / 1e12


def allreduce_bus_rate(nbytes: int = 64 * MiB, device: torch.device | None = None) -> float:
    """Bus bandwidth of an all-reduce over the world (NCCL-tests' convention: 2 (n-1)/n of
    the buffer crosses each rank's link), bytes/s."""
    world = dist.get_world_size()
    buf = torch.ones(nbytes // 4, device=device or "cpu")
    times = []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        synchronize(buf.device)
        times.append(time.perf_counter() - start)
    return 2 * (world - 1) / world * nbytes / statistics.median(times[1:])
