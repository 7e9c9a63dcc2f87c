"""Step time of the vertical schedule vs Megatron-Core's schedule with full recompute.

Baseline: ``forward_backward_no_pipelining`` with ``recompute_granularity="full"``,
``recompute_method="uniform"``, ``recompute_num_layers`` = the checkpoint interval: the same
arithmetic as the vertical schedule (every unit run forward without autograd, then
recomputed in backward), except that the vertical schedule does not recompute its last
unit (it runs once, fused with the loss). Megatron without recompute (the arithmetic lower
bound) is timed too, for reference. All run in this process on the same model and
micro-batches, in rotating order, so machine noise hits them alike. Prints ``ratio
ours/baseline`` last; raw figures go to ``--json-out``.

    python tools/bench_schedule.py                  # CPU sizes
    python tools/bench_schedule.py --preset gpu-1b --bf16   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

import torch  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

from megatron_snake.schedule.vertical import vertical_forward_backward  # noqa: E402
from megatron_snake.training import distributed  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.data import random_microbatches  # noqa: E402
from megatron_snake.training.model import build_gpt_model  # noqa: E402
from megatron_snake.training.step import megatron_forward_backward  # noqa: E402

# (layers, hidden, heads, seq, micro-batch size, micro-batches, checkpoint interval)
PRESETS = {
    "cpu": [(4, 256, 4, 256, 2, 4, 1), (6, 256, 4, 256, 2, 4, 2), (4, 512, 8, 128, 2, 4, 2)],
    "cpu-small": [(4, 128, 4, 128, 2, 4, 1)],
    "gpu-1b": [(24, 2048, 16, 2048, 2, 8, 1), (24, 2048, 16, 2048, 2, 8, 2)],
}


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_case(case, *, device, steps, warmup, bf16):
    layers, hidden, heads, seq, mbs, num_mb, interval = case
    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads), "--seq-length", str(seq),
             "--hidden-dropout", "0", "--attention-dropout", "0",
             "--position-embedding-type", "rope"] + (["--bf16"] if bf16 else [])
    args = parse_args(flags)
    vocab = 1024
    model = build_gpt_model(args, vocab, device)
    if bf16:  # half-precision weights take fp32 inputs through Megatron's wrapper, as in training
        model = Float16Module(model.config, model)
    config = model.config
    batches = random_microbatches(num_mb, mbs, seq, vocab, device=device)

    def baseline():
        config.recompute_granularity, config.recompute_method = "full", "uniform"
        config.recompute_num_layers = interval
        try:
            megatron_forward_backward(model, batches)
        finally:
            config.recompute_granularity = config.recompute_method = None
            config.recompute_num_layers = None

    def no_recompute():
        megatron_forward_backward(model, batches)

    def ours():
        vertical_forward_backward(model, batches, checkpoint_interval=interval)

    runs = [("baseline", baseline), ("ours", ours), ("no_recompute", no_recompute)]
    times = {name: [] for name, _ in runs}
    for i in range(warmup + steps):
        for name, fn in runs[i % 3:] + runs[:i % 3]:  # rotate the order between steps
            model.zero_grad(set_to_none=True)
            t = _timed(fn, device)
            if i >= warmup:
                times[name].append(t)
    result = {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq,
              "micro_batch_size": mbs, "micro_batches": num_mb, "checkpoint_interval": interval,
              "baseline_s": statistics.median(times["baseline"]),
              "ours_s": statistics.median(times["ours"]),
              "no_recompute_s": statistics.median(times["no_recompute"]),
              "all_s": times}
    result["ratio"] = result["ours_s"] / result["baseline_s"]
    result["ratio_vs_no_recompute"] = result["ours_s"] / result["no_recompute_s"]
    del model
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json-out", default="bench_schedule.json")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = distributed.resolve_device(a.device)
    distributed.initialize(device=device, seed=1234)
    results = []
    for case in PRESETS[a.preset]:
        r = bench_case(case, device=device, steps=a.steps, warmup=a.warmup, bf16=a.bf16)
        results.append(r)
        print(f"layers {r['layers']:3d} hidden {r['hidden']:5d} seq {r['seq']:5d} "
              f"mbs {r['micro_batch_size']} M {r['micro_batches']} interval "
              f"{r['checkpoint_interval']}: megatron+full-recompute {r['baseline_s'] * 1e3:9.1f} ms"
              f"  vertical {r['ours_s'] * 1e3:9.1f} ms  ratio {r['ratio']:.3f}  (megatron without "
              f"recompute {r['no_recompute_s'] * 1e3:.1f} ms, vertical/that "
              f"{r['ratio_vs_no_recompute']:.3f})", flush=True)
    geo = statistics.geometric_mean([r["ratio"] for r in results])
    with open(a.json_out, "w") as f:
        json.dump({"device": str(device), "torch": torch.__version__, "threads":
                   torch.get_num_threads(), "preset": a.preset, "bf16": a.bf16,
                   "cases": results, "ratio_geomean": geo}, f, indent=1)
    distributed.shutdown()
    print(f"ratio ours/baseline (geometric mean over {len(results)} sizes): {geo:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
