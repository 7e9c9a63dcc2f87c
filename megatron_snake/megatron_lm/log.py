"""The snake's figures on Megatron-LM's own log line, and under ``snake/`` in its trackers.

Megatron-LM's ``training_log`` builds its line (iteration, consumed samples, time per
iteration, TFLOP/s per GPU with ``--log-throughput``, learning rate, every reported loss,
loss scale, grad norm, ...) and hands it to ``print_rank_last``. The plug-in leaves that
line as it is and appends the snake's fields after ``snake:``, those of this project's own
log line (``training.offloaded_state.StoreMeter``): by default the compact set (the drive's
read and write MB/s, the share of the interval the training thread waited on the store,
the host pool's peak of its limit); with ``--snake-log-details`` every figure (bytes per
tier and per kind, the activation peaks, the prefetch and other waits apart). The same
figures go to Megatron-LM's TensorBoard and W&B writers as ``snake/...`` scalars.
"""

from __future__ import annotations

import re

import megatron_snake.megatron_lm.run as plugin_run
from megatron_snake.training.offloaded_state import StoreMeter

_TRAINING_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \| consumed samples:")

_meter: StoreMeter | None = None


def with_snake_suffix(line: str, *, tensorboard_writer, wandb_writer) -> str:
    """``line`` with the snake's suffix when it is Megatron-LM's training log line of an
    offloaded run (anything else unchanged); the scalars go to the writers given."""
    global _meter
    run = plugin_run.current()
    found = _TRAINING_LINE.search(line)
    if run is None or run.tensor_store is None or found is None:
        return line
    if _meter is None or _meter.store is not run.tensor_store:
        _meter = StoreMeter(run.tensor_store,
                            details=getattr(run.args, "snake_log_details", False))
    text, scalars = _meter.interval(getattr(run.forward_backward, "activation_peak", {}))
    iteration = int(found.group(1))
    if tensorboard_writer is not None:
        for name, value in scalars.items():
            tensorboard_writer.add_scalar(name, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)
    return f"{line} snake: {text} |" if text else line
