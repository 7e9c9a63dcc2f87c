"""Open the run's tiered store from the flags, plan its NVMe bytes, report traffic."""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from contextlib import contextmanager

import torch

from megatron_snake.offload.store import TensorStore

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
    """The tensor store for ``--snake-activation-tier host|nvme`` (None for ``device``),
    with the NVMe capacity for one step's checkpoints checked before the first step. Its
    files, and a temporary directory made for it, are removed on exit."""
    if not args.snake_offload or args.snake_activation_tier == "device":
        yield None
        return
    made = None if args.snake_offload_dir else tempfile.mkdtemp(prefix="megatron_snake_")
    try:
        with TensorStore(args.snake_offload_dir or made, rank=rank, device=device,
                         host_memory_limit=args.snake_host_memory_limit) as store:
            if args.snake_activation_tier == "nvme":
                store.check_capacity(checkpoint_bytes_per_step(args))
            yield store
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def traffic(store: TensorStore | None) -> str:
    """Bytes read/written per tier since the start, for the log line."""
    if store is None:
        return ""
    c = store.counters
    return " | ".join(f"{tier} r/w {c.read[tier] / 2**20:.1f}/{c.written[tier] / 2**20:.1f} MiB"
                      for tier in ("nvme", "host") if c.read[tier] or c.written[tier])
