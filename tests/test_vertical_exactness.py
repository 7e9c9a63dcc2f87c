"""Invariant 1: the vertical schedule equals Megatron-Core's forward_backward_no_pipelining.

Losses must be bit-identical: every micro-batch goes through the same module calls.
Gradients are bit-identical wherever the summation order is Megatron's. A parameter's
gradient is the sum of its per-micro-batch terms; Megatron adds them in order 0..M-1, the
snake visits odd units in order M-1..0, and a tied embedding gets its output-layer terms in
the last unit's sweep and its embedding terms in unit 0's. Float addition is commutative but
not associative, so those sums are within rounding (1e-6 relative). Bit-identical: every
gradient for M = 1; for M = 2 every parameter of a single unit (a + b == b + a); for M >= 3
the parameters of even units, visited in ascending order. A tied embedding mixes two sums
((o0 + e0) + (o1 + e1) in Megatron, ((o0 + o1) + e0) + e1 here) and is bit-identical only
for M = 1.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import (build_model, gradients, make_microbatches, megatron_forward_backward,
                      tiny_args, zero_gradients)
from megatron_snake import vertical_forward_backward
from megatron_snake.models.gpt_units import GPTUnits

REL_TOL = 1e-6

MODEL_VARIANTS = {
    "learned-tied": (),
    "rope-untied": ("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
    "rope-gqa": ("--position-embedding-type", "rope", "--group-query-attention",
                 "--num-query-groups", "2"),
    "learned-untied-gqa-rmsnorm-swiglu": ("--untie-embeddings-and-output-weights",
                                          "--group-query-attention", "--num-query-groups", "2",
                                          "--normalization", "RMSNorm", "--swiglu"),
}


def _bitwise_expected(model, checkpoint_interval: int, num_microbatches: int) -> set[str]:
    """Names of parameters whose gradient sum runs in Megatron's order."""
    if num_microbatches == 1:
        return {name for name, _ in model.named_parameters()}
    units = GPTUnits(model, checkpoint_interval)
    param_units: dict[int, set[int]] = {}
    for u in range(units.num_units):
        for p in units.unit_parameters(u):
            param_units.setdefault(id(p), set()).add(u)
    single_unit = {name: next(iter(param_units[id(p)])) for name, p in model.named_parameters()
                   if len(param_units[id(p)]) == 1}
    return {name for name, unit in single_unit.items()
            if num_microbatches == 2 or unit % 2 == 0}


def _compare(model, checkpoint_interval, mbs):
    zero_gradients(model)
    ref_losses = megatron_forward_backward(model, mbs)
    ref_grads = gradients(model)
    zero_gradients(model)
    losses = vertical_forward_backward(model, mbs, checkpoint_interval=checkpoint_interval)
    grads = gradients(model)

    assert len(losses) == len(mbs)
    for i, (ours, ref) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(ours, ref.to(ours.dtype)), f"micro-batch {i}: loss {ours} != {ref}"
    bitwise = _bitwise_expected(model, checkpoint_interval, len(mbs))
    assert bitwise, "every case must have bit-identical parameters to check"
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"{name}: reference gradient is all zero"
        if name in bitwise:
            assert torch.equal(grads[name], ref), f"{name}: gradient not bit-identical"
        else:
            rel = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
            assert rel <= REL_TOL, f"{name}: relative gradient error {rel:.2e}"


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("checkpoint_interval,num_microbatches",
                         list(itertools.product([1, 2, 3], [1, 3, 4])))
@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_matches_megatron_no_pipelining(megatron_world, variant, checkpoint_interval,
                                        num_microbatches):
    model = build_model(tiny_args(*MODEL_VARIANTS[variant]), megatron_world)
    _compare(model, checkpoint_interval, make_microbatches(num_microbatches))


@pytest.mark.parametrize("checkpoint_interval,num_microbatches", [(1, 4), (2, 3), (3, 1)])
@pytest.mark.parametrize("variant", ["learned-tied", "rope-untied"])
def test_matches_megatron_with_ddp_main_grad(megatron_world, variant, checkpoint_interval,
                                             num_microbatches):
    from megatron_snake.training.model import wrap_ddp

    model = wrap_ddp(build_model(tiny_args(*MODEL_VARIANTS[variant]), megatron_world))
    _compare(model, checkpoint_interval, make_microbatches(num_microbatches))
    assert all(p.grad is None for p in model.parameters()), "DDP must accumulate in main_grad"


def test_two_microbatches_untied_all_bit_identical(megatron_world):
    """M = 2, untied: every sum has two terms, and a + b == b + a exactly."""
    model = build_model(tiny_args("--untie-embeddings-and-output-weights"), megatron_world)
    assert len(_bitwise_expected(model, 2, 2)) == len(list(model.parameters()))
    _compare(model, 2, make_microbatches(2))


def test_forward_only_losses_and_no_gradients(megatron_world):
    model = build_model(tiny_args("--position-embedding-type", "rope"), megatron_world)
    mbs = make_microbatches(3)
    zero_gradients(model)
    ref = megatron_forward_backward(model, mbs, forward_only=True)
    losses = vertical_forward_backward(model, mbs, checkpoint_interval=2, forward_only=True)
    assert [torch.equal(a, b.to(a.dtype)) for a, b in zip(losses, ref)] == [True] * 3
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("checkpoint_interval,num_microbatches", [(1, 3), (2, 4)])
def test_horizontal_schedule_bit_identical_to_megatron(megatron_world, checkpoint_interval,
                                                       num_microbatches):
    """The ablation schedule sums gradients in Megatron's order (0..M-1): with untied
    embeddings every gradient is bit-identical. (A tied embedding's output-layer and
    embedding terms are added to it one by one here, summed first in Megatron's single
    graph, so it would only agree within rounding.)"""
    from megatron_snake.schedule.vertical import horizontal_forward_backward

    model = build_model(tiny_args(*MODEL_VARIANTS["learned-untied-gqa-rmsnorm-swiglu"]),
                        megatron_world)
    mbs = make_microbatches(num_microbatches)
    zero_gradients(model)
    ref_losses = megatron_forward_backward(model, mbs)
    ref = gradients(model)
    zero_gradients(model)
    losses = horizontal_forward_backward(model, mbs, checkpoint_interval=checkpoint_interval)
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(losses, ref_losses))
    for name, g in gradients(model).items():
        assert torch.equal(g, ref[name]), name
    fwd = horizontal_forward_backward(model, mbs, checkpoint_interval=checkpoint_interval,
                                      forward_only=True)
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(fwd, ref_losses))
