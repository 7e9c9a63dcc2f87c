"""The two sweeps of the vertical schedule over one group of micro-batches on one stage.

Forward sweep, without autograd: each of the stage's units acquires its weights once and
every micro-batch of the group passes through it; only unit inputs are kept, as
checkpoints. The unit that ends the model (final norm, output layer, loss) is left to the
backward sweep, where it runs once, fused with the loss. Backward sweep, last unit first:
each unit is recomputed from its checkpoint with autograd and backpropagated with the
gradient the unit above left behind.

Snake order: unit u visits the group ascending when u is even, descending when odd, so the
micro-batch that left a unit last is the first to enter the next one, in both sweeps.

On a pipeline stage that does not start the model, unit 0's input checkpoint is what the
previous stage sent, and the backward sweep returns its gradient to send back; on a stage
that does not end the model, the forward sweep returns the last unit's outputs to send on,
and the backward sweep starts from the gradients the next stage sent.

Dropout: the RNG state is captured before each (unit, micro-batch) forward and replayed for
its recompute, so the recompute draws the forward's masks.

The loss: the unit that ends the model computes the per-token loss, and the loss function
the forward step returned for that micro-batch is applied to it (``forward_step``), with
Megatron's scaling; what it reports is returned per micro-batch.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

import megatron_snake.timeline as timeline
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.schedule import rng
from megatron_snake.schedule.forward_step import apply_loss
from megatron_snake.schedule.order import snake_order
from megatron_snake.schedule.unit_store import UnitStore


def forward_sweep(units: GPTUnits, contexts, store: UnitStore, group: list[int], *,
                  forward_only: bool, rng_states: dict, inputs: dict | None = None) -> dict:
    """Run ``group`` (micro-batch ids) through the stage's units without autograd.

    ``inputs``: micro-batch -> the tensor received from the previous stage (None on the
    first stage). Returns micro-batch -> the stage's output: the last unit's hidden state on
    a stage that does not end the model, what the loss function reports on one that does
    (forward-only; in training the loss unit waits for the backward sweep and nothing is
    returned).
    """
    last = units.num_units - 1
    ends_model = units.owns_head(last)
    stop = last if (ends_model and not forward_only) else last + 1
    store.begin_group(group)
    if inputs and stop == 0:  # the stage is one loss unit: nothing runs before the backward
        for mb in group:      # sweep, which recomputes from what arrived
            with store.compute_event("F", 0, mb):
                store.save_input(0, mb, inputs[mb])
    outputs = {}
    with timeline.span("forward sweep", "sweep"):
        for unit in range(stop):
            _forward_unit(units, contexts, store, group, unit, forward_only=forward_only,
                          rng_states=rng_states, inputs=inputs, outputs=outputs)
    return outputs


def _forward_unit(units: GPTUnits, contexts, store: UnitStore, group: list[int], unit: int, *,
                  forward_only: bool, rng_states: dict, inputs: dict | None, outputs: dict):
    """Every micro-batch of ``group`` through ``unit``: one step of the forward sweep."""
    last = units.num_units - 1
    with timeline.span(f"acquire u{unit}", "weights"):
        store.acquire_unit(unit, next_unit=unit + 1 if unit < last else None,
                           for_backward=False)
    for i in snake_order(unit, len(group)):
        mb = group[i]
        with store.compute_event("F", unit, mb):
            if unit == 0 and inputs:  # what the previous stage sent: unit 0's checkpoint
                store.save_input(0, mb, inputs[mb])
            hidden = None if units.owns_embedding(unit) else store.load_input(unit, mb)
            if not forward_only:  # the recompute will replay this unit's dropout
                rng_states[(unit, mb)] = rng.capture()
            with timeline.span(f"F u{unit} mb{mb}", "compute"), torch.no_grad(), \
                    units.autocast():
                out = units.forward_unit(unit, hidden, contexts[mb])
            if hidden is not None and forward_only:
                store.drop_input(unit, mb)  # no backward will read it
            if unit < last:
                store.save_input(unit + 1, mb, out)
            elif units.owns_head(last):
                outputs[mb] = apply_loss(contexts[mb].loss_func, out,
                                         num_microbatches=len(contexts), config=units.config,
                                         for_backward=False)[2]
            else:
                outputs[mb] = out
    with timeline.span(f"release u{unit}", "weights"):
        store.release_unit(unit, gradients_final=False)


def backward_sweep(units: GPTUnits, contexts, store: UnitStore, group: list[int], *,
                   rng_states: dict, num_microbatches: int, gradients_final: bool,
                   output_grads: dict | None = None):
    """Recompute and backpropagate ``group`` through the stage's units, last unit first.

    ``output_grads``: micro-batch -> gradient of the stage's output, from the next stage
    (None on the stage that ends the model, whose last unit computes the loss here).
    ``gradients_final``: this is the step's last visit of the units (the store may then
    hand their gradients to the optimizer). Returns (reports, tokens, input_grads): what
    the loss function reports per micro-batch and the token count where the stage ends the
    model, and micro-batch -> gradient of the stage's input where it does not start it.
    """
    last = units.num_units - 1
    reports = {}
    total_tokens = 0
    grad_of_output = dict(output_grads or {})  # micro-batch -> d loss / d (unit output)
    store.begin_group(group)
    with timeline.span("backward sweep", "sweep"):
        for unit in range(last, -1, -1):
            total_tokens += _backward_unit(units, contexts, store, group, unit,
                                           rng_states=rng_states, reports=reports,
                                           grad_of_output=grad_of_output,
                                           num_microbatches=num_microbatches,
                                           gradients_final=gradients_final)
    return reports, total_tokens, grad_of_output


def _backward_unit(units: GPTUnits, contexts, store: UnitStore, group: list[int], unit: int, *,
                   rng_states: dict, reports: dict, grad_of_output: dict, num_microbatches: int,
                   gradients_final: bool):
    """Recompute and backpropagate every micro-batch of ``group`` through ``unit``: one step
    of the backward sweep. Returns the loss tokens counted (0 unless it ends the model)."""
    tokens = 0
    with timeline.span(f"acquire u{unit}", "weights"):
        store.acquire_unit(unit, next_unit=unit - 1 if unit > 0 else None, for_backward=True)
    for i in snake_order(unit, len(group)):
        mb = group[i]
        with store.compute_event("B", unit, mb):
            ctx = contexts[mb]
            hidden = None
            if not units.owns_embedding(unit):
                hidden = store.load_input(unit, mb).detach().requires_grad_(True)
            # The loss unit runs here for the first time: nothing to replay.
            state = rng_states.pop((unit, mb), None)
            replay = rng.replay(state) if state is not None else nullcontext()
            with timeline.span(f"B u{unit} mb{mb}", "compute"):
                with replay, torch.enable_grad(), units.autocast(), store.saved_tensors():
                    out = units.forward_unit(unit, hidden, ctx)
                if units.owns_head(unit):
                    loss, num_tokens, reports[mb] = apply_loss(
                        ctx.loss_func, out, num_microbatches=num_microbatches,
                        config=units.config, for_backward=True)
                    tokens = tokens + num_tokens
                    torch.autograd.backward(loss)
                else:
                    torch.autograd.backward(out, grad_tensors=grad_of_output.pop(mb))
                del out
            if hidden is not None:
                grad_of_output[mb] = hidden.grad
                store.drop_input(unit, mb)
    with timeline.span(f"release u{unit}", "weights"):
        store.release_unit(unit, gradients_final=gradients_final)
    return tokens
