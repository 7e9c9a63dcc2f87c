"""Step time and bytes moved per step: vertical vs horizontal over the same offloaded store,
for M = 1..16 micro-batches; and the CPU AdamW rate against a memory-bandwidth bound.

Both schedules train the same GPT with weights, gradients and AdamW states on the NVMe
tier (``OffloadedUnits`` + ``OffloadedAdamW``), in this process, alternating. Bytes are the
store's own counters (per kind of state), not estimates. The AdamW bound: a fused AdamW
step updates param, exp_avg and exp_avg_sq in place and reads grad (7 x 4 bytes per fp32
parameter); the bound is the in-place streaming bandwidth measured here (``x.mul_(c)``:
bytes read + written per second, the same access pattern) / 28. Prints the ratios last;
raw figures go to ``--json-out``.

GPU part (only when CUDA is available): a GPT whose full training state (working weights,
fp32 gradients, fp32 master weights and Adam moments) is at least ``--gpu-state-ratio`` (3)
times the GPU memory it is given (``torch.cuda.set_per_process_memory_fraction``), trained
with ``--snake-offload``, against the same model trained without offload (Megatron's
schedule and optimizer) on the same GPU with no limit: tokens/s of each at the best of
``--gpu-micro-batches``, their ratio, and the fraction of the optimizer step hidden behind
compute (1 - time compute waited for an update / time the updates took). The ideal run must
fit the whole GPU: keep the fraction times the ratio well below 1.

    python tools/bench_step.py --dir /nvme/scratch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

import torch  # noqa: E402

from megatron_snake.models.gpt_units import GPTUnits  # noqa: E402
from megatron_snake.offload.unit_inputs import OffloadedUnitInputs  # noqa: E402
from megatron_snake.storage.store import TensorStore  # noqa: E402
from megatron_snake.offload.unit_weights import OffloadedUnits  # noqa: E402
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW  # noqa: E402
from megatron_snake.optim.unit_params import UnitParams  # noqa: E402
from megatron_snake.schedule.unit_store import CombinedStore  # noqa: E402
from megatron_snake.schedule.vertical import (  # noqa: E402
    horizontal_forward_backward, vertical_forward_backward)
from megatron_snake.training import distributed  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.data import random_microbatches  # noqa: E402
from megatron_snake.training.model import build_gpt_model  # noqa: E402

SCHEDULES = {"vertical": vertical_forward_backward, "horizontal": horizontal_forward_backward}


def bench_schedule(name, num_mb, a, store_dir, device):
    args = parse_args(["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
                       "--num-attention-heads", "8", "--seq-length", str(a.seq),
                       "--hidden-dropout", "0", "--attention-dropout", "0",
                       "--untie-embeddings-and-output-weights"])
    vocab = 1024
    model = build_gpt_model(args, vocab, device)
    params = UnitParams.of(GPTUnits(model, 1))
    times, moved = [], []
    with TensorStore(store_dir, rank=0, host_memory_limit=1 << 30, device=device) as tstore:
        opt = OffloadedAdamW(params, tstore, lr=1e-4, weight_decay=0.01, alpha=a.alpha)
        weights = OffloadedUnits(params, tstore, opt, device=device, dtype=torch.float32)
        for step in range(a.warmup + a.steps):
            batches = random_microbatches(num_mb, a.micro_batch_size, a.seq, vocab, seed=step,
                                         device=device)
            before = {k: [list(v) for v in t.values()]
                      for k, t in tstore.counters.by_kind.items()}
            start = time.perf_counter()
            store = CombinedStore(OffloadedUnitInputs(tstore, "nvme", num_mb, device), weights)
            SCHEDULES[name](model, batches, checkpoint_interval=1, store=store)
            store.inputs.finish_step()
            opt.step()
            tstore.synchronize()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if step >= a.warmup:
                times.append(elapsed)
                delta = {}
                for kind, tiers in tstore.counters.by_kind.items():
                    old = before.get(kind, [[0, 0]] * len(tiers))
                    nvme = list(tiers)  # tier order: gpu, host, nvme
                    delta[kind] = {"nvme_read": tiers["nvme"][0] - old[nvme.index("nvme")][0],
                                   "nvme_written": tiers["nvme"][1] - old[nvme.index("nvme")][1]}
                moved.append(delta)
        opt.close()
    return {"schedule": name, "micro_batches": num_mb, "step_s": statistics.median(times),
            "bytes": moved[-1]}


def stream_triad_bytes_per_s(numel: int, repeats: int = 5) -> float:
    """STREAM's triad a = b + s * c on every core, counting the bytes that really cross
    the memory bus: 16 per fp32 element (b and c read, a written, and a's cache lines read
    before they are written: the write-allocate STREAM's 12 leaves out)."""
    a, b, c = torch.empty(numel), torch.randn(numel), torch.randn(numel)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - start)
    return 16 * numel / min(times)


def bench_adamw(numel: int, repeats: int = 5):
    """Fused CPU AdamW parameters/s against the memory-bandwidth bound: the machine's
    streaming bandwidth with every core (the better of STREAM's triad and an in-place
    stream, ``x.mul_``, which moves data the way AdamW does: read, then written back in
    place) / the 28 bytes per parameter AdamW must move (reads weight, gradient and two
    moments, writes weight and two moments). Earlier runs used the in-place stream on one
    thread, which AdamW on all threads beat: no bound."""
    torch.set_num_threads(os.cpu_count() or 1)
    p, g, m, v = (torch.randn(numel) for _ in range(4))
    v.abs_()
    scratch = torch.randn(numel)
    stream = []
    for _ in range(repeats):
        start = time.perf_counter()
        scratch.mul_(1.0000001)
        stream.append(time.perf_counter() - start)
    copy_bw = 2 * 4 * numel / min(stream)  # bytes read + written per second, in place
    triad_bw = stream_triad_bytes_per_s(numel, repeats)
    step = torch.tensor(1.0)
    adam = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        adam.append(time.perf_counter() - start)
    rate = numel / min(adam)
    bound = max(triad_bw, copy_bw) / 28
    return {"numel": numel, "threads": torch.get_num_threads(), "inplace_GBps": copy_bw / 1e9,
            "triad_GBps": triad_bw / 1e9, "adamw_params_per_s": rate,
            "bound_params_per_s": bound, "ratio": rate / bound}


def gpt_flags(a, num_layers: int, num_mb: int) -> list[str]:
    return ["--num-layers", str(num_layers), "--hidden-size", str(a.gpu_hidden),
            "--num-attention-heads", str(a.gpu_hidden // 128), "--seq-length", str(a.gpu_seq),
            "--micro-batch-size", str(a.gpu_micro_batch_size),
            "--global-batch-size", str(a.gpu_micro_batch_size * num_mb), "--bf16",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--untie-embeddings-and-output-weights"]


def layers_for_state(a, device_budget: int) -> int:
    """Fewest layers whose training state is >= gpu_state_ratio x device_budget: bf16
    weights 2 + fp32 gradient 4 + fp32 master and moments 12 bytes per parameter."""
    per_layer = 12 * a.gpu_hidden ** 2 + 13 * a.gpu_hidden
    return max(1, -(-int(a.gpu_state_ratio * device_budget) // (18 * per_layer)))


def train_tokens_per_s(args, device, *, steps: int, warmup: int, vocab: int = 32768) -> dict:
    """Train the run ``args`` describe (built as pretrain_gpt builds it) for warmup + steps
    on random tokens: tokens/s over the last ``steps``, peak device memory, and (offload)
    the fraction of the optimizer's update time hidden behind compute."""
    from megatron_snake.training.build import build_run

    cuda = device.type == "cuda"   # the CPU runs it too, as a smoke test of this code
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with build_run(args, device, vocab) as run:
        opt = run.optimizer
        start = update_s = blocked_s = None
        for step in range(warmup + steps):
            if step == warmup:
                sync()
                start = time.perf_counter()
                update_s, blocked_s = getattr(opt, "update_s", 0), getattr(opt, "blocked_s", 0)
            run.step(random_microbatches(args.num_microbatches, args.micro_batch_size,
                                         args.seq_length, vocab, seed=step, device=device))
        sync()
        elapsed = time.perf_counter() - start
        out = {"tokens_per_s": steps * args.global_batch_size * args.seq_length / elapsed,
               "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0}
        if args.snake_offload:
            update = opt.update_s - update_s
            out["hidden_fraction"] = 1.0 - (opt.blocked_s - blocked_s) / max(update, 1e-9)
    return out


def bench_gpu(a, device, root) -> dict:
    """Offloaded under a memory fraction vs the ideal (no offload, no limit), per M."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(a.gpu_fraction * total)
    layers = layers_for_state(a, budget)
    rows = []
    for num_mb in [int(x) for x in a.gpu_micro_batches.split(",")]:
        args = parse_args(gpt_flags(a, layers, num_mb) +
                          ["--snake-offload", "--snake-alpha", str(a.alpha),
                           "--snake-offload-dir", root] + a.gpu_snake_flags.split())
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(a.gpu_fraction, device)
        snake = train_tokens_per_s(args, device, steps=a.steps, warmup=a.warmup)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        ideal = train_tokens_per_s(parse_args(gpt_flags(a, layers, num_mb)), device,
                                   steps=a.steps, warmup=a.warmup)
        rows.append({"micro_batches": num_mb, "offloaded": snake, "ideal": ideal})
        print(f"GPU M {num_mb:3d}: offloaded {snake['tokens_per_s']:9.0f} tokens/s (peak "
              f"{snake['peak_bytes'] / 2**30:.1f} GiB of {budget / 2**30:.1f}), ideal "
              f"{ideal['tokens_per_s']:9.0f} tokens/s (peak {ideal['peak_bytes'] / 2**30:.1f} "
              f"GiB), optimizer step hidden {snake['hidden_fraction']:.1%}", flush=True)
    best_snake = max(rows, key=lambda r: r["offloaded"]["tokens_per_s"])
    best_ideal = max(r["ideal"]["tokens_per_s"] for r in rows)
    params = layers * (12 * a.gpu_hidden ** 2 + 13 * a.gpu_hidden)
    return {"layers": layers, "params": params, "state_bytes": 18 * params,
            "device_budget_bytes": budget, "rows": rows,
            "ratio_tokens_per_s": best_snake["offloaded"]["tokens_per_s"] / best_ideal,
            "hidden_fraction": best_snake["offloaded"]["hidden_fraction"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="offload directory (default: a temp dir)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--micro-batches", default="1,2,4,8,16")
    p.add_argument("--alpha", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--adamw-numel", type=int, default=64 << 20)
    p.add_argument("--json-out", default="bench_step.json")
    p.add_argument("--adamw-only", action="store_true",
                   help="only the CPU AdamW against the memory-bandwidth bound")
    g = p.add_argument_group("GPU part (run only when CUDA is available)")
    g.add_argument("--gpu-fraction", type=float, default=0.1,
                   help="fraction of GPU memory the offloaded run may use")
    g.add_argument("--gpu-state-ratio", type=float, default=3.0,
                   help="training state / device memory given: sets the number of layers")
    g.add_argument("--gpu-hidden", type=int, default=4096)
    g.add_argument("--gpu-seq", type=int, default=2048)
    g.add_argument("--gpu-micro-batch-size", type=int, default=1)
    g.add_argument("--gpu-micro-batches", default="8,16",
                   help="M values tried; the best tokens/s of each run is compared")
    g.add_argument("--gpu-snake-flags", default="",
                   help="more pretrain_gpt flags for the offloaded run, e.g. "
                        "'--snake-optimizer-tier host --snake-host-memory-limit 48GiB'")
    a = p.parse_args(argv)
    if a.adamw_only:
        adamw = bench_adamw(a.adamw_numel)
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "adamw": adamw}, f, indent=1)
        print(f"CPU AdamW {adamw['adamw_params_per_s'] / 1e6:.0f} M params/s; in-place stream "
              f"{adamw['inplace_GBps']:.1f} GB/s, STREAM triad {adamw['triad_GBps']:.1f} GB/s "
              f"({adamw['threads']} threads)")
        print(f"ratio AdamW rate / memory bound: {adamw['ratio']:.3f}")
        return 0
    device = distributed.resolve_device("auto")
    distributed.initialize(device=device, seed=1234)
    root = a.dir or tempfile.mkdtemp(prefix="bench_step_")
    results = []
    for num_mb in [int(x) for x in a.micro_batches.split(",")]:
        for name in SCHEDULES:
            sub = os.path.join(root, f"{name}{num_mb}")
            os.makedirs(sub, exist_ok=True)
            r = bench_schedule(name, num_mb, a, sub, device)
            results.append(r)
            w = r["bytes"].get("weights", {})
            print(f"{name:10s} M {num_mb:3d}: step {r['step_s'] * 1e3:8.1f} ms | weights from "
                  f"NVMe {w.get('nvme_read', 0) / 2**20:8.2f} MiB | all NVMe r/w "
                  f"{sum(k['nvme_read'] for k in r['bytes'].values()) / 2**20:8.2f}/"
                  f"{sum(k['nvme_written'] for k in r['bytes'].values()) / 2**20:8.2f} MiB",
                  flush=True)
    adamw = bench_adamw(a.adamw_numel)
    print(f"CPU AdamW: {adamw['adamw_params_per_s'] / 1e6:.1f} M params/s, STREAM triad "
          f"{adamw['triad_GBps']:.2f} GB/s -> bound {adamw['bound_params_per_s'] / 1e6:.1f} M "
          f"params/s at 28 B each ({adamw['threads']} threads; in-place stream "
          f"{adamw['inplace_GBps']:.2f} GB/s)")
    largest = max(r["micro_batches"] for r in results)
    v = next(r for r in results if r["schedule"] == "vertical" and r["micro_batches"] == largest)
    h = next(r for r in results if r["schedule"] == "horizontal" and r["micro_batches"] == largest)
    ratio = v["step_s"] / h["step_s"]
    gpu = bench_gpu(a, device, root) if torch.cuda.is_available() else None
    with open(a.json_out, "w") as f:
        json.dump({"device": str(device), "args": vars(a), "steps": results, "adamw": adamw,
                   "ratio_vertical_over_horizontal": ratio, "gpu": gpu}, f, indent=1)
    distributed.shutdown()
    print(f"ratio vertical/horizontal step time at M={largest}: {ratio:.3f} | "
          f"ratio AdamW rate / memory bound: {adamw['ratio']:.3f}"
          + ("" if gpu is None else
             f" | GPU ({gpu['params'] / 1e9:.2f}B parameters, state "
             f"{gpu['state_bytes'] / gpu['device_budget_bytes']:.1f}x the device memory "
             f"given): ratio tokens/s offloaded / ideal {gpu['ratio_tokens_per_s']:.3f}, "
             f"optimizer step hidden {gpu['hidden_fraction']:.1%}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
