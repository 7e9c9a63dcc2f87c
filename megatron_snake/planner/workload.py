"""What one training step asks of one rank: the units of each pipeline stage (parameters,
layers, FLOPs), the batch and the placement of every state kind. Plain numbers, so the cost
model needs no torch; ``megatron_snake.training.workload`` reads them off pretrain_gpt.py's
flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TIERS = ("device", "host", "nvme")


def layer_flops_per_token(*, hidden: int, heads: int, kv_channels: int, query_groups: int,
                          ffn: int, gated: bool, seq_length: int, tp: int = 1) -> float:
    """Forward FLOPs of one decoder layer per token (one tensor-parallel rank's share): 2 per
    weight of the attention and MLP matmuls, plus attention's scores and weighted sum
    (4 x seq x attention width: Megatron's count, causal masking not halved)."""
    width = kv_channels * heads
    kv_width = kv_channels * query_groups
    weights = hidden * (width + 2 * kv_width) + width * hidden \
        + hidden * ffn * (2 if gated else 1) + ffn * hidden
    return (2 * weights + 4 * seq_length * width) / tp


@dataclass(frozen=True)
class Stage:
    """One pipeline stage on one tensor-parallel rank (before data-parallel sharding)."""

    unit_params: tuple[int, ...]
    unit_layers: tuple[int, ...]
    unit_flops: tuple[float, ...]   # forward FLOPs of one micro-batch, per unit
    shared_params: int = 0          # a tied embedding read by the first and the last unit
    head_flops: float = 0.0         # the last stage: its output layer's forward FLOPs of one
    #                                 micro-batch (run with the last unit, timed apart: its
    #                                 softmax and loss make its rate differ from a layer's)

    def __post_init__(self):
        if not (len(self.unit_params) == len(self.unit_layers) == len(self.unit_flops) > 0):
            raise ValueError("a stage needs one parameter count, layer count and FLOP count "
                             "per unit, and at least one unit")
        if not (math.isfinite(self.head_flops) and self.head_flops >= 0):
            raise ValueError(f"head_flops must be a finite number >= 0, got {self.head_flops}")


@dataclass(frozen=True)
class Workload:
    stages: tuple[Stage, ...]
    tp: int
    dp: int
    micro_batches: int            # M: per data-parallel rank per step
    group_size: int               # G: micro-batches a snake group sweeps together
    micro_batch_size: int
    seq_length: int
    hidden_size: int
    heads: int
    elem_bytes: int               # working weights and unit inputs
    alpha: float                  # the part of each update deferred to the forward sweep
    update_in_forward: bool       # clipping or loss scaling: every update waits for the step
    param_tier: str
    optimizer_tier: str
    activation_tier: str          # device, host, nvme or auto (host while half the pool has room)
    host_pool_bytes: int          # --snake-host-memory-limit, per rank
    model_flops: float            # Megatron's count for the global batch (for MFU)
    global_batch: int
    sequence_parallel: bool = False
    host_buffer_bytes: int = 8 << 20   # the pool's buffer: a host-tier record takes whole ones
    # bytes per element of the optimizer's records: master weights, exp_avg, exp_avg_sq and
    # the gradient (fp32: 4 each; --use-precision-aware-optimizer: each in its dtype, the
    # bf16 masters' remainders 2)
    optimizer_record_bytes: tuple = (4, 4, 4, 4)
    # master-weight remainders: an update reads its part's working weights (the masters'
    # high halves), which stay where their last read left them instead of being moved down
    # to the drive by the backward read
    update_reads_weights: bool = False
    # the update's rate over the fused fp32 AdamW's (the profile's cpu_adam_params_per_s):
    # below 1 for the precision-aware optimizer's chunked update (optim/precision.py)
    update_rate_share: float = 1.0

    def __post_init__(self):
        for name in ("param_tier", "optimizer_tier"):
            if getattr(self, name) not in ("host", "nvme"):
                raise ValueError(f"{name} must be host or nvme, got {getattr(self, name)!r}")
        if self.activation_tier not in TIERS + ("auto",):
            raise ValueError(f"activation_tier must be one of {TIERS + ('auto',)}")
        if self.micro_batches % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide the "
                             f"{self.micro_batches} micro-batches")
        if not 0 < self.update_rate_share <= 1:
            raise ValueError(f"update_rate_share must be in (0, 1], got "
                             f"{self.update_rate_share!r}")
        if len(self.optimizer_record_bytes) != 4 or \
                not all(n in (1, 2, 4) for n in self.optimizer_record_bytes):
            raise ValueError("optimizer_record_bytes: 1, 2 or 4 bytes for each of master "
                             "weights, exp_avg, exp_avg_sq and the gradient")

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter of master weights and both moments (12 in fp32)."""
        return sum(self.optimizer_record_bytes[:3])

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of the gradient an update waits with (4 in fp32)."""
        return self.optimizer_record_bytes[3]

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def groups(self) -> int:
        return self.micro_batches // self.group_size

    @property
    def checkpoint_bytes(self) -> int:
        """One unit input of one micro-batch: [s / t_sp, b, h]."""
        seq = self.seq_length // (self.tp if self.sequence_parallel else 1)
        return seq * self.micro_batch_size * self.hidden_size * self.elem_bytes

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_length
