"""Open the run's tiered store from the flags, plan its NVMe bytes, report traffic."""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.offload.store import TensorStore
from megatron_snake.offload.unit_weights import OffloadedUnits
from megatron_snake.optim.dp_shards import DataParallel
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.unit_params import UnitParams

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain byte count."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


def checkpoint_bytes_per_step(args) -> int:
    """Unit checkpoints alive between the sweeps: (units - 1) x M x [s, b, h]."""
    units = -(-args.num_layers // args.snake_checkpoint_interval)
    per_checkpoint = args.seq_length * args.micro_batch_size * args.hidden_size * \
        torch.tensor([], dtype=args.params_dtype).element_size()
    return (units - 1) * args.num_microbatches * per_checkpoint


@contextmanager
def open_store(args, device: torch.device, rank: int):
    """The run's tensor store under ``--snake-offload-dir`` (None without
    ``--snake-offload`` or ``--snake-activation-offload``). Its files, and a temporary directory made for it, are removed on
    exit."""
    if not (args.snake_offload or args.snake_activation_offload):
        yield None
        return
    made = None if args.snake_offload_dir else tempfile.mkdtemp(prefix="megatron_snake_")
    try:
        with TensorStore(args.snake_offload_dir or made, rank=rank, device=device,
                         host_memory_limit=args.snake_host_memory_limit) as store:
            yield store
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def traffic(store: TensorStore | None, activation_peak: dict | None = None) -> str:
    """For the log line: bytes read/written per tier since the start (all state, then unit
    checkpoints and saved tensors alone), the time callers waited on the store, and the
    last step's peak checkpoint bytes per tier."""
    if store is None:
        return ""
    c = store.counters
    parts = [f"{tier} r/w {c.read[tier] / 2**20:.1f}/{c.written[tier] / 2**20:.1f} MiB"
             for tier in ("nvme", "host") if c.read[tier] or c.written[tier]]
    for kind, label in (("activations", "checkpoints"), ("saved_activations", "saved tensors")):
        moved = c.by_kind.get(kind)
        if moved:
            parts.append(f"{label} " + ", ".join(
                f"{tier} r/w {moved[tier][0] / 2**20:.1f}/{moved[tier][1] / 2**20:.1f} MiB"
                for tier in ("nvme", "host") if any(moved[tier])))
    if activation_peak:
        parts.append("activation peak " + ", ".join(
            f"{tier} {n / 2**20:.1f} MiB" for tier, n in activation_peak.items() if n))
    parts.append(f"io wait {c.blocked_s:.2f} s")
    return " | ".join(parts)


@dataclass
class OffloadedState:
    """The offloaded training state of one model: unit weights and gradients, and the
    AdamW whose master weights and moments live in the store."""

    weights: OffloadedUnits
    optimizer: OffloadedAdamW

    def summary(self, args) -> str:
        """Bytes this rank holds per tier and moves per step."""
        weights = sum(hi - lo for lay in self.weights.params.units
                      for _, (lo, hi) in self.weights.record_parts(lay)) * \
            torch.tensor([], dtype=args.params_dtype).element_size()
        optim = self.optimizer.state_bytes()
        ckpt = checkpoint_bytes_per_step(args)
        grads = optim // 3  # fp32, one value per parameter
        # Per step: weights read in both sweeps and written once by the update; the
        # optimizer state and the fp32 gradient written and read once each.
        return (f"> offloaded state: weights {weights / 2**20:.1f} MiB on "
                f"{args.snake_param_tier}, master weights + moments {optim / 2**20:.1f} MiB on "
                f"{args.snake_optimizer_tier}, unit checkpoints {ckpt / 2**20:.1f} MiB per step "
                f"on {args.snake_activation_tier}; per step about "
                f"{(2 * weights + optim + grads) / 2**20:.1f} MiB read and "
                f"{(weights + optim + grads) / 2**20:.1f} MiB written for weights, gradients "
                f"and optimizer")


def nvme_bytes(args, weights_bytes: int, optimizer_bytes: int) -> int:
    """What the plan places on NVMe: checked against free space before the first step."""
    total = checkpoint_bytes_per_step(args) if args.snake_activation_tier == "nvme" else 0
    total += weights_bytes if args.snake_param_tier == "nvme" else 0
    total += optimizer_bytes if args.snake_optimizer_tier == "nvme" else 0
    return total


def unit_working_set_bytes(args, params: UnitParams) -> tuple[int, int]:
    """(bytes, unit) of the largest device working set of one unit: its weights and fp32
    gradient, the shared (tied) weights and their fp32 gradient, and one micro-batch's
    input and output checkpoint. Activations inside the unit come on top."""
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    checkpoint = args.seq_length * args.micro_batch_size * args.hidden_size * elem
    shared = params.shared.numel * (elem + 4)
    sizes = [lay.numel * (elem + 4) + shared + 2 * checkpoint for lay in params.units]
    unit = max(range(len(sizes)), key=sizes.__getitem__)
    return sizes[unit], unit


def grad_scaler(args):
    """Megatron-LM's loss scaler for fp16 (None otherwise): static with --loss-scale."""
    if not args.fp16:
        return None
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if args.loss_scale:
        return ConstantGradScaler(args.loss_scale)
    return DynamicGradScaler(initial_scale=args.initial_loss_scale,
                             min_scale=args.min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=args.loss_scale_window,
                             hysteresis=args.hysteresis)


def build_offloaded_state(args, gpt, store, device: torch.device) -> OffloadedState:
    """Move ``gpt``'s weights and a fresh AdamW state into ``store`` (checking the device
    limit and that the drive has room for all of it first)."""
    params = UnitParams.of(GPTUnits(gpt, args.snake_checkpoint_interval))
    if args.snake_gpu_memory_limit is not None:
        need, unit = unit_working_set_bytes(args, params)
        if args.snake_gpu_memory_limit < need:
            raise ValueError(
                f"--snake-gpu-memory-limit {args.snake_gpu_memory_limit / 2**20:.1f} MiB is below "
                f"the working set of unit {unit} ({need / 2**20:.1f} MiB: its weights and fp32 "
                "gradient, the tied weights, one micro-batch's checkpoints); the minimum is "
                f"{need} bytes. Raise the limit or lower --snake-checkpoint-interval.")
    dp_size = DataParallel.from_megatron().size
    numel = -(-sum(lay.numel for lay in params.all_layouts()) // dp_size)  # this rank's share
    elem = torch.tensor([], dtype=args.params_dtype).element_size()
    store.check_capacity(nvme_bytes(args, numel * elem, 12 * numel))
    optimizer = OffloadedAdamW(params, store, lr=args.lr, weight_decay=args.weight_decay,
                               beta1=args.adam_beta1, beta2=args.adam_beta2, eps=args.adam_eps,
                               clip_grad=args.clip_grad, alpha=args.snake_alpha,
                               tier=args.snake_optimizer_tier, dp=DataParallel.from_megatron(),
                               grad_scaler=grad_scaler(args))
    weights = OffloadedUnits(params, store, optimizer, device=device, dtype=args.params_dtype,
                             tier=args.snake_param_tier)
    return OffloadedState(weights, optimizer)
