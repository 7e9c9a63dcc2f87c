"""Where the plug-in enters Megatron-LM's training package.

Each replacement is a module attribute Megatron-LM looks up when it calls it (the names
``megatron.training.training`` and ``megatron.training.initialize`` imported), checked by a
fragment of its caller's source in ``releases.WRAPPED`` (per release):

- ``parse_args``: the --snake-* flags join the user's ``extra_args_provider``;
  ``validate_args``: after Megatron-LM's own checks, ``flags.check_args``. Both in
  ``megatron.training.arguments`` (what ``parse_and_validate_args`` calls from 0.18) and
  under the names ``megatron.training.initialize`` imported them (``initialize_megatron``
  parses until 0.17).
- ``training.setup_model_and_optimizer``: the offloaded run (``run.setup``);
- ``training.get_forward_backward_func``: its snake schedule, for ``train_step`` and
  ``evaluate``;
- ``training.save_checkpoint``: the unit-by-unit save (``checkpoints.save``);
- ``training.print_rank_last``: the log line's snake suffix (``log``);
- ``megatron.training.pretrain`` (what ``pretrain_gpt.py`` imports) and
  ``training.pretrain``: the run is closed when it ends.

Each replacement calls Megatron-LM's own function (as it was when the plug-in was
installed: perhaps already wrapped by the CPU patches) unless ``--snake-offload`` is given,
so without it nothing of Megatron-LM's behaviour changes.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

_installed = False
_pretrain_called = False


def pretrain_called() -> bool:
    """Whether Megatron-LM's pretrain() was entered since the plug-in was installed."""
    return _pretrain_called


def _snake(args) -> bool:
    return bool(getattr(args, "snake_offload", False))


def install() -> None:
    """Install the replacements (idempotent)."""
    global _installed
    if _installed:
        return
    import megatron.training as package
    from megatron.core import parallel_state as mpu
    import megatron.training.checkpointing as mlm_checkpointing
    import megatron.training.arguments as mlm_arguments
    import megatron.training.global_vars as global_vars
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    import megatron_snake.megatron_lm.checkpoints as checkpoints
    import megatron_snake.megatron_lm.flags as flags
    import megatron_snake.megatron_lm.log as log
    import megatron_snake.megatron_lm.model as plugin_model
    import megatron_snake.megatron_lm.run as run

    parse_args, validate_args = mlm_arguments.parse_args, mlm_arguments.validate_args

    @functools.wraps(parse_args)
    def parse_args_with_snake_flags(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return flags.add_args(parser)
        args = parse_args(provider, ignore_unknown_args)
        flags.check_parsed(args, os.path.basename(sys.argv[0]))
        return args

    notes: list[str] = []

    @functools.wraps(validate_args)
    def validate_args_and_snake_flags(args, defaults={}):  # noqa: B006 - Megatron-LM's
        result = validate_args(args, defaults)
        notes[:] = flags.check_args(args, os.path.basename(sys.argv[0]), sys.argv[1:])
        return result

    # pretrain_gpt.py parses once before initialize_megatron does (its in-process-restart
    # check, through the arguments module's own name): --help must list the snake flags there
    for module in (mlm_arguments, initialize):
        for name, replacement in (("parse_args", parse_args_with_snake_flags),
                                  ("validate_args", validate_args_and_snake_flags)):
            if hasattr(module, name):
                setattr(module, name, replacement)

    setup_model_and_optimizer = training.setup_model_and_optimizer
    get_forward_backward_func = training.get_forward_backward_func
    save_checkpoint = training.save_checkpoint
    print_rank_last = training.print_rank_last
    pretrain = training.pretrain

    def log_rank0(message: str) -> None:
        training.print_rank_0(message)

    setup_signature = inspect.signature(setup_model_and_optimizer)

    @functools.wraps(setup_model_and_optimizer)
    def setup(*args, **kwargs):
        margs = global_vars.get_args()
        if not _snake(margs):
            return setup_model_and_optimizer(*args, **kwargs)
        for note in notes:
            log_rank0(note)
        # by name: the order changed in 0.19, which also builds the model from the
        # config container's builder where no model provider is given
        call = setup_signature.bind(*args, **kwargs).arguments
        return run.setup(
            margs, plugin_model.provider_of(call.get("model_provider_func"),
                                            call.get("cfg_container")),
            call["model_type"],
            make_scheduler=training.get_optimizer_param_scheduler,
            load=lambda built: checkpoints.load(
                built, update_num_microbatches=training.update_num_microbatches,
                log=log_rank0),
            log=log_rank0)

    @functools.wraps(get_forward_backward_func)
    def forward_backward_func(*args, **kwargs):
        current = run.current()
        if current is None:
            return get_forward_backward_func(*args, **kwargs)
        return current.forward_backward

    @functools.wraps(save_checkpoint)
    def save(iteration, model, optimizer, opt_param_scheduler,
             num_floating_point_operations_so_far, *args, **kwargs):
        if run.current() is None:
            return save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                   num_floating_point_operations_so_far, *args, **kwargs)
        margs = global_vars.get_args()
        return checkpoints.save(
            iteration, model, optimizer, opt_param_scheduler,
            num_floating_point_operations_so_far, log=log_rank0,
            megatron_lm_rng=lambda: mlm_checkpointing.get_rng_state(
                margs.ckpt_format, mpu.get_tensor_model_parallel_group(),
                mpu.get_pipeline_model_parallel_group()))

    @functools.wraps(print_rank_last)
    def print_with_snake_suffix(message):
        return print_rank_last(log.with_snake_suffix(
            message, tensorboard_writer=global_vars.get_tensorboard_writer(),
            wandb_writer=global_vars.get_wandb_writer()))

    @functools.wraps(pretrain)
    def pretrain_closing_the_run(*args, **kwargs):
        global _pretrain_called
        _pretrain_called = True
        with run.closing():
            return pretrain(*args, **kwargs)

    training.setup_model_and_optimizer = setup
    training.get_forward_backward_func = forward_backward_func
    training.save_checkpoint = save
    training.print_rank_last = print_with_snake_suffix
    training.pretrain = pretrain_closing_the_run
    package.pretrain = pretrain_closing_the_run
    _installed = True
