"""Megatron-style per-iteration log lines.

A line holds Megatron-LM 0.16.1's ``training_log`` fields first, with its names, in its
order and with its meanings (iteration, consumed samples, elapsed time per iteration,
throughput per GPU, learning rate, global batch size, lm loss, loss scale, grad norm, the
skipped and nan iteration counts), then, after ``snake:``, this project's: by default a
compact set (the peak memory, and for an offloaded run the drive's MB/s, the share of the
time spent waiting on the store and the host pool's peak); with ``--snake-log-details``
every figure (tokens/s, each memory figure, bytes per tier and kind, the activation peaks,
the waits apart).

Every figure is over the log interval (the iterations since the previous line) unless its
label says otherwise: memory peaks are reset after each line, so a line shows its own
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
    """Model FLOPs of one iteration (forward + backward, no recompute), as Megatron-LM
    0.16.1's ``num_floating_point_operations`` counts them for a dense GPT: 2 FLOPs per
    multiply-add, backward = 2 x forward, the attention core causal (half of QK^T and of
    its product with V), one output layer."""
    h, s, L = args.hidden_size, args.seq_length, args.num_layers
    kv = args.kv_channels or h // args.num_attention_heads
    q_size = kv * args.num_attention_heads
    gated = 1.5 if args.swiglu else 1.0
    per_token_per_layer = (
        2 * h * q_size  # Q and output projections
        + 2 * h * kv * args.num_query_groups  # K and V projections
        + s * q_size  # QK^T and (QK^T)V, each causal: s / 2 keys on average
        + 2 * h * args.ffn_hidden_size * gated  # MLP
    )
    per_token = L * per_token_per_layer + h * vocab_size  # + logits
    return 3 * 2 * per_token * s * args.global_batch_size


def device_word(device: torch.device) -> str:
    """Megatron-LM's "GPU" in its labels on a GPU; "device" on any other compute device
    (a CPU run has no GPU)."""
    return "GPU" if device.type == "cuda" else "device"


def _tflops(value: float) -> str:
    """Megatron-LM's one decimal, and significant digits below 0.1 (a small model on a CPU
    would print 0.0)."""
    return f"{value:.1f}" if value >= 0.1 or value == 0 else f"{value:.2g}"


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


def memory_fields(device: torch.device, retries_before: int, *, details: bool = True,
                  rss_cumulative: bool = False) -> tuple[list[str], dict, int]:
    """This interval's memory figures for the log line (every one with ``details``, else
    the device's peak allocation on a GPU and the peak RSS) and as tracker scalars, and the
    allocator's retry count now (the next interval's baseline). ``rss_cumulative``: the OS
    kept the RSS peak (it covers the run so far)."""
    rss = peak_rss_bytes()
    span = "cumulative" if rss_cumulative else "interval"
    rss_text = f"peak RSS ({span}): {gib(rss)}" if details else \
        f"peak RSS{' (cumulative)' if rss_cumulative else ''} {gib(rss)}"
    scalars = {"mem-peak-rss-bytes": rss}
    if device.type != "cuda":
        return [rss_text], scalars, 0
    stats = torch.cuda.memory_stats(device)
    retries = stats.get("num_alloc_retries", 0)
    now, peak, reserved = (stats.get(k, 0) for k in (
        "allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.peak"))
    scalars.update({"mem-allocated-bytes": now, "mem-max-allocated-bytes": peak,
                    "mem-max-reserved-bytes": reserved,
                    "mem-alloc-retries": retries - retries_before})
    if not details:
        return [f"max allocated {gib(peak)}", rss_text], scalars, retries
    return [f"mem allocated (now): {gib(now)}", f"max allocated (interval): {gib(peak)}",
            f"max reserved (interval): {gib(reserved)}",
            f"alloc retries (interval): {retries - retries_before}", rss_text], scalars, \
        retries


class TrainLog:
    """Accumulates between log lines and prints them (rank 0 only)."""

    def __init__(self, args, vocab_size: int, device: torch.device, *, rank: int = 0,
                 stream=None, trackers=None):
        self.args, self.device, self.rank, self.stream = args, device, rank, stream
        self.trackers = trackers      # TensorBoard / wandb (tracking.Trackers), or None
        self.details = getattr(args, "snake_log_details", False)
        self.flops = model_flops_per_iteration(args, vocab_size)
        self.tokens_per_iter = args.global_batch_size * args.seq_length
        # every rank computes a share of the global batch's FLOPs (Megatron-LM divides by
        # its args.world_size)
        self.world_size = args.tensor_model_parallel_size * \
            args.pipeline_model_parallel_size * getattr(args, "data_parallel_size", 1)
        self._retries = 0
        self.start_interval()

    def legend(self, store_legend: str = "") -> str:
        """The line before the first log line: what its figures cover and, by default,
        what the compact ones after ``snake:`` mean (``store_legend``: the store's,
        ``StoreMeter.LEGEND``, for an offloaded run)."""
        head = f"> log lines every {self.args.log_interval} iteration(s) (--log-interval)"
        if self.details:
            return (f"{head}: each figure covers the iterations since the previous line "
                    "unless its label says (cumulative), (now) or (last step); learning "
                    "rate and loss scale are the line's iteration's")
        memory = "max allocated: the device's peak allocation; " \
            if self.device.type == "cuda" else ""
        return (f"{head}, each figure over the iterations since the previous line: "
                "Megatron-LM's fields, then after snake: "
                f"{memory}peak RSS: the process's peak resident memory"
                + (f"; {store_legend}" if store_legend else "")
                + " (--snake-log-details: every figure)")

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
        # per GPU (per device), as Megatron-LM: the global batch's FLOPs / (time x ranks)
        throughput = self.flops / (per_iter * 1e12 * self.world_size)
        word = device_word(self.device)
        parts = [   # Megatron-LM's fields, its names and order (training_log)
            f"iteration {iteration:8d}/{self.args.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {per_iter * 1000:.1f}",
            f"throughput per {word} (TFLOP/s/{word}): {_tflops(throughput)}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {self.args.global_batch_size:5d}",
            f"lm loss: {loss:.6E}",
            f"loss scale: {loss_scale:.1f}",
        ]
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        parts += [f"number of skipped iterations: {self._skipped:3d}",
                  f"number of nan iterations: {self._nan:3d}"]
        # then the snake's
        memory, scalars, self._retries = memory_fields(
            self.device, self._retries, details=self.details,
            rss_cumulative=not self._peak_resets)
        ours = [f"tokens/s (all ranks): {self.tokens_per_iter / per_iter:.1f}"] \
            if self.details else []
        ours += memory
        text, more = extra() if extra else ("", {})
        if text:
            ours.append(text)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        self.print(f" [{stamp}] " + " | ".join(parts) + " | snake: " + " | ".join(ours)
                   + " |")
        self._track(iteration, {"iteration-time": per_iter,
                                "throughput": throughput,
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
