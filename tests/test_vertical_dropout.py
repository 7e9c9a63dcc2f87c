"""Dropout on: the backward recompute must draw the forward's dropout masks exactly.

Megatron's schedule draws dropout masks micro-batch-major; the vertical schedule draws them
unit-major, so the two cannot agree mask for mask. What must hold is that recomputation
changes nothing: the reference here runs the same vertical order with plain Megatron module
calls, keeps every activation (one autograd graph, no recompute) and backpropagates once.
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_model, make_microbatches, tiny_args
from megatron_snake import vertical_forward_backward
from megatron_snake.schedule.loss import masked_loss_sum
from megatron_snake.training.distributed import set_seed

DROPOUT = ("--hidden-dropout", "0.2", "--attention-dropout", "0.3")


def _kept_activation_reference(gpt, mbs, checkpoint_interval):
    layers = list(gpt.decoder.layers)
    units = [layers[i:i + checkpoint_interval] for i in range(0, len(layers), checkpoint_interval)]
    num_mb = len(mbs)
    hidden, total, losses = {}, 0.0, [None] * num_mb
    for u, unit_layers in enumerate(units):
        order = range(num_mb) if u % 2 == 0 else range(num_mb - 1, -1, -1)
        for m in order:
            mb = mbs[m]
            rope = None
            if gpt.position_embedding_type == "rope":
                rope = gpt.rotary_pos_emb(mb["tokens"].shape[1])
            h = gpt.embedding(input_ids=mb["tokens"], position_ids=mb["position_ids"]) \
                if u == 0 else hidden[m]
            for layer in unit_layers:
                h, _ = layer(hidden_states=h, attention_mask=mb["attention_mask"],
                             rotary_pos_emb=rope)
            hidden[m] = h
            if u == len(units) - 1:
                h = gpt.decoder.final_layernorm(h)
                weight = gpt.shared_embedding_or_output_weight() \
                    if gpt.share_embeddings_and_output_weights else None
                logits, _ = gpt.output_layer(h, weight=weight)
                loss, num_tokens = masked_loss_sum(
                    gpt.compute_language_model_loss(mb["labels"], logits), mb["loss_mask"])
                losses[m] = (loss / num_tokens).detach()
                total = total + loss / num_tokens / num_mb
    total.backward()
    return losses


@pytest.mark.parametrize("variant,checkpoint_interval,num_microbatches", [
    ((), 2, 3),
    (("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"), 1, 4),
])
def test_recompute_reproduces_dropout(megatron_world, variant, checkpoint_interval,
                                      num_microbatches):
    torch.use_deterministic_algorithms(True)
    model = build_model(tiny_args(*DROPOUT, *variant), megatron_world)
    model.train()
    mbs = make_microbatches(num_microbatches)

    set_seed(99)
    ref_losses = _kept_activation_reference(model, mbs, checkpoint_interval)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None

    set_seed(99)
    losses = vertical_forward_backward(model, mbs, checkpoint_interval=checkpoint_interval)
    torch.use_deterministic_algorithms(False)

    for ours, ref in zip(losses, ref_losses):
        assert torch.equal(ours, ref), "forward dropout draws differ from the reference"
    for name, p in model.named_parameters():
        ref = ref_grads[name]
        rel = ((p.grad - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-6, f"{name}: recompute did not reproduce dropout (rel err {rel:.2e})"

    # The masks matter: the same step without dropout gives other losses.
    set_seed(99)
    model.eval()
    no_dropout = vertical_forward_backward(model, mbs, checkpoint_interval=checkpoint_interval,
                                           forward_only=True)
    assert not any(torch.equal(a, b) for a, b in zip(no_dropout, losses))
