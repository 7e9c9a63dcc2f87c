"""Megatron-style per-iteration log lines: loss, throughput, model TFLOP/s, memory.

Every figure is over the log interval (the iterations since the previous line) unless its
label says "cumulative": memory peaks are reset after each line, so a line shows its own
interval's peak, not the start-up one.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from datetime import datetime

import torch

from megatron_snake.storage.sizes import gib


def model_flops_per_iteration(args: argparse.Namespace, vocab_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward, no recompute), the way Megatron-LM
    counts them for a dense GPT: 2 FLOPs per multiply-add, backward = 2 x forward."""
    h, s, L = args.hidden_size, args.seq_length, args.num_layers
    kv = args.kv_channels or h // args.num_attention_heads
    q_size = kv * args.num_attention_heads
    gated = 1.5 if args.swiglu else 1.0
    per_token_per_layer = (
        2 * h * q_size  # Q and output projections
        + 2 * h * kv * args.num_query_groups  # K and V projections
        + 2 * s * q_size  # attention scores and attention over values
        + 2 * h * args.ffn_hidden_size * gated  # MLP
    )
    per_token = L * per_token_per_layer + h * vocab_size  # + logits
    return 3 * 2 * per_token * s * args.global_batch_size


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak of the device's memory and of the host RSS. False where the OS
    cannot reset the RSS peak (that figure is then cumulative)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:  # "5" resets the peak resident set size (Documentation/filesystems/proc.rst)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_fields(device: torch.device, retries_before: int) -> tuple[list[str], dict, int]:
    """This interval's memory figures for the log line and as tracker scalars, and the
    allocator's retry count now (the next interval's baseline)."""
    rss = peak_rss_bytes()
    text, scalars = [f"peak RSS (interval): {gib(rss)}"], {"mem-peak-rss-bytes": rss}
    if device.type != "cuda":
        return text, scalars, 0
    stats = torch.cuda.memory_stats(device)
    retries = stats.get("num_alloc_retries", 0)
    now, peak, reserved = (stats.get(k, 0) for k in (
        "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.peak"))
    scalars.update({"mem-allocated-bytes": now, "mem-max-allocated-bytes": peak,
                    "mem-max-reserved-bytes": reserved,
                    "mem-alloc-retries": retries - retries_before})
    return [f"mem allocated (now): {gib(now)}", f"max allocated (interval): {gib(peak)}",
            f"max reserved (interval): {gib(reserved)}",
            f"alloc retries (interval): {retries - retries_before}", *text], scalars, retries


class TrainLog:
    """Accumulates between log lines and prints them (rank 0 only)."""

    def __init__(self, args, vocab_size: int, device: torch.device, *, rank: int = 0,
                 stream=None, trackers=None):
        self.args, self.device, self.rank, self.stream = args, device, rank, stream
        self.trackers = trackers      # TensorBoard / wandb (tracking.Trackers), or None
        self.flops = model_flops_per_iteration(args, vocab_size)
        self.tokens_per_iter = args.global_batch_size * args.seq_length
        # every rank computes a share of the global batch's FLOPs
        self.world_size = args.tensor_model_parallel_size * \
            args.pipeline_model_parallel_size * getattr(args, "data_parallel_size", 1)
        self._retries = 0
        self.start_interval()

    def start_interval(self):
        """A new log interval starts now (the train loop calls it before its first step, so
        start-up time and memory count in no interval)."""
        self._peak_resets = reset_peak_memory(self.device)
        if self.device.type == "cuda":
            self._retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        self._start = time.perf_counter()
        self._iters = 0
        self._loss_sum = 0.0
        self._skipped = 0
        self._nan = 0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` just spent (evaluating, saving) out of this interval's time."""
        self._start += seconds

    def print(self, line: str):
        if self.rank == 0:
            print(line, file=self.stream or sys.stdout, flush=True)  # stdout as it is now

    def step(self, *, iteration: int, consumed_samples: int, lm_loss: float, lr: float,
             grad_norm, loss_scale: float, skipped: bool, extra=None):
        """One iteration. ``extra``: called on log iterations only, it returns more of the
        interval's figures as (log-line text, tracker scalars)."""
        self._track(iteration, {"lm loss": lm_loss, "learning-rate": lr, "grad-norm": grad_norm,
                                "loss-scale": loss_scale if self.args.fp16 else None,
                                "batch-size": self.args.global_batch_size})
        self._iters += 1
        self._skipped += int(skipped)
        if math.isnan(lm_loss) or math.isinf(lm_loss):
            self._nan += 1
        else:
            self._loss_sum += lm_loss
        if iteration % self.args.log_interval:
            return
        elapsed = time.perf_counter() - self._start
        per_iter = elapsed / self._iters
        valid = self._iters - self._nan
        loss = self._loss_sum / valid if valid else float("nan")
        tflops = self.flops / per_iter / 1e12
        parts = [
            f"iteration {iteration:8d}/{self.args.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {per_iter * 1000:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops / self.world_size:.3f}"
            if self.device.type == "cuda" else
            f"model TFLOP/s (all ranks): {tflops:.4f}",
            f"tokens/s (all ranks): {self.tokens_per_iter / per_iter:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {self.args.global_batch_size:5d}",
            f"lm loss: {loss:.6E}",
        ]
        if self.args.fp16:
            parts.append(f"loss scale: {loss_scale:.1f}")
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        memory, scalars, self._retries = memory_fields(self.device, self._retries)
        if not self._peak_resets:   # the OS kept the RSS peak: say it is cumulative
            memory = [m.replace("(interval)", "(cumulative)") if m.startswith("peak RSS")
                      else m for m in memory]
        parts += [f"number of skipped iterations: {self._skipped:3d}",
                  f"number of nan iterations: {self._nan:3d}", *memory]
        text, more = extra() if extra else ("", {})
        if text:
            parts.append(text)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        self.print(f" [{stamp}] " + " | ".join(parts) + " |")
        self._track(iteration, {"iteration-time": per_iter,
                                "throughput": tflops / self.world_size,
                                "tokens-per-sec": self.tokens_per_iter / per_iter,
                                **scalars, **more})
        self.start_interval()

    def _track(self, iteration: int, scalars: dict) -> None:
        if self.trackers is not None and self.trackers.active:
            self.trackers.write({k: v for k, v in scalars.items() if v is not None}, iteration)

    def validation(self, iteration: int, lm_loss: float):
        ppl = math.exp(min(20.0, lm_loss))
        line = (f" validation loss at iteration {iteration} | lm loss value: {lm_loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} |")
        bar = "-" * len(line)
        self.print(f"{bar}\n{line}\n{bar}")
        self._track(iteration, {"lm loss validation": lm_loss, "lm loss validation ppl": ppl})
