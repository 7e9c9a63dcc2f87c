"""An emulated compute device for benchmarks (tools/bench_overlap.py): each unit's compute
is replaced by a timed wait as long as a device of a given TFLOP/s would take.

Everything else of a step is real: the schedule, the store and its drive, the CPU
optimizer, the unit checkpoints (the unit passes its input on, so the checkpoints keep
their real shapes and bytes). The wait is ``time.sleep``, which releases the CPU to the
store's and the optimizer's threads, as a GPU would. So the ratio of compute to drive,
copy and optimizer work can be set to a real GPU's on a machine without one.

Numbers change under emulation (the units compute nothing and every gradient is zero), so
it is a benchmark mode only: ``emulate_compute`` patches one ``GPTUnits`` object for the
duration of a ``with`` block, and no flag of the training script turns it on.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

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


class _TimedWait(torch.autograd.Function):
    """Identity on the activation; forward waits ``seconds``, backward twice as long (a
    backward computes the gradients of both the input and the weights)."""

    @staticmethod
    def forward(ctx, hidden, seconds: float):
        ctx.seconds = seconds
        _device_wait(seconds)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        _device_wait(2 * ctx.seconds)
        # a view: autograd can hand it to the input as its gradient without the copy a
        # device would make in microseconds and the CPU in milliseconds
        return grad.view_as(grad), None


def _device_wait(seconds: float) -> None:
    """The device's time for the work, as a sleep (the CPU is free meanwhile). The span
    carries the nominal seconds: what the host adds around it (waking, taking the GIL back
    from the store's threads) is the host's delay, not the device's."""
    with timeline.span("device", "device", seconds=seconds):
        time.sleep(seconds)


@contextmanager
def emulate_compute(units: GPTUnits, tflops: float):
    """Within the block, ``units.forward_unit`` waits what a ``tflops`` device would take
    instead of computing. The vertical schedule's forward sweep then waits one forward per
    (unit, micro-batch) and its backward sweep a recompute and a backward (three), as the
    device would."""
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
        out = _TimedWait.apply(hidden, seconds)
        if units.owns_head(unit):   # per-token "loss" [b, s], cheap and differentiable
            return out[..., 0].float().t().contiguous()
        return out

    units.forward_unit = forward_unit   # an instance attribute shadows the method
    try:
        yield
    finally:
        del units.forward_unit
