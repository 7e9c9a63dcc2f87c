"""The host update of one optimizer part: today's passes against the native one-pass kernel
(csrc/adamw.c) and a STREAM-like bound for the same bytes, on the same threads.

fp32 states, bf16 working weights (the fp32 path of a --bf16 run):

- ``three passes``: today's update: the clip ``grad.mul_(coef)``, ``torch._fused_adamw_`` in
  place, and the fp32 -> bf16 copy of the new master into a preallocated buffer, on
  ``--threads`` torch threads;
- ``native``: ``host_kernel.adamw_update`` on the same inputs (clip on, bf16 weights out, in
  place), the native kernel on ``--threads`` threads;
- ``bound``: ``_snake_adamw.bound``: the same bytes per element (reads the gradient, master
  and both moments, 16 B; writes the master and moments in place and a 16-bit weight, 14 B)
  with trivial arithmetic, on the same threads, stores and instruction set.

With ``--modes`` also the precision-aware modes (Megatron-Core's store_param_remainders
under --bf16, with fp32 or bf16 moments by default, fp16 or fp8 on request): the update's
torch path (``host_kernel``'s fallback without the native build: torch's passes over fp32
chunks, the same bits) against the native kernel on the same bytes.

Variants alternate, round after round (round 0 warms up: page faults, scratch), so a slow
second of this shared machine lands on all of them alike; each figure is the median of the
rounds. Raw figures go to ``--json-out``; the ratios are printed last.

    python tools/bench_host_update.py --threads 1 --json-out host_update.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.optim import host_kernel  # noqa: E402

BF16 = torch.bfloat16
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
CLIP = 0.9   # a coefficient below 1: Megatron clips (a coefficient of 1 skips the pass)
# bytes per parameter one update moves: reads + writes of the stored state, the gradient read
BYTES = {"fp32": 16 + 14, "remainders": 16 + 12, "remainders + bf16 moments": 12 + 8,
         "remainders + fp16 moments": 12 + 8, "remainders + fp8 moments": 10 + 6}
# the moments' dtype of each precision-aware mode (the master: remainders)
PRECISION_MODES = {"remainders": torch.float32, "remainders + bf16 moments": BF16,
                   "remainders + fp16 moments": torch.float16,
                   "remainders + fp8 moments": torch.uint8}
DEFAULT_MODES = ("remainders", "remainders + bf16 moments")


def fp32_states(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"grad": torch.randn(n, generator=g) * 1e-3,
            "master": torch.randn(n, generator=g) * 0.02,
            "exp_avg": torch.randn(n, generator=g) * 1e-4,
            "exp_avg_sq": torch.rand(n, generator=g) * 1e-6,
            "weights": torch.empty(n, dtype=BF16)}


def three_passes(s: dict, step: int, coef: torch.Tensor) -> None:
    s["grad"].mul_(coef)
    torch._fused_adamw_([s["master"]], [s["grad"]], [s["exp_avg"]], [s["exp_avg_sq"]], [],
                        [torch.tensor(float(step))], amsgrad=False, maximize=False, **HYPER)
    s["weights"].copy_(s["master"])


def native(s: dict, step: int, threads: int) -> None:
    seg = host_kernel.Segment(s["grad"], s["master"], s["exp_avg"], s["exp_avg_sq"],
                              weights_out=s["weights"])
    host_kernel.adamw_update([seg], step=step, clip=CLIP, threads=threads, **HYPER)


def bound(s: dict, threads: int) -> None:
    host_kernel._native.bound(s["grad"].data_ptr(), s["master"].data_ptr(),
                              s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr(),
                              s["weights"].data_ptr(), s["master"].numel(), threads=threads)


class PrecisionMode:
    """One precision-aware mode (remainders, the moments in ``PRECISION_MODES``' dtype, a
    scaled dtype with one scale for the part): the update's torch path (``host_kernel``'s
    fallback: torch's passes in fp32 chunks, the same bits) against the native kernel, each
    on states of its own."""

    def __init__(self, mode: str, n: int):
        from megatron_snake.optim.precision import quantize, split_flat

        moments = PRECISION_MODES[mode]
        self.states, self.scales = {}, {}
        for who in ("torch", "native"):
            s = fp32_states(n, seed=2)
            hi, rem = split_flat(s["master"])
            state = {"grad": s["grad"], "master": rem, "w": hi}
            scales = {}
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = torch.empty(n, dtype=moments)
                multiplier = quantize(s[name].clone(), moments, state[name])
                if moments not in (torch.float32, BF16):
                    scales[name] = [multiplier]
            self.states[who], self.scales[who] = state, scales

    def run(self, who: str, step: int, threads: int) -> None:
        s = self.states[who]
        seg = host_kernel.Segment(s["grad"], s["master"], s["exp_avg"], s["exp_avg_sq"],
                                  weights=s["w"])
        kw = dict(step=float(step), clip=CLIP, scales=self.scales[who],
                  weights_rounding="te", **HYPER)
        if who == "torch":
            new = host_kernel._torch_update([seg], **kw)
        else:
            new = host_kernel._native_update([seg], host_kernel._choose()[1], threads=threads,
                                             **kw)
        self.scales[who].update(new)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=32 << 20,
                    help="parameters in the part (default 32M)")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of every variant (torch's intra-op threads for torch's)")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of every variant")
    ap.add_argument("--modes", nargs="*", default=list(DEFAULT_MODES),
                    choices=list(PRECISION_MODES),
                    help="precision-aware modes to measure too (none: --modes)")
    ap.add_argument("--json-out", default="bench_host_update.json")
    a = ap.parse_args(argv)
    if host_kernel._native is None:
        ap.error("the native kernel (megatron_snake._snake_adamw) is not built: "
                 "python setup.py build_ext --inplace")
    implementation = host_kernel.implementation()
    if not implementation.startswith("native"):
        ap.error(f"the update would run {implementation}")
    torch.set_num_threads(a.threads)
    n = a.params
    coef = torch.tensor(CLIP, dtype=torch.float32)
    fp32 = {"three passes": fp32_states(n, 1), "native": fp32_states(n, 1),
            "bound": fp32_states(n, 1)}
    runs: dict = {name: [] for name in fp32}
    modes = {mode: PrecisionMode(mode, n) for mode in a.modes}
    for mode in modes:
        runs[f"{mode}: torch path"] = []
        runs[f"{mode}: native"] = []
    for rnd in range(a.rounds + 1):   # round 0 warms up
        step = rnd + 1
        jobs = [("three passes", lambda: three_passes(fp32["three passes"], step, coef)),
                ("native", lambda: native(fp32["native"], step, a.threads)),
                ("bound", lambda: bound(fp32["bound"], a.threads))]
        for mode, m in modes.items():
            jobs.append((f"{mode}: torch path",
                         lambda m=m: m.run("torch", step, a.threads)))
            jobs.append((f"{mode}: native",
                         lambda m=m: m.run("native", step, a.threads)))
        if rnd % 2:   # alternate the order too
            jobs.reverse()
        for name, job in jobs:
            t0 = time.perf_counter()
            job()
            seconds = time.perf_counter() - t0
            if rnd:
                runs[name].append(seconds)

    medians = {name: statistics.median(s) for name, s in runs.items()}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "command": " ".join([os.path.basename(sys.argv[0])] +
                                                      sys.argv[1:]),
              "machine": platform.node(), "processor": cpu_model(),
              "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "torch": torch.__version__,
              "torch_capability": torch.backends.cpu.get_cpu_capability(),
              "implementation": implementation, "threads": a.threads, "params": n,
              "rounds": a.rounds, "variants": {}}
    for name, seconds in runs.items():
        mode = name.split(":")[0] if ":" in name else "fp32"
        nbytes = BYTES[mode]
        result["variants"][name] = {"seconds": seconds, "median_s": medians[name],
                                    "params_per_s": n / medians[name], "bytes_per_param": nbytes,
                                    "gb_per_s": n * nbytes / medians[name] / 1e9}
        print(f"{name:38s} {medians[name] * 1e3:8.1f} ms {n / medians[name] / 1e6:8.1f} M "
              f"params/s {n * nbytes / medians[name] / 1e9:6.2f} GB/s ({nbytes} B/param)")
    ratios = {"native / three passes": medians["three passes"] / medians["native"],
              "native / bound": medians["bound"] / medians["native"]}
    for mode in modes:
        ratios[f"{mode}: native / torch path"] = \
            medians[f"{mode}: torch path"] / medians[f"{mode}: native"]
    result["ratios"] = ratios
    with open(a.json_out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.json_out} ({implementation}, {a.threads} thread(s), {n} parameters, "
          f"load average {os.getloadavg()[0]:.2f})")
    for name, ratio in ratios.items():   # params/s over params/s, last
        goal = {"native / three passes": " (goal >= 1.8)",
                "native / bound": " (goal >= 0.85)"}.get(name, "")
        print(f"rate {name}: {ratio:.3f}{goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
