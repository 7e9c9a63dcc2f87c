"""The largest GPT this machine trains with --snake-offload: training state many times the
peak resident memory of the process that builds and trains it.

The model is sized from the offload drive's free space (the most layers of ``--hidden``
whose NVMe plan, plus the initial weights held while the state is built, fit in
``--drive-fraction`` of it) unless ``--layers`` is given. The run is pretrain_gpt's own
(``training.build.build_run``, ``Run.step``) on random tokens, in this process, timed:
build, then each step. Per step it prints the time and the bytes read and written per
tier; at the end the raw figures go to ``--json-out``, with the pre-flight's figure for
the process's host memory beside the peak RSS it reached (the OS's VmHWM of this
process), and the last line is **training state bytes / peak RSS**. The state counted is
what the run keeps: working weights, fp32 gradients, fp32 master weights and two moments.
``--host-memory-limit`` is by default the least the pre-flight accepts: what the update's
largest part holds outside the pool, and a pool of 2 buffers. Any other flag goes to
pretrain's parser as it is (e.g. ``--snake-speculate off``,
``--snake-alpha 0.5``: the update's largest part, held in host memory, is smaller).

    python tools/bench_bigmodel.py --dir /nvme/bench --json-out bench_out/bigmodel.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.training import distributed, preflight  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.schedule.loss import report_losses  # noqa: E402
from megatron_snake.training.build import build_run  # noqa: E402
from megatron_snake.training.data import random_microbatches  # noqa: E402
from megatron_snake.training.train_log import peak_rss_bytes  # noqa: E402


def layer_params(hidden: int) -> int:
    """One GPT layer with biases and LayerNorms (Megatron's local spec, 4h MLP)."""
    return 12 * hidden * hidden + 13 * hidden


def state_bytes_per_param(bf16: bool) -> int:
    """Working weights (2 or 4), fp32 gradient 4, fp32 master 4, two fp32 moments 8."""
    return (2 if bf16 else 4) + 4 + 4 + 8


def layers_for_drive(a, free: int) -> int:
    """Most layers whose NVMe plan and the initial weights held during the build fit in
    ``drive_fraction`` of ``free``."""
    per_layer = layer_params(a.hidden) * (state_bytes_per_param(a.bf16) + (2 if a.bf16 else 4))
    return max(1, int(a.drive_fraction * free) // per_layer)


def flags(a, layers: int, root: str, extra=(), limit: str | None = None) -> list[str]:
    out = ["--num-layers", str(layers), "--hidden-size", str(a.hidden),
           "--num-attention-heads", str(a.hidden // 128), "--seq-length", str(a.seq),
           "--micro-batch-size", "1", "--global-batch-size", str(a.micro_batches),
           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab),
           "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-5",
           "--snake-offload", "--snake-offload-dir", root, "--snake-param-tier", "nvme",
           "--snake-optimizer-tier", "nvme", "--snake-activation-tier", "nvme",
           "--snake-host-memory-limit", limit or a.host_memory_limit, "--device", "cpu",
           "--train-iters", str(a.steps)]
    return out + (["--bf16"] if a.bf16 else []) + list(extra)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="offload directory (default: a temp dir)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=None,
                   help="default: as many as --drive-fraction of the free space holds")
    p.add_argument("--drive-fraction", type=float, default=0.7)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="bf16 working weights (default fp32)")
    p.add_argument("--host-memory-limit", default="least",
                   help="--snake-host-memory-limit, or least: the least the pre-flight accepts "
                        "(default)")
    p.add_argument("--json-out", default="bench_bigmodel.json")
    a, extra = p.parse_known_args(argv)
    a.pretrain_flags = extra
    root = a.dir or tempfile.mkdtemp(prefix="bench_bigmodel_")
    free = shutil.disk_usage(root).free
    layers = a.layers or layers_for_drive(a, free)
    if a.host_memory_limit == "least":
        # what the update's largest part and a pool of 2 buffers take: the refusal's figure
        given = preflight.estimate(parse_args(flags(a, layers, root, extra, "1GiB")), a.vocab)
        a.host_memory_limit = f"{preflight.least_host_limit_mib(given)}MiB"
    args = parse_args(flags(a, layers, root, extra))
    device = torch.device("cpu")
    distributed.initialize(device=device, seed=args.seed)
    # as pretrain: the pre-flight sizes the pool to what --snake-host-memory-limit leaves
    # and predicts the process's peak
    predicted = preflight.run(args, a.vocab, log=lambda line: print(line, flush=True))
    t0 = time.perf_counter()
    steps = []
    with build_run(args, device, a.vocab, log=lambda line: print(line, flush=True)) as run:
        build_s = time.perf_counter() - t0
        rss_after_build = peak_rss_bytes()
        print(f"> built in {build_s:.1f} s, peak RSS so far {rss_after_build / 2**30:.2f} GiB",
              flush=True)
        counters = run.tensor_store.counters
        for step in range(a.steps):
            before = {t: (counters.read[t], counters.written[t]) for t in ("nvme", "host")}
            start = time.perf_counter()
            out = run.step(random_microbatches(args.num_microbatches, 1, a.seq, a.vocab,
                                               seed=step, device=device))
            run.optimizer.flush()   # the step's updates are part of its time
            took = time.perf_counter() - start
            moved = {t: {"read": counters.read[t] - before[t][0],
                         "written": counters.written[t] - before[t][1]} for t in before}
            steps.append({"step_s": took, "bytes": moved,
                          "loss": [float(x) for x in report_losses(out.reports)]})
            print(f"> step {step + 1}: {took:.1f} s, nvme read {moved['nvme']['read'] / 2**30:.1f} "
                  f"GiB, written {moved['nvme']['written'] / 2**30:.1f} GiB, peak RSS "
                  f"{peak_rss_bytes() / 2**30:.2f} GiB", flush=True)
        disk_used = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root)
                        for f in files)
    distributed.shutdown()
    params = run.n_params
    state = params * state_bytes_per_param(a.bf16)
    peak = peak_rss_bytes()
    report = {"machine": {"cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") *
                          os.sysconf("SC_PHYS_PAGES"), "drive_free_bytes_at_start": free},
              "args": vars(a), "layers": layers, "params": params, "state_bytes": state,
              "build_s": build_s, "peak_rss_after_build_bytes": rss_after_build,
              "peak_rss_bytes": peak, "preflight_host_bytes": predicted.host_bytes,
              "preflight_base_rss_bytes": predicted.base_rss,
              "preflight_host_limit_bytes": predicted.host_limit,
              "offload_disk_bytes_at_end": disk_used, "steps": steps,
              "ratio_state_over_peak_rss": state / peak}
    os.makedirs(os.path.dirname(os.path.abspath(a.json_out)), exist_ok=True)
    with open(a.json_out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{params / 1e9:.2f}B parameters, {layers} layers x hidden {a.hidden}: training state "
          f"{state / 2**30:.1f} GiB, RAM {report['machine']['ram_bytes'] / 2**30:.1f} GiB, "
          f"peak RSS {peak / 2**30:.2f} GiB")
    print(f"host memory: the pre-flight predicted {predicted.host_bytes / 2**30:.2f} GiB, "
          f"the peak RSS was {peak / 2**30:.2f} GiB "
          f"({(peak - predicted.host_bytes) / predicted.host_bytes:+.1%})")
    print(f"ratio training state / peak RSS: {state / peak:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
