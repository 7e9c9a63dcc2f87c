"""megatron_snake: SSD-offloaded training of Megatron-Core GPT models with a vertical schedule."""

__version__ = "0.1.0"


def vertical_forward_backward(*args, **kwargs):
    """See megatron_snake.schedule.vertical.vertical_forward_backward (imported lazily: torch is heavy)."""
    from megatron_snake.schedule.vertical import vertical_forward_backward as _impl

    return _impl(*args, **kwargs)
