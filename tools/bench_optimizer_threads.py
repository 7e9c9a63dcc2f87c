"""The host optimizer's thread budget (``--snake-optimizer-threads``): what an update on
every core costs the training thread, against the default budget (half the cores).

During an offloaded step three kinds of host work run at once: the training thread
launches the device's kernels from Python (each launch a few microseconds of one core),
the store's workers copy records, and the optimizer's worker updates on a team of torch
threads. This benchmark runs the three side by side for ``--seconds`` each trial:
- the training thread: ``--launch-batch`` tiny ops at a time (kernel launches on a GPU;
  8-element CPU ops here, which cost the host what a launch does: a dispatch);
- ``--copy-threads`` threads each copying a 64 MiB buffer, one torch thread each;
- the optimizer: torch's fused AdamW on ``--numel`` fp32 parameters, over and over, on a
  worker with a team of ``--all-threads`` (baseline: torch's default, every core) or the
  budget (ours: ``default_optimizer_threads``, or ``--budget``).
Trials alternate baseline and ours for ``--rounds`` rounds; each figure is a median. The
last two lines are ours over the baseline: the training thread's launches per second (more
is a GPU fed sooner) and the update's parameters per second. Raw figures go to
``--json-out``.

    python tools/bench_optimizer_threads.py --json-out threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.optim.adamw import fused_adamw_  # noqa: E402
from megatron_snake.optim.cpu_threads import (default_optimizer_threads,  # noqa: E402
                                              limit_this_thread, usable_cores)


def trial(a, threads: int, device: torch.device) -> dict:
    """One trial: the three kinds of work at once for ``a.seconds``; the training thread's
    launches/s and the update's parameters/s over that window."""
    p, g, m, v = (torch.rand(a.numel) for _ in range(4))
    step = torch.tensor(1.0)
    stop, updated, started = threading.Event(), [0], threading.Barrier(a.copy_threads + 2)

    def optimizer():
        limit_this_thread(threads)
        started.wait()
        while not stop.is_set():
            fused_adamw_([p], [g], [m], [v], step, lr=1e-4, beta1=0.9, beta2=0.999,
                         weight_decay=0.01, eps=1e-8)
            updated[0] += a.numel

    def copier():
        limit_this_thread(1)
        src, dst = torch.empty(64 << 20, dtype=torch.uint8), torch.empty(64 << 20,
                                                                          dtype=torch.uint8)
        started.wait()
        while not stop.is_set():
            dst.copy_(src)

    workers = [threading.Thread(target=optimizer)] + \
        [threading.Thread(target=copier) for _ in range(a.copy_threads)]
    for w in workers:
        w.start()
    x = torch.zeros(8, device=device)
    started.wait()
    u0, t0, launches = updated[0], time.perf_counter(), 0
    while time.perf_counter() - t0 < a.seconds:
        for _ in range(a.launch_batch):
            x.add_(1.0)
        launches += a.launch_batch
    elapsed = time.perf_counter() - t0
    params = updated[0] - u0
    stop.set()
    for w in workers:
        w.join()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"optimizer_threads": threads, "launches_per_s": launches / elapsed,
            "update_params_per_s": params / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 24, help="parameters per update")
    p.add_argument("--seconds", type=float, default=2.0, help="per trial")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--copy-threads", type=int, default=0,
                   help="busy copying threads besides (default: none: on a GPU the store's "
                        "copies to and from the device are DMA, its workers mostly wait)")
    p.add_argument("--launch-batch", type=int, default=100)
    p.add_argument("--all-threads", type=int, default=0,
                   help="the baseline's team (default: torch's, every core)")
    p.add_argument("--budget", type=int, default=0,
                   help="ours (default: --snake-optimizer-threads's default)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--json-out", default="bench_optimizer_threads.json")
    a = p.parse_args()
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available()
                          else "cpu" if a.device == "auto" else a.device)
    modes = {"baseline": a.all_threads or torch.get_num_threads(),
             "ours": a.budget or default_optimizer_threads()}
    if modes["ours"] == modes["baseline"]:
        print(f"note: the budget is the baseline's team ({modes['ours']} threads: "
              f"{usable_cores()} cores, torch's {torch.get_num_threads()}); the ratios "
              "compare a setting with itself", flush=True)
    runs: dict = {mode: [] for mode in modes}
    for r in range(a.rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        for mode in order:
            runs[mode].append(trial(a, modes[mode], device))
    summary = {mode: {key: statistics.median(t[key] for t in runs[mode])
                      for key in ("launches_per_s", "update_params_per_s")}
               for mode in modes}
    ratio = {key: summary["ours"][key] / summary["baseline"][key]
             for key in ("launches_per_s", "update_params_per_s")}
    report = {"machine": platform.node(), "cores": usable_cores(), "device": str(device),
              "modes": modes, "args": vars(a), "runs": runs, "median": summary,
              "ratio": ratio, "date": time.strftime("%Y-%m-%d %H:%M")}
    with open(a.json_out, "w") as f:
        json.dump(report, f, indent=1)
    for mode, threads in modes.items():
        s = summary[mode]
        print(f"{mode}: optimizer on {threads} thread(s): training thread "
              f"{s['launches_per_s'] / 1e3:.0f}k launches/s, update "
              f"{s['update_params_per_s'] / 1e6:.0f}M params/s")
    print(f"training thread launches/s, ours / baseline: {ratio['launches_per_s']:.3f}")
    print(f"update params/s, ours / baseline: {ratio['update_params_per_s']:.3f}")


if __name__ == "__main__":
    main()
