"""Validate the cost model on this machine: predicted against measured step times.

    python tools/validate_planner.py --dir /nvme/scratch [--json-out v.json] [--png v.png]

1. Calibrates this machine (tools/calibrate.py) for the configurations' shape: once with one
   process and once under torchrun with two (the two-rank runs share the cores, the drive
   and the memory bus, so they get their own profile, with the all-reduce measured).
2. Trains each configuration with examples/pretrain_gpt.py (--log-interval 1) and takes the
   median of "elapsed time per iteration" after --warmup iterations. The configurations
   vary the size, M, G, alpha, the checkpoint interval and the tiers, and include PP = 2
   and DP = 2 under gloo.
3. Predicts each with tools/plan.py's model and the matching profile, calibrated again
   (with the same calibration flags as step 1: this tracks the machine's drift, not each
   configuration's settings) right before the configuration runs (``--calibrate each``,
   the default: this machine's speed drifts over minutes), and runs the setting
   --snake-auto picks. Steps 1-3 repeat ``--rounds`` times, in turn. A configuration's
   error is the median over the rounds of each round's error (a measurement against the
   prediction from the profile calibrated right before it); the error of its median
   measurement and median prediction, rounds unpaired, is printed too. On a CPU
   device each prediction is also made with the compute rates of a layer timed alone
   (the profile's ``*_alone`` fields) instead of inside a real step, for comparison.
4. Prints each error, checks that the --snake-auto pick's measured step is within 5% of the
   fastest measured configuration among those it could have picked, draws predicted against
   measured (--png) and prints the median absolute error last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import warnings

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

from megatron_snake.planner import Hardware, predict  # noqa: E402

ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                          r"([0-9.]+)")

# name, world size, flags beside the base ones; "candidate": one --snake-auto could pick
CONFIGS = [
    ("4 layers, M 4", 1, ["--num-layers", "4", "--global-batch-size", "8"], True),
    ("8 layers, M 4", 1, ["--num-layers", "8", "--global-batch-size", "8"], False),
    ("4 layers, M 8", 1, ["--num-layers", "4", "--global-batch-size", "16"], False),
    ("no clipping, alpha 0.5", 1, ["--num-layers", "4", "--global-batch-size", "8",
                                   "--clip-grad", "0", "--snake-alpha", "0.5"], False),
    ("host tiers", 1, ["--num-layers", "4", "--global-batch-size", "8", "--snake-param-tier",
                       "host", "--snake-optimizer-tier", "host", "--snake-activation-tier",
                       "host"], True),
    ("checkpoint interval 2", 1, ["--num-layers", "4", "--global-batch-size", "8",
                                  "--snake-checkpoint-interval", "2"], True),
    ("unit inputs on the drive", 1, ["--num-layers", "4", "--global-batch-size", "8",
                                     "--snake-activation-tier", "nvme"], True),
    ("PP 2, G 2", 2, ["--num-layers", "4", "--global-batch-size", "16",
                      "--pipeline-model-parallel-size", "2", "--snake-group-size", "2"], False),
    ("PP 2, G 4", 2, ["--num-layers", "4", "--global-batch-size", "16",
                      "--pipeline-model-parallel-size", "2", "--snake-group-size", "4"], False),
    ("DP 2", 2, ["--num-layers", "4", "--global-batch-size", "16"], False),
]


def base_flags(a) -> list[str]:
    return ["--hidden-size", str(a.hidden), "--num-attention-heads", "8", "--seq-length",
            str(a.seq), "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "8192", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--device", a.device, "--snake-offload", "--snake-offload-dir", a.dir,
            "--snake-host-memory-limit", a.host_memory, *(["--bf16"] if a.bf16 else [])]


def worlds(device: str) -> tuple[int, ...]:
    """The rank counts this machine can validate: two under gloo on the CPU; on GPUs two
    only with two devices (NCCL runs one rank a device)."""
    if device == "cpu":
        return (1, 2)
    import torch
    return (1, 2) if torch.cuda.device_count() >= 2 else (1,)


def _launch(world: int, script: str, argv: list[str]) -> list[str]:
    if world == 1:
        return [sys.executable, script, *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", script, *argv]


def _run(world: int, script: str, argv: list[str], what) -> subprocess.CompletedProcess:
    """Run a tool; a failure raises with its own error, the end of its stderr."""
    proc = subprocess.run(_launch(world, os.path.join(ROOT, script), argv),
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{script} {what}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def calibrate(a, world: int) -> Hardware:
    out = os.path.join(a.dir, f"profile_world{world}.json")
    flags = base_flags(a) + ["--num-layers", "4", "--global-batch-size", str(8 * world)]
    _run(world, "tools/calibrate.py", [*flags, "--output", out], f"({world} rank(s))")
    return Hardware.load(out)


def measure(a, world: int, flags: list[str]) -> float:
    """Median seconds per iteration after the warm-up iterations."""
    argv = [*base_flags(a), *flags, "--train-iters", str(a.warmup + a.iters),
            "--log-interval", "1", "--eval-interval", "100000"]
    proc = _run(world, "examples/pretrain_gpt.py", argv, flags)
    times = [float(ms) / 1e3 for it, ms in ITERATION_MS.findall(proc.stdout)
             if int(it) > a.warmup]
    if len(times) < a.iters:
        raise RuntimeError(f"{flags}: {len(times)} iteration lines\n{proc.stdout[-3000:]}")
    return statistics.median(times)


def predicted(a, hw: Hardware, flags: list[str]) -> float:
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.workload import workload_from_args

    args = parse_args([*base_flags(a), *flags], world_size=hw.gpus_per_node)
    return predict(workload_from_args(args, 8192), hw, check=False).step_time_s


def predictions(a, hw: Hardware, flags: list[str]) -> tuple[float, float]:
    """The step predicted from the profile, and from it with the compute rates of a layer
    and the output layer timed alone where the profile measured those apart (a CPU
    device)."""
    alone = hw
    if hw.device_tflops_alone:
        alone = hw.with_(device_tflops=hw.device_tflops_alone,
                         head_tflops=hw.head_tflops_alone or hw.head_tflops,
                         device_peak_tflops=max(hw.device_peak_tflops, hw.device_tflops_alone))
    return predicted(a, hw, flags), predicted(a, alone, flags)


def paired_error(runs: list[tuple], column: int) -> float:
    """A configuration's error: the median over rounds of each round's relative error, the
    measurement against the prediction from the profile calibrated right before it. This
    machine's speed drifts by a fifth within minutes, so a prediction is compared with the
    run made under the same conditions, not with another round's."""
    return statistics.median(r[column] / r[0] - 1 for r in runs)


def auto_choice(a, hw: Hardware) -> list[str]:
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.auto_config import choose

    args = parse_args([*base_flags(a), "--num-layers", "4", "--global-batch-size", "8"])
    choice, _, _ = choose(args, 8192, hw)
    return ["--num-layers", "4", "--global-batch-size", "8", *choice.flags().split()]


def draw(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    top = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], color="grey", lw=1)
    for r in rows:
        ax.scatter(r["measured_s"], r["predicted_s"])
        ax.annotate(r["name"], (r["measured_s"], r["predicted_s"]), fontsize=7)
    ax.set(xlabel="measured step (s)", ylabel="predicted step (s)", xlim=(0, top),
           ylim=(0, top), title="cost model on this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="offload directory (on the drive to model)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--host-memory", default="2GiB")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="the compute device to validate (cuda: tools/gpu_check.sh)")
    p.add_argument("--bf16", action="store_true", help="train and calibrate in bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3,
                   help="calibrate and run every configuration this many times, in turn "
                        "(this machine's speed drifts from minute to minute); medians")
    p.add_argument("--calibrate", choices=("each", "round"), default="each",
                   help="calibrate right before each configuration is measured (default: "
                        "this machine's speed drifts over minutes, and a profile from the "
                        "round's start mispredicted later runs by up to a third), or once "
                        "a round")
    p.add_argument("--json-out", default=None)
    p.add_argument("--png", default=None)
    a = p.parse_args(argv)
    if not os.path.isdir(a.dir):   # the runs refuse it too, but only after a calibration
        p.error(f"--dir {a.dir} does not exist: create it on the drive to model (it is not "
                "created for you, as --snake-offload-dir is not)")
    ranks = worlds(a.device)
    configs = [c for c in CONFIGS if c[1] in ranks]
    if len(configs) < len(CONFIGS):
        print(f"> one {a.device} device: the {len(CONFIGS) - len(configs)} two-rank "
              "configurations are left out", flush=True)
    runs = {name: [] for name, *_ in configs}
    runs["--snake-auto"] = []
    profiles, auto = {}, None

    def profile(world: int, r: int) -> None:
        profiles[world] = calibrate(a, world)
        print(f"> round {r + 1}: profile, {world} rank(s): "
              f"{json.dumps(profiles[world].to_dict())}", flush=True)

    for r in range(a.rounds):
        if a.calibrate == "round":
            for world in ranks:
                profile(world, r)
        for name, world, flags, _ in configs:
            if a.calibrate == "each":
                profile(world, r)
            runs[name].append((measure(a, world, flags), *predictions(a, profiles[world], flags)))
            print(f"> round {r + 1}: {name:28s} measured {runs[name][-1][0]:7.3f} s  "
                  f"predicted {runs[name][-1][1]:7.3f} s (layer alone "
                  f"{runs[name][-1][2]:7.3f} s)", flush=True)
        auto = auto or auto_choice(a, profiles[1])
        if a.calibrate == "each":
            profile(1, r)
        runs["--snake-auto"].append((measure(a, 1, auto), *predictions(a, profiles[1], auto)))
    rows = []
    for name, world, flags, candidate in configs + [("--snake-auto", 1, auto, False)]:
        measured_s = statistics.median(m for m, _, _ in runs[name])
        predicted_s = statistics.median(q for _, q, _ in runs[name])
        alone_s = statistics.median(q for _, _, q in runs[name])
        rows.append({"name": name, "world": world, "flags": flags, "candidate": candidate,
                     "measured_s": measured_s, "predicted_s": predicted_s,
                     "error": paired_error(runs[name], 1),
                     "error_of_medians": (predicted_s - measured_s) / measured_s,
                     "predicted_layer_alone_s": alone_s,
                     "error_layer_alone": paired_error(runs[name], 2),
                     "runs": runs[name]})
        print(f"> {name:28s} measured {measured_s:7.3f} s  predicted {predicted_s:7.3f} s  "
              f"error {rows[-1]['error']:+.1%}, of the medians {rows[-1]['error_of_medians']:+.1%}"
              f"  (layer alone: {rows[-1]['error_layer_alone']:+.1%})")
    auto_s = rows[-1]["measured_s"]
    fastest = min(r["measured_s"] for r in rows if r["candidate"])
    auto_ok = auto_s <= 1.05 * fastest
    print(f"> --snake-auto picks {' '.join(auto[4:])}: measured {auto_s:.3f} s, the fastest "
          f"measured candidate {fastest:.3f} s: {auto_s / fastest:.3f}x "
          f"({'within' if auto_ok else 'NOT within'} 5%)")
    median_error = statistics.median(abs(r["error"]) for r in rows)
    alone_error = statistics.median(abs(r["error_layer_alone"]) for r in rows)
    medians_error = statistics.median(abs(r["error_of_medians"]) for r in rows)
    print(f"> predicted from a layer timed alone instead: median absolute error "
          f"{alone_error:.3f}")
    print(f"> the error of the medians (each row's median prediction against its median "
          f"measurement, rounds unpaired): median absolute error {medians_error:.3f}")
    if a.png:
        draw(rows, a.png)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"profiles_last_round": {w: h.to_dict() for w, h in profiles.items()},
                       "rows": rows, "auto": {"flags": auto, "measured_s": auto_s,
                                              "fastest_candidate_s": fastest},
                       "median_abs_error": median_error,
                       "median_abs_error_of_medians": medians_error,
                       "median_abs_error_layer_alone": alone_error}, f, indent=2)
    print(f"median absolute error {median_error:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
