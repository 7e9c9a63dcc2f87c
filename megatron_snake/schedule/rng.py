"""Capture and restore every RNG stream dropout draws from, so a recompute repeats the
forward's dropout masks exactly: the CPU generator, the current CUDA generator, and
Megatron's tracked (model-parallel, data-parallel, expert) states."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


@dataclass
class RNGState:
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict


def capture() -> RNGState:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return RNGState(cpu=torch.get_rng_state(), cuda=cuda,
                    tracker=dict(get_cuda_rng_tracker().get_states()))


def restore(state: RNGState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda)
    get_cuda_rng_tracker().set_states(dict(state.tracker))


@contextmanager
def replay(state: RNGState):
    """Run the body with the RNG as it was at ``state``; afterwards, as it was before."""
    current = capture()
    restore(state)
    try:
        yield
    finally:
        restore(current)
