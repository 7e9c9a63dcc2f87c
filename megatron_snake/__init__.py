"""megatron_snake: SSD-offloaded training of Megatron-Core GPT models with a vertical schedule."""

__version__ = "0.1.0"


def vertical_forward_backward(*args, **kwargs):
    """See megatron_snake.schedule.vertical.vertical_forward_backward (imported lazily: torch is heavy)."""
    from megatron_snake.schedule.vertical import vertical_forward_backward as _impl

    return _impl(*args, **kwargs)


# Before any `import megatron` of this project: a newer megatron-core's triton-only kernels
# and typing.override where this machine lacks them (compat/megatron_import.py; imports
# nothing of megatron or torch)
from megatron_snake.compat import megatron_import as _megatron_import  # noqa: E402

_megatron_import.prepare()
