"""ZenFlow vs exact offloaded AdamW: how long the compute device waits for the optimizer per
step, host<->device bytes per step, and tokens/s, in one run.

Both modes train the same GPT (same seed, same random-token batches) with Megatron's DDP and
schedule, weights on the compute device and the optimizer state in host memory:

* exact: ZeRO-Offload's step, every step: every gradient to the host, the fused CPU AdamW
  over every element, every weight back (``ZenFlowAdamW`` kept in its full warm-up, which
  is exactly that);
* zenflow: ``--snake-zenflow`` (top-k ratio, update interval, overlapped CPU update).

Two figures per step: the *stall*, the time the compute device is blocked on the CPU
optimizer (exact: the whole synchronous step, gradients down, CPU AdamW, weights up;
zenflow: waiting for an overlapped CPU update that has not finished when it must land),
which is what ZenFlow removes; and the wall time of ``optimizer.step()`` (device
synchronized at both ends), which also holds the device's own share (norm, the important
columns' update, gathering the other columns' gradients). Bytes are the optimizer's own
counters (gradients to the host, weights and moved state back). On a CPU-only machine the
"device" is the CPU too: its own share and the background update run on the same cores, so
the step wall time says how the code behaves here, not what a GPU gains. Raw figures go to
``--json-out``; the ratios (zenflow / exact) are printed last, the stall ratio on the last
line.

    python tools/bench_zenflow.py --json-out bench_out/zenflow.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_snake.training import distributed  # noqa: E402
from megatron_snake.training.arguments import parse_args  # noqa: E402
from megatron_snake.training.data import random_microbatches  # noqa: E402
from megatron_snake.training.model import build_gpt_model, wrap_ddp  # noqa: E402
from megatron_snake.training.optimizer import build_zenflow_optimizer  # noqa: E402
from megatron_snake.training.step import megatron_forward_backward  # noqa: E402


def model_args(a, exact: bool):
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", str(max(1, a.hidden // 64)), "--seq-length", str(a.seq),
             "--micro-batch-size", str(a.micro_batch_size),
             "--global-batch-size", str(a.micro_batch_size * a.micro_batches),
             "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
             "--untie-embeddings-and-output-weights", "--snake-zenflow",
             "--snake-zenflow-topk-ratio", str(a.topk_ratio),
             "--snake-zenflow-update-interval", str(a.update_interval),
             "--snake-zenflow-select-interval", str(a.select_interval),
             "--train-iters", str(a.warmup + a.steps)]
    if a.bf16:
        flags.append("--bf16")
    if not a.no_overlap:
        flags.append("--snake-zenflow-overlap-step")
    if exact:  # every step in the exact full warm-up: ZeRO-Offload's exact step
        flags += ["--snake-zenflow-full-warmup-steps", str(a.warmup + a.steps)]
    return parse_args(flags)


def run_mode(a, device, exact: bool) -> dict:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    args = model_args(a, exact)
    distributed.set_seed(1234)
    gpt = build_gpt_model(args, a.vocab, device)
    if a.bf16:
        gpt = Float16Module(gpt.config, gpt)
    model = wrap_ddp(gpt)
    config = gpt.config
    config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads
    opt, sched = build_zenflow_optimizer(args, model)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    compute, wait, d2h, h2d, cpu_wait = [], [], [], [], []
    for step in range(a.warmup + a.steps):
        batches = random_microbatches(a.micro_batches, a.micro_batch_size, a.seq, a.vocab,
                                      seed=step, device=device)
        model.zero_grad_buffer()
        opt.zero_grad()
        sync()
        t0 = time.perf_counter()
        megatron_forward_backward(model, batches)
        sync()
        t1 = time.perf_counter()
        before = (opt.traffic.d2h, opt.traffic.h2d, opt.traffic.cpu_wait_s)
        opt.step()
        sync()
        t2 = time.perf_counter()
        sched.step(increment=args.global_batch_size)
        if step >= a.warmup:
            compute.append(t1 - t0)
            wait.append(t2 - t1)
            d2h.append(opt.traffic.d2h - before[0])
            h2d.append(opt.traffic.h2d - before[1])
            cpu_wait.append(opt.traffic.cpu_wait_s - before[2])
    opt.flush()
    opt.close()
    tokens = args.global_batch_size * args.seq_length
    return {
        "mode": "exact" if exact else "zenflow",
        "compute_s_per_step": statistics.mean(compute),
        "stall_s_per_step": statistics.mean(cpu_wait),
        "optimizer_step_s_per_step": statistics.mean(wait),
        "optimizer_step_s_median": statistics.median(wait),
        "d2h_bytes_per_step": statistics.mean(d2h),
        "h2d_bytes_per_step": statistics.mean(h2d),
        "host_device_bytes_per_step": statistics.mean(d2h) + statistics.mean(h2d),
        "tokens_per_s": tokens * len(compute) / (sum(compute) + sum(wait)),
        "selected_fraction": opt.selected_fraction(),
        "parameters": sum(p.param.numel() for p in opt.params),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--topk-ratio", type=float, default=0.1)
    p.add_argument("--update-interval", type=int, default=4)
    p.add_argument("--select-interval", type=int, default=100)
    p.add_argument("--no-overlap", action="store_true", help="synchronous CPU update")
    p.add_argument("--bf16", action="store_true", help="bf16 working weights (GPU)")
    p.add_argument("--warmup", type=int, default=4, help="steps not timed (each mode)")
    p.add_argument("--steps", type=int, default=24, help="timed steps (each mode)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    device = distributed.resolve_device(a.device)
    distributed.initialize(device=device, seed=1234)
    try:
        results = [run_mode(a, device, exact=True), run_mode(a, device, exact=False)]
    finally:
        distributed.shutdown()
    exact, zen = results
    ratios = {k: zen[k] / exact[k] if exact[k] else float("nan")
              for k in ("stall_s_per_step", "optimizer_step_s_per_step", "d2h_bytes_per_step",
                        "h2d_bytes_per_step", "host_device_bytes_per_step", "tokens_per_s")}
    report = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if
              device.type == "cuda" else None, "threads": torch.get_num_threads(),
              "settings": vars(a), "results": results, "ratio_zenflow_over_exact": ratios}
    if a.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(a.json_out)), exist_ok=True)
        with open(a.json_out, "w") as f:
            json.dump(report, f, indent=2)
    print(f"device {device}, {torch.get_num_threads()} threads, "
          f"{results[0]['parameters'] / 1e6:.2f}M parameters, {a.steps} timed steps each")
    for r in results:
        print(f"{r['mode']:8s} compute {r['compute_s_per_step'] * 1e3:7.1f} ms/step | "
              f"stall {r['stall_s_per_step'] * 1e3:6.1f} ms/step | "
              f"optimizer.step() {r['optimizer_step_s_per_step'] * 1e3:6.1f} ms/step | "
              f"d2h {r['d2h_bytes_per_step'] / 2**20:6.2f} MiB/step | "
              f"h2d {r['h2d_bytes_per_step'] / 2**20:6.2f} MiB/step | "
              f"{r['tokens_per_s']:.0f} tokens/s")
    print(f"ratio zenflow/exact: optimizer.step() time {ratios['optimizer_step_s_per_step']:.3f}, "
          f"d2h bytes {ratios['d2h_bytes_per_step']:.3f}, h2d bytes "
          f"{ratios['h2d_bytes_per_step']:.3f}, host<->device bytes "
          f"{ratios['host_device_bytes_per_step']:.3f}, tokens/s {ratios['tokens_per_s']:.3f}")
    print(f"ratio zenflow/exact stall (device blocked on the CPU optimizer) per step: "
          f"{ratios['stall_s_per_step']:.3f} ({1 - ratios['stall_s_per_step']:.1%} less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
