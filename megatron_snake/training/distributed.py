"""Process group, Megatron model-parallel state, compute device and seeds."""

from __future__ import annotations

import datetime
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_snake.compat import megatron_on_cpu
from megatron_snake.errors import FlagError, UserError


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: the local GPU when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise FlagError("--device cuda was given but torch sees no GPU; use --device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name == "cpu":
        return torch.device("cpu")
    raise FlagError(f"--device must be auto, cpu or cuda, got {name!r}")


def free_port() -> int:
    """A TCP port free on this host now (for a single-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of a one-node world (for processes a
    test or benchmark spawns itself)."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def data_parallel_size(world_size: int, tensor_model_parallel_size: int,
                       pipeline_model_parallel_size: int) -> int:
    """Ranks per model replica: the world must split into whole TP x PP replicas."""
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    if model_parallel < 1 or world_size % model_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {pipeline_model_parallel_size} must divide the "
            f"world size {world_size} (the ranks torchrun starts)")
    return world_size // model_parallel


def initialize(*, device: torch.device, tensor_model_parallel_size: int = 1,
               pipeline_model_parallel_size: int = 1, seed: int = 1234,
               timeout_minutes: float = 10) -> None:
    """Start torch.distributed (torchrun's environment, or a single local process),
    Megatron's parallel state, and seed every RNG the way Megatron-LM does. A collective
    left waiting ``timeout_minutes`` (a rank died) raises instead of hanging."""
    megatron_on_cpu.apply(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    if not parallel_state.model_parallel_is_initialized():
        data_parallel_size(dist.get_world_size(), tensor_model_parallel_size,
                           pipeline_model_parallel_size)
        # every TP / PP / DP subgroup gets the same bound as the world group (Megatron's
        # default is 30 minutes, whatever the flag says)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            distributed_timeout_minutes=timeout_minutes)
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Megatron-LM's ``_set_random_seed``: a different seed per pipeline stage."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def node_index() -> int:
    """This node's index in a multi-node launch (torchrun's GROUP_RANK, or NODE_RANK)."""
    return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))


_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "timed out", "Timed out", "NCCL communicator was aborted")


def is_lost_peer(exc: BaseException) -> bool:
    """Whether a collective failed because another rank went away (or never answered)."""
    dist_error = getattr(dist, "DistError", None)
    text = str(exc)
    from_backend = any(name in text for name in ("gloo", "NCCL", "ProcessGroup"))
    return (dist_error is not None and isinstance(exc, dist_error)) or \
        (from_backend and any(marker in text for marker in _LOST_PEER))


def raise_unless_all_ranks_ok(error: BaseException | None, what: str) -> None:
    """A start-up check every rank makes: gather each rank's error (or None) so that all
    ranks fail together with the full list, instead of one rank failing and the others
    waiting in their next collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    reports = [None] * dist.get_world_size()
    mine = None if error is None else (isinstance(error, UserError),
                                       f"{type(error).__name__}: {error}")
    dist.all_gather_object(reports, mine)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    listed = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in failed)
    message = f"{what} failed on {len(failed)} of {len(reports)} ranks: {listed}"
    if all(user for _, (user, _) in failed):   # the users' input, on every rank that failed
        raise RanksRefusedError(message) from error
    raise RuntimeError(message) from error


class RanksRefusedError(UserError, RuntimeError):
    """A start-up check refused the input of one or more ranks (each named)."""
