"""The vertical (snake) schedule: every micro-batch through one unit before the next unit.

Forward sweep, units 0..U-2, without autograd: each unit's weights are acquired once and
every micro-batch passes through it; only the unit outputs are kept, as the next unit's
input checkpoints. Backward sweep, units U-1..0: the unit is recomputed from its checkpoint
with autograd (the last unit runs here for the first time, fused with the final norm,
output layer and loss) and backpropagated with the activation gradient the unit above left
behind. Snake order: unit u visits micro-batches ascending when u is even, descending when
odd, so the micro-batch that left a unit last is the first to enter the next one, in both
sweeps.

Numbers: each micro-batch sees exactly the module calls Megatron's schedule makes, so losses
are bit-identical; a parameter's gradient is the same per-micro-batch terms summed in snake
order instead of 0..M-1 (bit-identical for M <= 2, within float rounding otherwise).
Dropout: the RNG state is captured before each (unit, micro-batch) forward and replayed for
its recompute, so the recompute draws the forward's masks.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.schedule import rng
from megatron_snake.schedule.loss import masked_loss_sum, reported_loss, scale_for_backward
from megatron_snake.schedule.order import snake_order
from megatron_snake.schedule.unit_store import (InMemoryStore, UnitStore, compute_event,
                                                saved_tensors)

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def check_microbatches(microbatches) -> None:
    if not isinstance(microbatches, (list, tuple)) or not microbatches:
        raise ValueError("vertical_forward_backward: microbatches must be a non-empty list of dicts")
    for i, mb in enumerate(microbatches):
        missing = [k for k in BATCH_KEYS if k not in mb]
        if missing:
            raise KeyError(f"micro-batch {i} lacks the GPT batch keys {missing} "
                           f"(expected {list(BATCH_KEYS)})")


def vertical_forward_backward(model, microbatches, *, checkpoint_interval: int = 1,
                              forward_only: bool = False, store: UnitStore | None = None):
    """Run one step's micro-batches through ``model`` in vertical (snake) order.

    Returns the per-micro-batch losses (masked mean of token losses, detached), in
    micro-batch order. Unless ``forward_only``, accumulates into ``param.grad`` (or
    ``param.main_grad`` under Megatron DDP) what ``forward_backward_no_pipelining``
    accumulates with pretrain_gpt's loss, and calls ``config.finalize_model_grads_func``
    when it is set, as Megatron's schedule does.
    """
    check_microbatches(microbatches)
    units = GPTUnits(model, checkpoint_interval)
    store = InMemoryStore() if store is None else store
    config = units.config
    no_sync = getattr(config, "no_sync_func", None) or nullcontext
    contexts = [units.context(mb) for mb in microbatches]

    with no_sync():
        if forward_only:
            with torch.no_grad():
                losses, _ = _forward_sweep(units, contexts, store, last_unit_too=True)
            return losses
        _, rng_states = _forward_sweep(units, contexts, store, last_unit_too=False)
        losses, total_tokens = _backward_sweep(units, contexts, store, rng_states)

    if getattr(config, "finalize_model_grads_func", None) is not None:
        per_token = getattr(config, "calculate_per_token_loss", False)
        config.finalize_model_grads_func([model], total_tokens if per_token else None)
    return losses


def _forward_sweep(units: GPTUnits, contexts, store: UnitStore, *, last_unit_too: bool):
    """Units 0..U-2 (0..U-1 with ``last_unit_too``) without autograd. Returns the losses
    (only when the last unit ran) and the RNG state before every (unit, micro-batch)."""
    num_mb, last = len(contexts), units.num_units - 1
    sweep = range(units.num_units if last_unit_too else last)
    losses: list[torch.Tensor | None] = [None] * num_mb
    rng_states = {}
    for unit in sweep:
        store.acquire_unit(unit, next_unit=unit + 1 if unit < last else None, for_backward=False)
        for mb in snake_order(unit, num_mb):
            with compute_event(store, "F", unit, mb):
                hidden = None if unit == 0 else store.load_checkpoint(unit, mb)
                if not last_unit_too:  # a recompute will replay this unit's dropout
                    rng_states[(unit, mb)] = rng.capture()
                with torch.no_grad(), units.autocast():
                    out = units.forward_unit(unit, hidden, contexts[mb])
                if unit > 0 and last_unit_too:
                    store.drop_checkpoint(unit, mb)  # no backward will read it
                if unit == last:
                    loss, num_tokens = masked_loss_sum(out, contexts[mb].batch["loss_mask"])
                    losses[mb] = reported_loss(loss, num_tokens)
                else:
                    store.save_checkpoint(unit + 1, mb, out)
        store.release_unit(unit, gradients_final=False)
    return losses, rng_states


def _backward_sweep(units: GPTUnits, contexts, store: UnitStore, rng_states):
    """Units U-1..0 with autograd: recompute from the checkpoint, then backpropagate."""
    num_mb, last = len(contexts), units.num_units - 1
    losses: list[torch.Tensor | None] = [None] * num_mb
    total_tokens = torch.zeros([], dtype=torch.int)
    grad_of_output: dict[int, torch.Tensor] = {}  # micro-batch -> d loss / d (unit output)
    for unit in range(last, -1, -1):
        store.acquire_unit(unit, next_unit=unit - 1 if unit > 0 else None, for_backward=True)
        for mb in snake_order(unit, num_mb):
            with compute_event(store, "B", unit, mb):
                ctx = contexts[mb]
                hidden = None
                if unit > 0:
                    hidden = store.load_checkpoint(unit, mb).detach().requires_grad_(True)
                # The last unit runs here for the first time: nothing to replay.
                replay = rng.replay(rng_states.pop((unit, mb))) if unit < last \
                    else nullcontext()
                with replay, torch.enable_grad(), units.autocast(), saved_tensors(store):
                    out = units.forward_unit(unit, hidden, ctx)
                if unit == last:
                    loss, num_tokens = masked_loss_sum(out, ctx.batch["loss_mask"])
                    losses[mb] = reported_loss(loss, num_tokens)
                    total_tokens += num_tokens
                    torch.autograd.backward(scale_for_backward(loss, num_tokens, num_mb,
                                                               units.config))
                else:
                    torch.autograd.backward(out, grad_tensors=grad_of_output.pop(mb))
                del out
                if unit > 0:
                    grad_of_output[mb] = hidden.grad
                    store.drop_checkpoint(unit, mb)
        store.release_unit(unit, gradients_final=True)
    return losses, total_tokens
