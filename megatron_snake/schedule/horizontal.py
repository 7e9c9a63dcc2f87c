"""The horizontal schedule over the same store: Megatron's micro-batch-major order.

For ablations (``--snake-schedule horizontal``): each micro-batch runs forward through
every unit and then backward through every unit before the next micro-batch starts, as in
``forward_backward_no_pipelining`` with full recompute, but each unit's weights are
acquired from the store every time a micro-batch needs them: weight traffic grows with the
number of micro-batches, which is what the vertical schedule removes. A unit's gradient is
final after the last micro-batch's backward of that unit. Gradients are summed in order
0..M-1, as in Megatron.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.schedule import rng
from megatron_snake.schedule.loss import masked_loss_sum, reported_loss, scale_for_backward
from megatron_snake.schedule.unit_store import InMemoryStore, UnitStore
from megatron_snake.schedule.pipeline import check_microbatches


def horizontal_forward_backward(model, microbatches, *, checkpoint_interval: int = 1,
                                forward_only: bool = False, store: UnitStore | None = None):
    """Same contract as ``vertical_forward_backward``, micro-batch-major order."""
    check_microbatches(microbatches)
    units = GPTUnits(model, checkpoint_interval)
    store = InMemoryStore() if store is None else store
    config, num_mb, last = units.config, len(microbatches), units.num_units - 1
    no_sync = getattr(config, "no_sync_func", None) or nullcontext
    losses = []
    total_tokens = torch.zeros([], dtype=torch.int, device=microbatches[0]["loss_mask"].device)
    with no_sync():
        for mb, batch in enumerate(microbatches):
            ctx = units.context(batch)
            rng_states, hidden = {}, None
            for unit in range(units.num_units):  # forward, keeping unit-input checkpoints
                if unit == last and not forward_only:
                    break  # runs with autograd at the start of this micro-batch's backward
                store.acquire_unit(unit, next_unit=unit + 1 if unit < last else None,
                                   for_backward=False)
                rng_states[unit] = rng.capture()
                with torch.no_grad(), units.autocast():
                    out = units.forward_unit(unit, hidden, ctx)
                store.release_unit(unit, gradients_final=False)
                if unit < last:
                    if not forward_only:
                        store.save_checkpoint(unit + 1, mb, out)
                    hidden = out
            if forward_only:
                loss, num_tokens = masked_loss_sum(out, batch["loss_mask"])
                losses.append(reported_loss(loss, num_tokens))
                continue
            grad = None
            for unit in range(last, -1, -1):  # backward, recomputing each unit
                final = mb == num_mb - 1
                store.acquire_unit(unit, next_unit=unit - 1 if unit > 0 else None,
                                   for_backward=True)
                inp = None
                if unit > 0:
                    inp = store.load_checkpoint(unit, mb).detach().requires_grad_(True)
                replay = rng.replay(rng_states[unit]) if unit < last else nullcontext()
                with replay, torch.enable_grad(), units.autocast():
                    out = units.forward_unit(unit, inp, ctx)
                if unit == last:
                    loss, num_tokens = masked_loss_sum(out, batch["loss_mask"])
                    losses.append(reported_loss(loss, num_tokens))
                    total_tokens += num_tokens
                    torch.autograd.backward(scale_for_backward(loss, num_tokens, num_mb, config))
                else:
                    torch.autograd.backward(out, grad_tensors=grad)
                del out
                if unit > 0:
                    grad = inp.grad
                    store.drop_checkpoint(unit, mb)
                store.release_unit(unit, gradients_final=final)
    if not forward_only and getattr(config, "finalize_model_grads_func", None) is not None:
        per_token = getattr(config, "calculate_per_token_loss", False)
        config.finalize_model_grads_func([model], total_tokens if per_token else None)
    return losses
