"""Shared pieces of the GPU suite (tests/gpu/): the device, its one Megatron world, and the
skip every module applies where there is no GPU.

The CPU suite (tests/*.py) is what CI runs; these modules run where CUDA is
(``tools/gpu_check.sh``). ``SNAKE_GPU_TESTS_ON_CPU=1`` runs them on the CPU instead, to
check a test's own logic on a machine without a GPU (stream-order probes and allocator
checks, which mean nothing there, still skip).
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CPU = os.environ.get("SNAKE_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if HAS_CUDA and not ON_CPU else torch.device("cpu")

# Every module: pytestmark = requires_device
requires_device = pytest.mark.skipif(not (HAS_CUDA or ON_CPU),
                                     reason="GPU suite: needs CUDA (tools/gpu_check.sh)")
# Tests whose assertion only means something on a real GPU (streams, allocator, syncs).
requires_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a real CUDA device")


@pytest.fixture(scope="session")
def gpu_world():
    """torch.distributed (NCCL on the GPU, gloo on the CPU; world size 1) and Megatron's
    parallel state, on DEVICE. TF32 is off so fp32 matches bit for bit where it should."""
    from megatron_snake.training import distributed

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)
    distributed.initialize(device=DEVICE, seed=1234)
    yield DEVICE
    distributed.shutdown()


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def on_device(microbatches, device=None):
    """Micro-batch dicts with every tensor on ``device`` (default DEVICE)."""
    device = device or DEVICE
    return [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in mb.items()}
            for mb in microbatches]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))
