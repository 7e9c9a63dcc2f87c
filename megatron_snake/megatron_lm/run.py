"""The offloaded run inside Megatron-LM's ``pretrain``, from its model build to its end.

``setup(model_provider_func, model_type)`` stands in for Megatron-LM's
``setup_model_and_optimizer`` with --snake-offload: the pre-flight (and ``--snake-auto``,
``--snake-dry-run``), then this project's ``build_run`` with the user's model provider
(``model.streamed_builder``): the store, the model built layer by layer into it, the
offloaded AdamW. Megatron-LM's own learning-rate schedule drives that optimizer, and a
checkpoint is loaded one unit at a time (``checkpoints.load``). It returns what Megatron-LM's
function returns: ``[SnakeModelChunk]``, the optimizer, the schedule.

The run stays open while Megatron-LM trains; ``current()`` is what the other replacements
(the schedule, the checkpoint functions, the log line) act on, and ``closing()`` wraps
``pretrain`` so that pending updates land and the offload files are removed when it
returns, raises or exits.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from megatron_snake.megatron_lm.model import SnakeModelChunk, streamed_builder
from megatron_snake.training import auto_config, preflight
from megatron_snake.training.build import Run, build_run

_run: Run | None = None
_resources: contextlib.ExitStack | None = None


def current() -> Run | None:
    """The offloaded run Megatron-LM's loop is training, or None (no --snake-offload)."""
    return _run


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def setup(args, model_provider_func, model_type, *, make_scheduler: Callable,
          load: Callable, log: Callable[[str], None]):
    """Megatron-LM's ``setup_model_and_optimizer`` for --snake-offload (module docstring).
    ``make_scheduler(optimizer)``: Megatron-LM's ``get_optimizer_param_scheduler``;
    ``load(run)``: the checkpoint load (sets ``args.iteration`` and what it restores)."""
    global _run, _resources
    if _run is not None:
        raise RuntimeError("--snake-offload: setup_model_and_optimizer was called twice in "
                           "one process; the plug-in runs one model per process")
    device, vocab = compute_device(), args.padded_vocab_size
    rank = dist.get_rank()
    with preflight.dry_run_verdict(args, log):
        if args.snake_hardware:   # --snake-auto's choice, or --snake-dry-run's prediction
            auto_config.configure(args, vocab, log=log)
        preflight.run(args, vocab, rank=rank, log=log)
    if args.snake_dry_run:
        raise SystemExit(0)
    resources = contextlib.ExitStack()
    try:
        run = resources.enter_context(build_run(
            args, device, vocab, rank=rank, log=log,
            build_model=streamed_builder(model_provider_func, model_type, device),
            make_scheduler=make_scheduler))
        _run, _resources = run, resources
        load(run)
    except BaseException:
        _run = None
        resources.close()
        raise
    return [SnakeModelChunk(run.model)], run.optimizer, run.scheduler


@contextlib.contextmanager
def closing():
    """Around Megatron-LM's ``pretrain``: the run opened by ``setup`` is closed when it ends,
    however it ends (Megatron-LM's exit conditions call ``sys.exit``)."""
    global _run, _resources
    try:
        yield
    finally:
        resources, _run, _resources = _resources, None, None
        if resources is not None:
            resources.close()
