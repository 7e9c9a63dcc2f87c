"""Which checkpoint a run starts from, and putting it into the run: one place for this
project's loop and for the Megatron-LM plug-in.

``check_checkpoints`` decides before anything is built (Megatron-LM's choice between
``--load`` and ``--pretrained-checkpoint``, with ``checkpoint_dir``'s refusals), and
``restore`` loads either format into a built ``Run``: the model, the optimizer state and the
learning-rate schedule unless ``--no-load-optim`` (or a fine-tuning start), the RNG state
unless ``--no-load-rng``, as Megatron-LM does.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.training import checkpointing, torch_dist
from megatron_snake.training.checkpoint_dir import (TRACKER, Checkpoint, CheckpointChoiceError,
                                                    check_save_dir, find_checkpoint)


@dataclass
class Restored:
    """Where a loaded checkpoint leaves the run (the saved run's figures; a fine-tuning
    start continues from iteration 0 regardless)."""

    iteration: int
    consumed_samples: int
    consumed_valid_samples: int = 0
    flops_so_far: float = 0


def checkpoint_to_load(args) -> tuple[Checkpoint | None, bool]:
    """Megatron-LM's choice: ``--load`` (at ``--ckpt-step``) when it holds a checkpoint,
    else ``--pretrained-checkpoint`` as a fine-tuning start; and whether it is a
    fine-tuning start (weights only). Refuses what cannot be read safely (checkpoint_dir)."""
    if args.load:
        found = find_checkpoint(args.load, ckpt_step=args.ckpt_step)
        if found is not None:
            return found, args.finetune
    if args.pretrained_checkpoint:
        found = find_checkpoint(args.pretrained_checkpoint)
        if found is None:
            raise CheckpointChoiceError(f"--pretrained-checkpoint {args.pretrained_checkpoint} "
                                        f"holds no checkpoint (no {TRACKER} and no iteration "
                                        "directory)")
        return found, True
    return None, False


def check_checkpoints(args, log) -> tuple[Checkpoint | None, bool]:
    """Before anything is built: the checkpoint to load (``checkpoint_to_load``), refused
    when it is beyond ``--train-iters``, and ``--save`` refused when the run would write
    over an iteration there that it did not save."""
    source, finetune = checkpoint_to_load(args)
    if args.load and source is None:   # Megatron-LM: a first run of a job script
        if args.exit_on_missing_checkpoint:
            raise CheckpointChoiceError(f"--load {args.load}: no {TRACKER} in it "
                                        "(--exit-on-missing-checkpoint)")
        log(f"> --load {args.load} holds no checkpoint yet: training starts from scratch "
            "(--exit-on-missing-checkpoint refuses instead)")
    start = source.iteration if source and not finetune else 0
    if start > args.train_iters:
        raise CheckpointChoiceError(
            f"--load {source.root}: its checkpoint is at iteration {start}, beyond "
            f"--train-iters {args.train_iters}: nothing to train; raise --train-iters to go on")
    if args.save:
        check_save_dir(args.save, start=start, last=args.train_iters)
    return source, finetune


def load_scheduler(scheduler, state: dict, root: str) -> None:
    """Megatron's scheduler asserts when the checkpoint's schedule (counted in samples, so
    it moves with --global-batch-size) is not this run's: say which flags decide."""
    try:
        scheduler.load_state_dict(state)
    except AssertionError as exc:
        raise checkpointing.CheckpointMismatchError(
            f"--load {root}: the checkpoint's learning-rate schedule is not this run's ({exc}; "
            "a changed --global-batch-size, --lr or --lr-decay-iters does this). Pass "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's, or "
            "--override-opt_param-scheduler to take this run's flags") from None


def restore(run, checkpoint: Checkpoint, *, finetune: bool, log) -> Restored:
    """Load ``checkpoint`` into ``run`` (``--no-load-optim`` and ``--no-load-rng`` as in
    Megatron-LM; ``finetune``: the weights only)."""
    args = run.args
    takes_optimizer = not (args.no_load_optim or finetune)
    takes_rng = not (args.no_load_rng or finetune)
    if checkpoint.format == "torch_dist":
        restored = _restore_torch_dist(run, checkpoint, takes_optimizer, takes_rng, log)
    else:
        restored = _restore_torch(run, checkpoint, takes_optimizer, takes_rng)
    log(f"> loaded checkpoint from {checkpoint.root} at iteration {restored.iteration} "
        f"({checkpoint.format})" + (", to fine-tune from iteration 0" if finetune else ""))
    return restored


def _restore_torch_dist(run, checkpoint: Checkpoint, takes_optimizer: bool, takes_rng: bool,
                        log) -> Restored:
    args, root = run.args, checkpoint.root
    if getattr(args, "snake_zenflow", False) and takes_optimizer:
        raise checkpointing.CheckpointMismatchError(
            f"--load {root}: {checkpoint.folder} is in Megatron's torch_dist format, whose "
            "optimizer state --snake-zenflow's split optimizer does not read; pass "
            "--no-load-optim to take the weights")
    loaded = torch_dist.load(checkpoint.folder, root=root, run=run,
                             takes_optimizer=takes_optimizer, takes_rng=takes_rng)
    if takes_optimizer:
        load_scheduler(run.scheduler, loaded["opt_param_scheduler"], root)
    for note in loaded["notes"]:
        log(f"> {note}")
    return Restored(loaded["iteration"], loaded["consumed_samples"],
                    loaded["consumed_valid_samples"], loaded["flops_so_far"])


def _restore_torch(run, checkpoint: Checkpoint, takes_optimizer: bool,
                   takes_rng: bool) -> Restored:
    args, root = run.args, checkpoint.root
    state = checkpointing.load_checkpoint(checkpoint, args=args, optimizer=takes_optimizer)
    gpt = unwrap_model(run.model)
    if run.offloaded and state["units"]:  # streamed back, one layout at a time
        weights = run.offloaded.weights
        weights.check_saved_layouts(state["units"])
        weights.load_resident_state_dict(gpt, state["model"])
        checkpointing.load_units(
            root, state, args=args, apply=lambda key, unit: weights.load_unit_state(
                key, unit, optimizer=takes_optimizer))
    elif run.offloaded:  # saved without --snake-offload (loaded with --no-load-optim)
        run.offloaded.weights.load_model_state_dict(gpt, state["model"])
    else:
        model_state = checkpointing.full_model_state(root, state, args=args)
        try:
            gpt.load_state_dict(model_state)
        except RuntimeError as exc:   # torch's list of missing keys and other shapes
            raise checkpointing.CheckpointMismatchError(
                f"--load {root}: the checkpoint's model is not this run's: "
                f"{' '.join(str(exc).split())[:300]}") from None
    if takes_optimizer:
        run.optimizer.load_state_dict(state["optimizer"])
        load_scheduler(run.scheduler, state["opt_param_scheduler"], root)
    elif run.offloaded:
        # A fresh optimizer copied its master weights before the load: take the loaded
        # weights instead (what Megatron-LM does with --no-load-optim).
        run.offloaded.weights.reload_master_weights()
    else:
        run.optimizer.reload_model_params()
    if takes_rng:
        if state["rng_state"] is None:
            raise checkpointing.CheckpointMismatchError(
                f"--load {root}: the checkpoint was saved with --no-save-rng; pass "
                "--no-load-rng")
        checkpointing.set_rng_state(state["rng_state"])
    return Restored(state["iteration"], state["consumed_samples"])
