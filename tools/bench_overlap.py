"""Overlap efficiency on an emulated device: how close a step comes to its roofline.

The run is the one pretrain_gpt builds (``build_run``): the real vertical schedule, tensor
store, drive and CPU AdamW, with each unit's compute replaced by device time as long as a
device of the emulated TFLOP/s would take, on a clock that runs apart from the host as a
GPU does (megatron_snake/models/emulated_compute.py, megatron_snake/emulated_device.py). The
emulated TFLOP/s is a GPU's (``--gpu-tflops``, default 400: an H100 at about 40% of its
dense bf16 peak, typical of Megatron) scaled by this drive's bandwidth over the GPU's drive
(``--gpu-drive-gbps``, default 6): compute per unit against drive bytes per unit is then the
GPU's, on this machine. The device's copies to and from host memory (unit inputs, weights,
gradients) go over an emulated host link, ``--gpu-link-gbps`` (default 25: what pinned
copies reach over PCIe Gen4 x16, under half of an H100's Gen5 link) scaled the same way:
they take the link's time on one copy engine per direction and no CPU, as a GPU's DMA
does (``--gpu-link-gbps 0``: CPU copies on this machine's cores, as before 2026-11-25).
The optimizer's updates of the device share (``--snake-device-optimizer-share``) are the
device's too: time on its clock at ``--gpu-memory-gbps`` (default 2700: about 0.8 of an
H100's HBM3, what a fused AdamW streams), scaled the same way.

Each measured step is recorded as a timeline (megatron_snake/timeline.py); it ends when the
host is done and the device has run what it was given. Per phase of the
step (the forward sweep; the backward sweep with the step boundary) the roofline is the
longest of what the phase asks of each resource:
- device compute: the device spans' nominal seconds (real compute: the compute spans);
- the drive: bytes read / read bandwidth + bytes written / write bandwidth, both measured
  through the store right before and after the step, or the time a drive transfer was in
  flight in the phase when that is shorter (this disk swings from second to second, and
  a probe on a slow second must not say the drive needed more time than it took);
- host copies: host-tier bytes the CPU copies / this machine's copy bandwidth;
- the host link: the busier direction's copies at the emulated link's rate;
- the CPU optimizer: parameters updated / the whole host update's measured rate (the
  clip, the fused AdamW and the new weights' conversion, ``calibration.update_rate``:
  the fused AdamW alone is about half of it).
The step's roofline is the sum over its phases; **roofline ÷ measured** is the overlap
efficiency (1.0: every phase runs at the speed of its busiest resource). Each phase also
reports how long at least one drive transfer was in flight and the rate it moved bytes
meanwhile: a drive busy for the whole phase leaves nothing to overlap, whatever the probes
say it could do. The step-wide
bound (the busiest resource over the whole step) is also reported: it is below the
roofline when one sweep is drive-bound while the other leaves the drive idle.

The batch: the saturating number of micro-batches (the compute of a step equals its drive
time, found from a probe step) and half of it. Prints the ratios last; raw figures go to
``--json-out``; ``--trace FILE`` writes the last measured step's timeline.

    python tools/bench_overlap.py --dir /nvme/scratch --json-out overlap.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

import torch  # noqa: E402

import megatron_snake.timeline as timeline  # noqa: E402
from megatron_snake.models.emulated_compute import emulate_compute, unit_forward_flops  # noqa: E402
from megatron_snake.storage.copies import describe_per_parameter  # noqa: E402
from megatron_snake.storage.host_heap import keep_freed_host_memory  # noqa: E402
from megatron_snake.training import distributed  # noqa: E402
from megatron_snake.optim.cpu_threads import usable_cores  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.build import build_run  # noqa: E402
from megatron_snake.training.calibration import copy_rate, drive_rates, update_rate  # noqa: E402
from megatron_snake.training.data import random_microbatches  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_timeline import busy_seconds  # noqa: E402  (the union of spans, as drawn there)

MiB = 1 << 20


# --- the roofline of one recorded step -------------------------------------------------
def phase_work(spans: list[dict], start: float, end: float) -> dict:
    """What the spans that start in [start, end) ask of each resource: compute seconds
    (the emulated device's nominal waits, else the compute spans), drive bytes read and
    written, host-copy bytes, parameters updated."""
    emulated = any(s["cat"] == "device" for s in spans)
    work = {"compute_s": 0.0, "drive_read": 0, "drive_write": 0, "host_copy": 0,
            "adamw_params": 0, "link h2d": 0.0, "link d2h": 0.0}
    for s in spans:
        if not start <= s["start"] < end:
            continue
        if s["cat"] == "device":   # the emulated device's nominal time
            work["compute_s"] += s["args"]["seconds"]
        elif s["cat"] == "compute" and not emulated:   # real compute: as measured
            work["compute_s"] += s["end"] - s["start"]
        elif s["cat"] == "drive":
            work["drive_read" if s["name"].startswith("drive read") else "drive_write"] += \
                s["args"]["bytes"]
        elif s["cat"] == "host copy":
            work["host_copy"] += s["args"]["bytes"]
        elif s["cat"] == "link":   # the emulated link's nominal seconds, per direction
            work[s["name"]] += s["args"]["seconds"]
        elif s["cat"] == "cpu adamw":
            work["adamw_params"] += s["args"]["params"]
    return work


def resource_seconds(work: dict, rates: dict) -> dict:
    """Seconds each resource needs for ``work`` at ``rates`` (bytes/s, params/s)."""
    return {"compute": work["compute_s"],
            "drive": work["drive_read"] / rates["drive_read"]
            + work["drive_write"] / rates["drive_write"],
            "host copy": work["host_copy"] / rates["copy"],
            "host link": max(work["link h2d"], work["link d2h"]),
            "cpu update": work["adamw_params"] / rates["update"]}


def roofline(spans: list[dict], rates: dict) -> dict:
    """The step's measured time, its roofline (per phase the busiest resource, summed) and
    the step-wide bound (the busiest resource over the whole step), with each phase's
    resource seconds. ``spans``: one step's timeline (``Timeline.spans``)."""
    def first(name):
        return next(s for s in spans if s["name"] == name)

    step_start = first("forward_backward")["start"]
    # the step ends when the host is done and the device has run what it was given
    step_end = max([first("optimizer step")["end"]]
                   + [s["end"] for s in spans if s["cat"] == "device"])
    boundaries = [step_start, first("backward sweep")["start"], step_end]
    phases, total = {}, {}
    for name, (a, b) in zip(("forward", "backward"), zip(boundaries, boundaries[1:])):
        work = phase_work(spans, a, b)
        seconds = resource_seconds(work, rates)
        # the drive's achieved rate inside the phase, beside the rates probed outside it
        busy = busy_seconds((s["start"], min(s["end"], b)) for s in spans
                            if s["cat"] == "drive" and a <= s["start"] < b)
        seconds["drive"] = min(seconds["drive"], busy)   # it did the phase's bytes in that
        moved = work["drive_read"] + work["drive_write"]
        phases[name] = {"measured_s": b - a, "roofline_s": max(seconds.values()), **seconds,
                        "drive_busy_s": busy, "drive_GBps_while_busy": moved / busy / 1e9
                        if busy else None}
        for k, v in seconds.items():
            total[k] = total.get(k, 0.0) + v
    line = sum(p["roofline_s"] for p in phases.values())
    return {"measured_s": step_end - step_start, "roofline_s": line,
            "bound_s": max(total.values()), "phases": phases, "total": total}


# --- runs ------------------------------------------------------------------------------
def gpt_flags(a, num_mb: int) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * num_mb), "--bf16",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--snake-offload", "--snake-offload-dir", a.dir,
            "--snake-host-memory-limit", a.host_memory] + a.snake_flags.split()


def gradient_fill(run, norm: float) -> float:
    """The constant each gradient element starts at so that the step's global gradient
    norm is ``norm``: the emulated device computes no gradient, and with zeros the clip
    coefficient is 1 and the clip never binds, where on mock data it binds every step."""
    numel = sum(lay.numel for lay in run.offloaded.weights.params.all_layouts())
    return norm / math.sqrt(numel) if norm else 0.0


def measure(a, num_mb: int, tflops: float, device, *, steps: int, trace: str | None = None,
            emulate: bool = True, link: float | None = None, tune=None) -> dict:
    """Build the run with ``num_mb`` micro-batches, step it ``a.warmup`` + ``steps``
    times, and return each measured step's roofline (median ratio too). ``link``: the
    emulated host link's bytes/s (None: CPU copies). ``tune(update_s, forward_s, tflops)
    -> (tflops, link)``: the device's rates after each warm-up step, from that step's
    update seconds and forward compute seconds."""
    args = parse_args(gpt_flags(a, num_mb))
    rows, recorded = [], None
    with build_run(args, device, a.vocab, log=lambda _: None) as run:
        # The emulated device's memory is host memory: keep what is freed for reuse, as a
        # GPU's caching allocator does (a training run trims its heap to bound its RSS;
        # without emulation the run's own policy holds).
        if emulate and not keep_freed_host_memory():
            raise SystemExit("the emulated device needs glibc's malloc (mallopt)")
        if emulate:
            run.offloaded.weights.gradient_fill = gradient_fill(run, a.grad_norm)
        store, opt = run.tensor_store, run.optimizer
        clips = a.grad_norm > args.clip_grad > 0
        units = run.offloaded.units
        forward_flops = num_mb * sum(unit_forward_flops(units, u, a.micro_batch_size, a.seq)
                                     for u in range(units.num_units))
        fixed = {"copy": copy_rate(),
                 "update": update_rate(threads=opt.threads, clip=clips,
                                       weights_dtype=args.params_dtype
                                       if args.params_dtype != torch.float32 else None)}
        for step in range(a.warmup + steps):
            mbs = random_microbatches(num_mb, a.micro_batch_size, a.seq, a.vocab, seed=step,
                                      device=device)
            before = drive_rates(store)
            update0, blocked0 = opt.update_s, opt.blocked_s
            phases0 = dict(opt.update_phase_s)
            traffic0 = store.copies.traffic.snapshot()
            cpu_start = time.process_time()
            with timeline.recording() as recorded:
                if emulate:
                    with emulate_compute(run.offloaded.units, tflops, link,
                                         tflops * 1e12 * a.memory_bytes_per_flop) as clock:
                        run.step(mbs)
                        clock.synchronize()
                else:
                    run.step(mbs)
                # the step's writes and updates still running are its work too (the
                # roofline counts what starts before the step ends), and the drive is
                # measured idle
                run.optimizer.wait_running()
                store.synchronize()
            # all of the process's threads: what the step takes from the cores the drive's
            # I/O shares (on this VM the drive slows beside busy cores)
            cpu_s = time.process_time() - cpu_start
            # before the drive's calibration
            host_bytes = store.copies.traffic.per_parameter_step(
                traffic0, sum(lay.numel for lay in opt.layouts.values()))
            after = drive_rates(store)
            if step < a.warmup:
                if tune is not None:
                    read = opt.update_phase_s["read"] - phases0.get("read", 0.0)
                    tflops, link = tune(opt.update_s - update0 - read,
                                        forward_flops / (tflops * 1e12), tflops)
                continue
            rates = dict(fixed, drive_read=(before["read"] + after["read"]) / 2,
                         drive_write=(before["write"] + after["write"]) / 2)
            row = roofline(recorded.spans, rates)
            row["rates"], row["cpu_s"] = rates, cpu_s
            row["update_s"], row["blocked_s"] = opt.update_s - update0, opt.blocked_s - blocked0
            row["update_phase_s"] = {k: v - phases0.get(k, 0.0)
                                     for k, v in opt.update_phase_s.items()}
            # host memory read and written per parameter, by pass (the emulated device's
            # memory is not host memory: its crossings count their host side)
            row["host_bytes_per_param"] = host_bytes
            rows.append(row)
        if trace and recorded is not None:
            with open(trace, "w") as f:
                json.dump(recorded.chrome_trace(), f)
    ratios = [r["roofline_s"] / r["measured_s"] for r in rows]
    bounds = [r["bound_s"] / r["measured_s"] for r in rows]
    # Megatron on the same device waits for no state: its step is its compute, with full
    # recompute a forward, a recompute and a backward (twice a forward) of every layer,
    # without recompute three forwards' worth
    forward_s = forward_flops / (tflops * 1e12) if emulate else 0.0
    full = [4 * forward_s / r["measured_s"] for r in rows]
    return {"micro_batches": num_mb, "tokens_per_step": num_mb * a.micro_batch_size * a.seq,
            "emulated_tflops": tflops if emulate else None,
            "emulated_link_GBps": link / 1e9 if emulate and link else None, "steps": rows,
            "cpu_s_per_step": statistics.median(r["cpu_s"] for r in rows),
            "update_s_per_step": statistics.median(r["update_s"] for r in rows),
            "host_bytes_per_param_step": {k: statistics.median(r["host_bytes_per_param"][k]
                                                               for r in rows)
                                          for k in rows[0]["host_bytes_per_param"]},
            "roofline_over_measured": statistics.median(ratios),
            "bound_over_measured": statistics.median(bounds),
            "vs_megatron_full_recompute": statistics.median(full) if emulate else None,
            "vs_megatron_no_recompute": 0.75 * statistics.median(full) if emulate else None,
            "megatron_full_recompute_s": 4 * forward_s, "forward_s": forward_s,
            # the update's work, without its waits for inputs the device has not produced
            "update_over_compute": statistics.median(
                r["update_s"] - r["update_phase_s"]["read"] for r in rows)
            / (4 * forward_s) if emulate else None}


def saturating_microbatches(a, tflops: float, link: float | None, device) -> tuple[int, dict]:
    """Micro-batches at which a step's compute equals its drive time, from one probe
    step: compute grows with the micro-batches, the state's drive traffic does not."""
    probe = measure(a, a.probe_microbatches, tflops, device, steps=1, link=link)
    total = probe["steps"][0]["total"]
    per_mb = total["compute"] / a.probe_microbatches
    return max(2, round(total["drive"] / per_mb)), probe


# The H200 headline run (docs/benchmarks.md, `bde0303`): a 1.75B GPT, every state on the
# host tier, every unit's weights pinned on the device (its 3.5 GB of bf16 weights fitted
# the 4.84 GiB --snake-gpu-memory-limit), the clip binding (mock data), M 9. That limit
# now leaves room (``plan_device``, auto) for 15% of the parameters' optimizer state on the
# device and 27% of the weights pinned; the scaled model's limit, 1075MiB, leaves 17% and
# 27% (its first unit holds the embedding), and the baseline (no share) still pins them all. Its step's
# update (unscale and clip, AdamW, the new bf16 weights) took 1.3-1.5 s against Megatron's
# 1.58 s with full recompute: about 0.9 of the compute. The pinned host-to-GPU copies ran at
# 52.8 GB/s while the device computed at 127 x 4/3 TFLOP/s (Megatron's model FLOP/s counts
# no recompute): the link's time per FLOP is kept too. The model is scaled down to fit this
# machine (16 layers of hidden 1024, the H200's sequence, vocabulary and micro-batch).
# The device is the H200 relative to its host: its rate is set by a calibration run of the
# design the H200 measured (``BASELINE_FLAGS``: no speculative update, no share of the
# optimizer on the device, the update's team on every core, as at `bde0303`), at which
# that run's update is 0.9 of the step's compute here; the configuration asked for then
# runs on that device.
PRESETS = {
    "h200-headline": {
        "layers": 16, "hidden": 1024, "heads": 8, "seq": 2048, "micro_batch_size": 1,
        "vocab": 32768, "host_memory": "12GiB", "micro_batches": 9, "grad_norm": 4.0,
        "snake_flags": "--snake-param-tier host --snake-optimizer-tier host "
                       "--snake-activation-tier host --untie-embeddings-and-output-weights "
                       "--snake-gpu-memory-limit 1075MiB",
        "update_over_compute": 0.9, "link_bytes_per_flop": 52.8e9 / (127.0 * 4 / 3 * 1e12),
        # the device share's fused AdamW: about 0.8 of the H200's 4.8 TB/s
        "memory_bytes_per_flop": 0.8 * 4.8e12 / (127.0 * 4 / 3 * 1e12),
    },
}
BASELINE_FLAGS = ("--snake-speculate off --snake-device-optimizer-share 0 "
                  "--snake-optimizer-threads {cores}")


def preset_tuning(a, log: list):
    """``measure``'s ``tune`` for a preset's calibration run: after each warm-up step, the
    device's rate at which that step's compute (with full recompute: four forwards) is its
    update / ``update_over_compute``, and the link's at the preset's bytes per FLOP. The
    update's seconds depend a little on the device's rate (its puts queue behind the link's
    copies), so the warm-up steps iterate to the fixed point; ``log`` gets each step's.
    The update's seconds leave out its wait for its inputs (a gradient the device has not
    produced yet is no work of the update's)."""
    def tune(update_s: float, forward_s: float, tflops: float):
        if not update_s:   # the first step: its updates run in the next one (the clip)
            return tflops, tflops * 1e12 * a.link_bytes_per_flop
        compute_s = update_s / a.update_over_compute
        new = tflops * 4 * forward_s / compute_s
        log.append({"update_s": update_s, "tflops_before": tflops, "tflops": new})
        return new, new * 1e12 * a.link_bytes_per_flop
    return tune


def preset_device(a, device, log: list) -> tuple[float, float, dict]:
    """The preset's emulated TFLOP/s and link bytes/s, from a calibration run of the
    baseline design (``BASELINE_FLAGS``) tuned over its warm-up steps, and that run."""
    base = argparse.Namespace(**vars(a))
    base.snake_flags = f"{a.snake_flags} " + BASELINE_FLAGS.format(cores=usable_cores())
    run = measure(base, a.micro_batches, a.emulated_tflops or 20.0, device, steps=1,
                  link=(a.emulated_tflops or 20.0) * 1e12 * a.link_bytes_per_flop,
                  tune=preset_tuning(a, log))
    return run["emulated_tflops"], run["emulated_link_GBps"] * 1e9, run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the sizes, flags and device of a measured GPU run (flags given "
                        "too take precedence)")
    p.add_argument("--dir", default=None, help="offload directory (default: a temporary one)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--host-memory", default="8GiB", help="--snake-host-memory-limit")
    p.add_argument("--snake-flags", default="--snake-activation-tier host",
                   help="more flags for the offloaded run (tiers, --clip-grad, --snake-alpha)")
    p.add_argument("--gpu-tflops", type=float, default=400.0)
    p.add_argument("--emulated-tflops", type=float, default=0.0,
                   help="use this rate instead of scaling --gpu-tflops by this drive (to "
                        "compare two runs at the same device speed)")
    p.add_argument("--gpu-drive-gbps", type=float, default=6.0)
    p.add_argument("--gpu-link-gbps", type=float, default=25.0,
                   help="the GPU's host link per direction, scaled like --gpu-tflops (0: the "
                        "device's copies are CPU copies on this machine)")
    p.add_argument("--gpu-memory-gbps", type=float, default=2700.0,
                   help="the rate the GPU's fused AdamW streams its memory at, for the "
                        "device share's updates, scaled like --gpu-tflops")
    p.add_argument("--probe-microbatches", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=0,
                   help="run only this many micro-batches (default: the saturating number, "
                        "from a probe step, and half of it)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--real-microbatches", type=int, default=0,
                   help="also run this many micro-batches with real CPU compute (0: skip)")
    p.add_argument("--trace", default=None, help="write the saturating run's last step here")
    p.add_argument("--json-out", default=None)
    p.add_argument("--grad-norm", type=float, default=4.0,
                   help="the emulated gradients' global norm: above --clip-grad (1.0) the "
                        "clip binds, as on mock data; 0: zero gradients")
    p.set_defaults(update_over_compute=None, link_bytes_per_flop=None,
                   memory_bytes_per_flop=None)
    a = p.parse_args(argv)
    if a.preset:
        p.set_defaults(**PRESETS[a.preset])
        a = p.parse_args(argv)
    if a.memory_bytes_per_flop is None:
        a.memory_bytes_per_flop = a.gpu_memory_gbps * 1e9 / (a.gpu_tflops * 1e12)
    tmp = None
    if a.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_overlap_")
        a.dir = tmp.name
    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device("cpu")
    distributed.initialize(device=device)
    tuning, calibration, drive_gbps = [], None, None
    if a.update_over_compute:
        # a preset's device is scaled to the baseline's update, not to the drive (its state
        # is on the host)
        tflops, link, calibration = preset_device(a, device, tuning)
        print(f"preset {a.preset}: the baseline's warm-up updates "
              + ", ".join(f"{t['update_s']:.2f}" for t in tuning)
              + f" s: the device at {tflops:.2f} TFLOP/s, host link {link / 1e9:.2f} GB/s; "
              f"the baseline (the design the GPU measured) ÷ Megatron with full recompute "
              f"{calibration['vs_megatron_full_recompute']:.3f}", flush=True)
    else:
        # The emulated device: the GPU's TFLOP/s scaled by this drive over the GPU's drive.
        args = parse_args(gpt_flags(a, 1))
        with build_run(args, device, a.vocab, log=lambda _: None) as run:
            rates = [drive_rates(run.tensor_store) for _ in range(3)]
        drive_gbps = statistics.median(2 / (1 / r["read"] + 1 / r["write"])
                                       for r in rates) / 1e9
        tflops = a.emulated_tflops or a.gpu_tflops * drive_gbps / a.gpu_drive_gbps
        link = a.gpu_link_gbps * 1e9 * drive_gbps / a.gpu_drive_gbps or None
        print(f"drive here {drive_gbps:.2f} GB/s (read/write harmonic mean): emulated device "
              f"{tflops:.1f} TFLOP/s = {a.gpu_tflops:g} x {drive_gbps:.2f} / "
              f"{a.gpu_drive_gbps:g}, " + (
                  f"host link {link / 1e9:.2f} GB/s = {a.gpu_link_gbps:g} x {drive_gbps:.2f} / "
                  f"{a.gpu_drive_gbps:g}" if link else "host link: CPU copies"), flush=True)
    if a.micro_batches:
        saturating, probe, batches = a.micro_batches, None, (a.micro_batches,)
    else:
        saturating, probe = saturating_microbatches(a, tflops, link, device)
        batches = (saturating, max(1, saturating // 2))
    results = {"config": vars(a), "drive_GBps": drive_gbps, "emulated_tflops": tflops,
               "emulated_link_GBps": link / 1e9 if link else None, "probe": probe,
               "preset_tuning": tuning, "preset_baseline": calibration, "runs": []}
    for num_mb in batches:
        out = measure(a, num_mb, tflops, device, steps=a.steps, link=link,
                      trace=a.trace if num_mb == saturating else None)
        results["runs"].append(out)
        step = out["steps"][-1]
        print(f"M={num_mb:3d} ({out['tokens_per_step']} tokens/step): measured "
              f"{step['measured_s']:.2f} s, roofline {step['roofline_s']:.2f} s, step-wide "
              f"bound {step['bound_s']:.2f} s; per phase " + "; ".join(
                  f"{name} {ph['measured_s']:.2f} s (compute {ph['compute']:.2f}, drive "
                  f"{ph['drive']:.2f}, copy {ph['host copy']:.2f}, link {ph['host link']:.2f}, "
                  f"update {ph['cpu update']:.2f}; "
                  f"drive busy {ph['drive_busy_s']:.2f} s at "
                  f"{ph['drive_GBps_while_busy'] or 0:.2f} GB/s)"
                  for name, ph in step["phases"].items())
              + f"; host CPU {out['cpu_s_per_step']:.2f} s a step (median)", flush=True)
    if a.real_microbatches:
        results["real_compute"] = measure(a, a.real_microbatches, 0.0, device, steps=a.steps,
                                          emulate=False)
        print(f"real CPU compute, M={a.real_microbatches}: roofline / measured "
              f"{results['real_compute']['roofline_over_measured']:.3f}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    for out in results["runs"]:
        print(f"M={out['micro_batches']}: step-wide bound / measured (median) "
              f"{out['bound_over_measured']:.3f}")
    for out in results["runs"]:
        print(f"M={out['micro_batches']}: update {out['update_s_per_step']:.2f} s a step "
              f"(its work {out['update_over_compute']:.2f} of Megatron's step with full "
              f"recompute); "
              f"Megatron on the emulated device / measured (tokens/s ours / Megatron's): "
              f"full recompute {out['vs_megatron_full_recompute']:.3f}, no recompute "
              f"{out['vs_megatron_no_recompute']:.3f}")
    for out in results["runs"]:
        print(f"M={out['micro_batches']}: host memory "
              + describe_per_parameter(out["host_bytes_per_param_step"]))
    for out in results["runs"]:
        print(f"M={out['micro_batches']}: roofline / measured (median) "
              f"{out['roofline_over_measured']:.3f}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
