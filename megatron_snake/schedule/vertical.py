"""The vertical (snake) schedule: every micro-batch through one unit before the next unit.

Forward sweep, units 0..U-2, without autograd: each unit's weights are acquired once and
every micro-batch passes through it; only the unit outputs are kept, as the next unit's
input checkpoints. Backward sweep, units U-1..0: the unit is recomputed from its checkpoint
with autograd (the last unit runs here for the first time, fused with the final norm,
output layer and loss) and backpropagated with the activation gradient the unit above left
behind. The sweeps themselves are in megatron_snake.schedule.sweeps; across pipeline stages
they run per snake group (megatron_snake.schedule.pipeline), of which one stage with one
group of all M micro-batches is this schedule.

Numbers: each micro-batch sees exactly the module calls Megatron's schedule makes, so losses
are bit-identical; a parameter's gradient is the same per-micro-batch terms summed in snake
order instead of 0..M-1 (bit-identical for M <= 2, within float rounding otherwise).

These two take a list of batch dicts and pretrain_gpt's forward step, and return the
per-micro-batch losses: the form tests and benchmarks drive the schedule in. Training runs
call ``pipeline.snake_forward_backward`` itself, with Megatron's signature.
"""

from __future__ import annotations

from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.schedule.loss import microbatch_call, report_losses
from megatron_snake.schedule.pipeline import snake_forward_backward
from megatron_snake.schedule.unit_store import UnitStore

__all__ = ["horizontal_forward_backward", "vertical_forward_backward"]


def vertical_forward_backward(model, microbatches, *, checkpoint_interval: int = 1,
                              forward_only: bool = False, store: UnitStore | None = None,
                              group_size: int | None = None, units: GPTUnits | None = None):
    """Run one step's micro-batches through ``model`` in vertical (snake) order.

    Returns the per-micro-batch losses (masked mean of token losses, detached), in
    micro-batch order (an empty list on a pipeline stage that does not end the model).
    Unless ``forward_only``, accumulates into ``param.grad`` (or ``param.main_grad`` under
    Megatron DDP) what Megatron's schedule accumulates with pretrain_gpt's loss, and calls
    ``config.finalize_model_grads_func`` when it is set, as Megatron's schedule does.
    ``group_size`` (default: all micro-batches) cuts the step into snake groups. ``units``:
    the model's unit partition, when the caller made it once for the run (else made here).
    """
    return report_losses(snake_forward_backward(
        **microbatch_call(model, microbatches), forward_only=forward_only,
        group_size=group_size, checkpoint_interval=checkpoint_interval, store=store,
        units=units))


def horizontal_forward_backward(model, microbatches, *, checkpoint_interval: int = 1,
                                forward_only: bool = False, store: UnitStore | None = None,
                                units: GPTUnits | None = None):
    """Megatron's micro-batch-major order over the same store (``--snake-schedule
    horizontal``, an ablation): snake groups of one micro-batch, so each micro-batch runs
    forward through every unit and then backward before the next starts, and every unit's
    weights are acquired once per micro-batch: weight traffic grows with M, which is what
    the vertical schedule removes. Gradients are summed in Megatron's order 0..M-1."""
    return vertical_forward_backward(model, microbatches, checkpoint_interval=checkpoint_interval,
                                     forward_only=forward_only, store=store, group_size=1,
                                     units=units)
