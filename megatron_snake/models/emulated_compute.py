"""An emulated compute device for benchmarks (tools/bench_overlap.py): each unit's compute
is replaced by device time as long as a device of a given TFLOP/s would take.

Everything else of a step is real: the schedule, the store and its drive, the CPU
optimizer, the unit checkpoints (the unit passes its input on, so the checkpoints keep
their real shapes and bytes). The device time goes on the clock of
``megatron_snake.emulated_device``, which runs apart from the host as a GPU's compute
stream does: a unit's forward or backward is queued and the host goes on, and the store's
workers wait for the clock where they would wait for a CUDA event (a unit's output copied
out, a buffer the device still reads). The CPU stays free for the store's and the
optimizer's threads. So the ratio of compute to drive, copy and optimizer work can be set
to a real GPU's on a machine without one.

Numbers change under emulation (the units compute nothing and every gradient is zero), so
it is a benchmark mode only: ``emulate_compute`` patches one ``GPTUnits`` object for the
duration of a ``with`` block, and no flag of the training script turns it on.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import megatron_snake.emulated_device as emulated_device
import megatron_snake.timeline as timeline
from megatron_snake.models.gpt_units import GPTUnits, MicroBatchContext
from megatron_snake.planner.workload import layer_flops_per_token


def _layer_flops_per_token(config, seq_length: int) -> float:
    """Forward FLOPs of one decoder layer per token on this tensor-parallel rank (the
    planner's count, from the model's config)."""
    return layer_flops_per_token(
        hidden=config.hidden_size, heads=config.num_attention_heads,
        kv_channels=config.kv_channels,
        query_groups=config.num_query_groups or config.num_attention_heads,
        ffn=config.ffn_hidden_size, gated=config.gated_linear_unit, seq_length=seq_length,
        tp=config.tensor_model_parallel_size)


def unit_forward_flops(units: GPTUnits, unit: int, batch: int, seq_length: int) -> float:
    """Forward FLOPs of ``unit`` for one micro-batch of ``batch`` x ``seq_length`` tokens;
    the unit that ends the model adds the output layer (the embedding is a lookup)."""
    tokens = batch * seq_length
    flops = len(units.unit_layers[unit]) * _layer_flops_per_token(units.config, seq_length)
    if units.owns_head(unit):
        flops += 2 * units.config.hidden_size * units.gpt.vocab_size \
            / units.config.tensor_model_parallel_size
    return flops * tokens


class _DeviceTime(torch.autograd.Function):
    """Identity on the activation; forward queues ``seconds`` on the device's clock,
    backward twice as long (a backward computes the gradients of both the input and the
    weights)."""

    @staticmethod
    def forward(ctx, hidden, seconds: float, clock):
        ctx.seconds, ctx.clock = seconds, clock
        _launch(clock, seconds)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        _launch(ctx.clock, 2 * ctx.seconds)
        # a view: autograd can hand it to the input as its gradient without the copy a
        # device would make in microseconds and the CPU in milliseconds
        return grad.view_as(grad), None, None


def _launch(clock, seconds: float) -> None:
    """Queue the work on the device's clock and record it on the timeline's device row."""
    start, end = clock.launch(seconds)
    timeline.record("device", "device", start, end, thread="device", seconds=seconds)


@contextmanager
def emulate_compute(units: GPTUnits, tflops: float, link_bytes_per_s: float | None = None,
                    memory_bytes_per_s: float | None = None):
    """Within the block, ``units.forward_unit`` queues what a ``tflops`` device would take on
    the emulated device's clock instead of computing (the block runs
    ``emulated_device.emulating(link_bytes_per_s, memory_bytes_per_s)``; yields the clock;
    with a link rate the copies between the device and host memory are a host link's, not
    CPU copies; with a memory rate the device share's updates are the device's). The
    vertical schedule's forward sweep then queues one forward per (unit, micro-batch) and
    its backward sweep a recompute and a backward (three), as the device would."""
    if tflops <= 0:
        raise ValueError(f"emulated TFLOP/s must be > 0, got {tflops}")
    dtype = units.config.params_dtype
    if getattr(units.config, "bf16", False):
        dtype = torch.bfloat16
    elif getattr(units.config, "fp16", False):
        dtype = torch.float16
    embedded: dict = {}   # (shape, device) -> the activation unit 0 "produces"

    def forward_unit(unit: int, hidden, ctx: MicroBatchContext):
        batch, seq = ctx.batch["tokens"].shape
        seconds = unit_forward_flops(units, unit, batch, seq) / (tflops * 1e12)
        if hidden is None:   # unit 0 embeds the tokens: an activation of the right shape
            key = ((seq, batch, units.config.hidden_size), ctx.batch["tokens"].device)
            if key not in embedded:
                embedded[key] = torch.zeros(key[0], dtype=dtype, device=key[1])
            hidden = embedded[key].detach().requires_grad_(torch.is_grad_enabled())
        out = _DeviceTime.apply(hidden, seconds, clock)
        if units.owns_head(unit):   # per-token "loss" [b, s], cheap and differentiable
            return out[..., 0].float().t().contiguous()
        return out

    with emulated_device.emulating(link_bytes_per_s, memory_bytes_per_s) as clock:
        units.forward_unit = forward_unit   # an instance attribute shadows the method
        try:
            yield clock
        finally:
            del units.forward_unit
