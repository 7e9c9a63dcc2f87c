"""Each data-parallel rank's share of every flat layout: Megatron's distributed optimizer,
per unit.

Rank r of D owns elements [r*S, (r+1)*S) of a layout of N elements (S = ceil(N / D), the
last shard may be short or empty): its fp32 master weights, moments and working-weight
records cover only that range, on its own drive. A unit's gradient is averaged the way
Megatron's DDP does it (each rank scales by 1/D, then a sum reduce-scatter) as soon as it is
final; the updated working weights are all-gathered when the unit is next read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def all_reduce_on_backend(value: torch.Tensor, *, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small CPU-side figure (a norm, an overflow flag) over ``group``: NCCL
    takes CUDA tensors only, so it travels through the current GPU there."""
    if dist.get_backend(group) == "nccl":
        moved = value.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(moved, op=op, group=group)
        return moved.to(value.device)
    dist.all_reduce(value, op=op, group=group)
    return value


@dataclass
class PendingShard:
    """A launched reduce-scatter: ``work`` is torch.distributed's handle (None when there
    was nothing to reduce); ``keep`` holds the send buffer alive until it completes."""

    work: object
    shard: torch.Tensor
    keep: object = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = self.keep = None
        return self.shard


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    size: int = 1
    group: object = None

    @classmethod
    def from_megatron(cls) -> "DataParallel":
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return cls()
        return cls(parallel_state.get_data_parallel_rank(),
                   parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_group())

    def shard(self, numel: int) -> tuple[int, int, int]:
        """(start, end, S): this rank's element range and the padded shard length."""
        per = -(-numel // self.size) if numel else 0
        start = min(self.rank * per, numel)
        return start, min(start + per, numel), per

    def reduce_scatter_mean(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the data-parallel mean of ``full`` (a flat gradient)."""
        return self.reduce_scatter_mean_async(full).wait()

    def reduce_scatter_mean_async(self, full: torch.Tensor) -> "PendingShard":
        """Launch the reduce-scatter of ``full`` and return at once (``async_op``), so the
        collective runs while the caller computes; ``wait()`` gives this rank's shard."""
        if self.size == 1:
            return PendingShard(None, full)
        start, end, per = self.shard(full.numel())
        padded = torch.zeros(per * self.size, dtype=full.dtype, device=full.device)
        padded[:full.numel()] = full
        padded.mul_(1.0 / self.size)  # Megatron's gradient_scaling_factor, before the sum
        local = torch.empty(per, dtype=full.dtype, device=full.device)
        work = dist.reduce_scatter_tensor(local, padded, group=self.group, async_op=True)
        return PendingShard(work, local[:end - start], keep=padded)

    def all_gather(self, local: torch.Tensor, numel: int) -> torch.Tensor:
        """The full flat from every rank's shard."""
        if self.size == 1:
            return local
        _, _, per = self.shard(numel)
        send = torch.zeros(per, dtype=local.dtype, device=local.device)
        send[:local.numel()] = local
        full = torch.empty(per * self.size, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(full, send, group=self.group)
        return full[:numel]

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            value = all_reduce_on_backend(value, group=self.group)
        return value

    def max(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            value = all_reduce_on_backend(value, op=dist.ReduceOp.MAX, group=self.group)
        return value
