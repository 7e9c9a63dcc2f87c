"""The Megatron-LM plug-in against this project's own loop: one GPT trained with
``--snake-offload`` through Megatron-LM's ``pretrain_gpt.py`` and through
``examples/pretrain_gpt.py``, alternating.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python tools/bench_plugin.py --rounds 3

Each round runs, one after the other, each in a process of its own (one rank):

* **plugin**: ``python -m megatron_snake.megatron_lm $MEGATRON_LM_DIR/pretrain_gpt.py
  <flags> --snake-offload``: Megatron-LM's ``pretrain``, ``train``, ``train_step``, data
  pipeline and log, with the snake's schedule, store and offloaded AdamW;
* **own_loop**: ``python examples/pretrain_gpt.py <flags> --snake-offload``: this project's
  loop over the same components.

Both get the same model shape, batch, tokenizer (``NullTokenizer``, ``--vocab``), mock data,
precision (fp32), dropout, clipping, learning rate and offload directory, log every
iteration and do not evaluate (``--eval-iters 0``); ``--flags`` adds flags to both. The
plugin run also turns off Megatron-LM's fused kernels, which examples/pretrain_gpt.py's
model does not use (``--plugin-fusions`` keeps them: on a CPU its torch.compile'd bias-GeLU
and bias-dropout-add compile during the first iterations). Each
prints Megatron-LM's "elapsed time per iteration (ms)" per log line (examples/pretrain_gpt.py
prints the same figure under the same name); the first ``--warmup`` iterations of each run
are dropped. Per system: the median over its runs of each run's median iteration time, and
tokens/s = global batch x sequence length / that time; also the ratio per round
(``paired_ratios``) and that of the two fastest iterations (``ratio_of_fastest``: on a
shared machine, the least disturbed). The raw figures (every iteration's
time, the losses, the commands) go to ``--json-out``, the times are printed as JSON; the last line
is **tokens/s plugin / own loop** (goal: >= 0.98).

The children use ``--python`` (default: this interpreter), which must import megatron_snake
and a megatron-core of the checkout's release (docs/megatron_lm.md), with ``--threads`` torch
threads each (``OMP_NUM_THREADS``). ``--device cuda`` (the default where there is a GPU)
trains both on the GPU, the plug-in's run over NCCL; ``--flags '--bf16'`` trains both in
bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("plugin", "own_loop")
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                        r"([0-9.]+) \|.*?\blm loss: ([-+0-9.Ee]+) \|")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm-dir", default=os.environ.get("MEGATRON_LM_DIR"),
                   help="a Megatron-LM checkout of a supported release, core_v0.16.1 to "
                        "core_v0.19.0 (default: $MEGATRON_LM_DIR)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where both train (default: cuda where torch has it, else cpu)")
    p.add_argument("--python", default=sys.executable, help="the children's interpreter")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024, help="NullTokenizer's --vocab-size")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=20, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=5, help="first iterations of each run dropped")
    p.add_argument("--rounds", type=int, default=3, help="runs of each system, alternating")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each child")
    p.add_argument("--plugin-fusions", action="store_true",
                   help="keep Megatron-LM's default fused bias-GeLU, bias-dropout-add (both "
                        "torch.compile'd) and masked softmax in the plugin run (by default they "
                        "are off, as in examples/pretrain_gpt.py's model)")
    p.add_argument("--flags", default="", metavar="FLAGS",
                   help="more flags for both runs, one string (e.g. '--snake-alpha 0.5')")
    p.add_argument("--dir", default=None, help="offload directory of both (default: a new "
                   "temporary directory, removed at the end)")
    p.add_argument("--log-dir", default=None, help="keep each run's log here (default: a "
                   "temporary directory, removed at the end)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json-out", default="bench_plugin.json")
    return p


def common_flags(a, offload_dir: str) -> list[str]:
    """The flags both entry scripts take with the same meaning."""
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.global_batch), "--train-iters", str(a.iters),
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab),
            "--lr", "1e-4", "--min-lr", "0", "--lr-decay-style", "constant",
            "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(a.iters + 1),
            "--snake-offload", "--snake-offload-dir", offload_dir, *a.flags.split()]


def command(a, system: str, offload_dir: str) -> list[str]:
    if system == "plugin":
        return [a.python, "-m", "megatron_snake.megatron_lm",
                os.path.join(a.megatron_lm_dir, "pretrain_gpt.py"), *common_flags(a, offload_dir),
                # what a machine without a GPU needs (docs/megatron_lm.md); without
                # Transformer Engine or Apex a GPU needs the last two as well
                "--distributed-backend", "nccl" if a.device == "cuda" else "gloo",
                "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                # examples/pretrain_gpt.py's model has no fused kernels (training/model.py)
                *([] if a.plugin_fusions else ["--no-bias-gelu-fusion",
                                               "--no-bias-dropout-fusion",
                                               "--no-masked-softmax-fusion"])]
    return [a.python, os.path.join(ROOT, "examples", "pretrain_gpt.py"),
            *common_flags(a, offload_dir), "--device", a.device]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(a, system: str, round_: int, offload_dir: str, log_dir: str) -> dict:
    cmd = command(a, system, offload_dir)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    log = os.path.join(log_dir, f"{system}_{round_}.log")
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=a.timeout)
    wall = time.perf_counter() - started
    text = open(log).read()
    if proc.returncode != 0:
        sys.exit(f"bench_plugin.py: the {system} run exited {proc.returncode}; its log: {log}\n"
                 + text[-3000:])
    times, losses = {}, {}
    for m in _ITERATION.finditer(text):
        times[int(m.group(1))], losses[int(m.group(1))] = float(m.group(2)), float(m.group(3))
    if sorted(times) != list(range(1, a.iters + 1)):
        sys.exit(f"bench_plugin.py: the {system} run logged iterations {sorted(times)}, not "
                 f"1-{a.iters}; its log: {log}")
    kept = [times[i] for i in range(a.warmup + 1, a.iters + 1)]
    median = statistics.median(kept)
    result = {"system": system, "round": round_, "command": cmd, "wall_s": round(wall, 2),
              "iteration_ms": [times[i] for i in sorted(times)], "kept_ms": kept,
              "median_ms": median, "min_ms": min(kept),
              "tokens_per_s": a.global_batch * a.seq / (median / 1000),
              "losses": [losses[i] for i in sorted(losses)], "log": log}
    print(f"  round {round_} {system:>8}: median {median:.1f} ms per iteration over "
          f"iterations {a.warmup + 1}-{a.iters} ({result['tokens_per_s']:.1f} tokens/s), "
          f"run {wall:.1f} s", file=sys.stderr, flush=True)
    return result


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if not a.megatron_lm_dir:
        sys.exit("bench_plugin.py: set MEGATRON_LM_DIR (or --megatron-lm-dir) to a Megatron-LM "
                 "checkout, core_v0.16.1 to core_v0.19.0")
    if not os.path.isfile(os.path.join(a.megatron_lm_dir, "pretrain_gpt.py")):
        sys.exit(f"bench_plugin.py: no pretrain_gpt.py in {a.megatron_lm_dir} (MEGATRON_LM_DIR "
                 "must be a Megatron-LM checkout, core_v0.16.1 to core_v0.19.0)")
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (0 <= a.warmup < a.iters) or a.rounds < 1:
        sys.exit("bench_plugin.py: need 0 <= --warmup < --iters and --rounds >= 1")
    made = []
    offload_dir = a.dir or tempfile.mkdtemp(prefix="bench_plugin_offload_")
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="bench_plugin_logs_")
    made += [d for d, given in ((offload_dir, a.dir), (log_dir, a.log_dir)) if not given]
    os.makedirs(offload_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    report = {"machine": {"cpus": os.cpu_count(), "dir": offload_dir, "device": a.device},
              "args": {k: v for k, v in vars(a).items()},
              "tokens_per_iteration": a.global_batch * a.seq, "runs": [], "summary": None}
    try:
        for round_ in range(a.rounds):
            for system in SYSTEMS:   # A B A B ...
                report["runs"].append(measure(a, system, round_, offload_dir, log_dir))
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
    summary = {}
    for system in SYSTEMS:
        mine = [r for r in report["runs"] if r["system"] == system]
        median = statistics.median(r["median_ms"] for r in mine)
        summary[system] = {"median_ms_per_run": [r["median_ms"] for r in mine],
                           "median_ms": median,
                           "pooled_median_ms": statistics.median(
                               t for r in mine for t in r["kept_ms"]),
                           "min_ms": min(r["min_ms"] for r in mine),
                           "tokens_per_s": report["tokens_per_iteration"] / (median / 1000)}
    summary["paired_ratios"] = [p["median_ms"] / q["median_ms"] for p, q in zip(
        *([r for r in report["runs"] if r["system"] == s] for s in ("own_loop", "plugin")))]
    # the fastest iteration of each: what the loops cost when nothing else runs
    summary["ratio_of_fastest"] = summary["own_loop"]["min_ms"] / summary["plugin"]["min_ms"]
    summary["ratio"] = summary["plugin"]["tokens_per_s"] / summary["own_loop"]["tokens_per_s"]
    report["summary"] = summary
    if not a.log_dir:
        for r in report["runs"]:
            r["log"] = None   # removed with its directory
    with open(a.json_out, "w") as f:
        json.dump(report, f, indent=1)
    # the raw figures; the commands, losses and logs are in --json-out
    print(json.dumps({"tokens_per_iteration": report["tokens_per_iteration"],
                      "runs": [{k: r[k] for k in ("system", "round", "iteration_ms",
                                                  "median_ms", "min_ms", "tokens_per_s",
                                                  "wall_s")}
                               for r in report["runs"]],
                      "summary": summary}, indent=1))
    print(f"tokens/s plugin / own loop: {summary['ratio']:.3f} (median iteration "
          f"{summary['plugin']['median_ms']:.1f} against {summary['own_loop']['median_ms']:.1f} "
          f"ms, {a.rounds} rounds, iterations {a.warmup + 1}-{a.iters} of each run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
