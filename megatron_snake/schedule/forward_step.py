"""A Megatron forward step function inside the snake schedule.

Megatron's schedules call the user's ``forward_step_func(data_iterator, model)`` once per
micro-batch: it reads the batch, calls the model once, and returns the model's output and
the loss function to apply to it. The snake runs the model unit by unit, every micro-batch
through one unit before the next, so it cannot let the forward step call the model. At the
start of a step it calls the forward step once per micro-batch, in Megatron's order, with a
stand-in for the model (``_RecordingModel``) that records the call's arguments (the batch
the user's own batch function made) and returns a placeholder; the loss function it returns
is applied where the snake computes the model's per-token loss, with the arithmetic
Megatron's ``forward_step_calc_loss`` and ``backward_step`` apply. Every value that loss
function reports comes back, as from Megatron's schedules.

A forward step the snake cannot run (one that calls the model twice or not at all, does
something with the model's output before returning it, asks for what the unit-by-unit model
does not compute, or returns something other than (output, loss function)) is refused at the
first step with one clear error.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_snake.errors import UserError

_GPT_FORWARD = inspect.signature(GPTModel.forward)
# GPTModel.forward's arguments the unit-by-unit model does not compute with: each must be
# left at its default.
_UNSUPPORTED = ("decoder_input", "inference_context", "packed_seq_params",
                "extra_block_kwargs", "inference_params", "padding_mask")


class ForwardStepError(UserError, TypeError):
    """The forward step function does something the snake schedule cannot run."""


@dataclass
class MicroBatch:
    """One micro-batch as the forward step made it: the model's inputs (tokens, position_ids,
    attention_mask, labels, loss_mask; None where this pipeline stage got none) and the
    loss function it returned."""

    batch: dict
    loss_func: Callable | None


class _RecordingModel:
    """Stands in for the model chunk while a forward step runs: its one call is recorded and
    answered with a placeholder; every attribute is the chunk's (Megatron-LM's forward step
    reads ``vp_stage`` through ``get_attr_wrapped_model``, its loss function the model)."""

    def __init__(self, chunk):
        object.__setattr__(self, "_chunk", chunk)
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "placeholder", torch.empty(0, device="meta"))

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.placeholder

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_chunk"), name)


def _refuse(what: str) -> ForwardStepError:
    return ForwardStepError(f"--snake-offload: the forward step function {what}; the snake "
                            "schedule runs the model unit by unit and needs a forward step "
                            "that calls it once, as pretrain_gpt.py's does (or drop "
                            "--snake-offload)")


def capture_microbatches(forward_step_func, data_iterator, model,
                         num_microbatches: int) -> list[MicroBatch]:
    """Call ``forward_step_func`` for each of the step's micro-batches, in order, with a
    stand-in for ``model``: what each call gave the model, and its loss function."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise _refuse(f"is given {len(model)} model chunks (virtual pipeline stages), "
                          "which the snake does not run")
        model = model[0]
    captured = []
    for _ in range(num_microbatches):
        recorder = _RecordingModel(model)
        returned = forward_step_func(data_iterator, recorder)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise _refuse("returned something other than (output, loss function)")
        output, loss_func = returned
        if len(recorder.calls) != 1:
            raise _refuse(f"called the model {len(recorder.calls)} times in one micro-batch")
        if output is not recorder.placeholder:
            raise _refuse("changed the model's output before returning it (the snake "
                          "applies only the loss function to it)")
        captured.append(MicroBatch(_batch_of(*recorder.calls[0]), loss_func))
    return captured


def _batch_of(args, kwargs) -> dict:
    """The model call's arguments, named as GPTModel.forward names them, as a batch."""
    try:
        bound = _GPT_FORWARD.bind(None, *args, **kwargs)
    except TypeError as exc:
        raise _refuse(f"called the model with arguments GPTModel.forward does not take "
                      f"({exc})") from None
    given = bound.arguments
    for name in _UNSUPPORTED:
        if given.get(name) is not None:
            raise _refuse(f"passes {name}=..., which the unit-by-unit model does not use")
    if given.get("runtime_gather_output"):
        raise _refuse("passes runtime_gather_output=True (the snake computes the loss, not "
                      "gathered logits)")
    if parallel_state.is_pipeline_last_stage() and given.get("labels") is None:
        raise _refuse("calls the model without labels (the snake computes the per-token "
                      "loss in the model's last unit)")
    return {"tokens": given.get("input_ids"), "position_ids": given.get("position_ids"),
            "attention_mask": given.get("attention_mask"), "labels": given.get("labels"),
            "loss_mask": given.get("loss_mask")}


def apply_loss(loss_func, output: torch.Tensor, *, num_microbatches: int, config,
               for_backward: bool):
    """``loss_func(output)`` with Megatron's arithmetic (``forward_step_calc_loss``, then
    ``backward_step``'s loss scale when ``for_backward``). Returns (the tensor to
    backpropagate, the token count (0 without one), what the loss function reports)."""
    outputs = loss_func(output)
    if not isinstance(outputs, tuple) or len(outputs) not in (2, 3):
        raise _refuse("returned a loss function whose result is not (loss, reported) or "
                      "(loss, tokens, reported)")
    num_tokens = torch.tensor(0, dtype=torch.int)
    if len(outputs) == 3:
        loss, num_tokens, reported = outputs
        if not getattr(config, "calculate_per_token_loss", False):
            loss = loss / torch.clamp(num_tokens, min=1)
            loss = loss / num_microbatches
    else:
        loss, reported = outputs
        loss = loss * parallel_state.get_context_parallel_world_size()
        loss = loss / num_microbatches
    if for_backward and getattr(config, "grad_scale_func", None) is not None:
        loss = config.grad_scale_func(loss)
    return loss, num_tokens, reported
