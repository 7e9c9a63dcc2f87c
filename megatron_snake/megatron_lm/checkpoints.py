"""Megatron-LM's ``--save`` / ``--load`` for the offloaded run, one unit at a time.

Megatron-LM's own ``save_checkpoint`` and ``load_checkpoint`` gather each model chunk's and
the optimizer's ``sharded_state_dict`` and hand them to ``dist_checkpointing`` whole. With
--snake-offload the plug-in writes and reads the same ``--ckpt-format torch_dist`` layout
(``iter_N/``, ``latest_checkpointed_iteration.txt``, Megatron's keys, ``common.pt`` with the
flags, the iteration, the schedule and the FLOPs so far) through this project's streaming
save and load (``training.torch_dist``), which hold one unit's state at a time. Megatron-LM's
own ``rng_state`` object is written beside this project's, so that a plain Megatron-LM run
loads the checkpoint with its RNG; the plug-in reads its own (``snake_rng_state``: plain
values only) and, from a checkpoint a plain run wrote, needs ``--no-load-rng``.

Which checkpoint is loaded, and which iteration directories a save may write, follow this
project's rules (``training.restore.check_checkpoints``): a tracker that cannot be read is
refused, never trained over.
"""

from __future__ import annotations

import megatron_snake.megatron_lm.run as plugin_run
from megatron_snake.training import torch_dist
from megatron_snake.training.restore import check_checkpoints, restore


def load(run, *, update_num_microbatches, log) -> None:
    """Megatron-LM's ``load_checkpoint`` for the offloaded ``run``: ``args.iteration``,
    ``args.num_floating_point_operations_so_far`` and the consumed-sample counts as
    Megatron-LM's load leaves them (0 without a checkpoint; a fine-tuning start is at
    iteration 0 with the sample counts untouched, but the checkpoint's FLOPs so far)."""
    args = run.args
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    source, finetune = check_checkpoints(args, log)
    if source is None:
        return
    restored = restore(run, source, finetune=finetune, log=log)
    args.num_floating_point_operations_so_far = restored.flops_so_far
    if finetune:
        return
    args.iteration = restored.iteration
    args.consumed_train_samples = restored.consumed_samples
    args.consumed_valid_samples = restored.consumed_valid_samples
    update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)


def save(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
         *, megatron_lm_rng, log) -> None:
    """Megatron-LM's ``save_checkpoint(iteration, model, optimizer, ...)`` for the offloaded
    run. ``megatron_lm_rng()``: Megatron-LM's ``rng_state`` object for this rank."""
    run = plugin_run.current()
    args = run.args
    torch_dist.save(args.save, iteration=iteration, consumed_samples=args.consumed_train_samples,
                    run=run, flops_so_far=num_floating_point_operations_so_far,
                    megatron_lm_rng=None if args.no_save_rng else megatron_lm_rng())
    log(f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save} "
        "[ t 1/1, p 1/1 ] (torch_dist, one unit at a time)")
