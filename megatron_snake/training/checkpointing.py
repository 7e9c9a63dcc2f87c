"""--save / --load: the whole training state, written atomically.

Layout (Megatron-LM's names): ``<save>/iter_0000005/mp_rank_00/model_optim_rng.pt`` and
``<save>/latest_checkpointed_iteration.txt``. An iteration directory is written under a
temporary name and renamed only when every file in it is complete, and the tracker file is
replaced atomically after that, so a crash during a save leaves the previous checkpoint
valid.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
# Settings that must match between the run that saved and the run that loads.
MUST_MATCH = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "seq_length", "position_embedding_type",
              "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
              "bf16", "fp16")


def _rank_dir_name(sharded: bool) -> str:
    """Megatron-LM's per-model-parallel-rank name; with an optimizer sharded over
    data-parallel ranks (--snake-offload), one per data-parallel rank too."""
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{pp:03d}"
    if sharded and parallel_state.get_data_parallel_world_size() > 1:
        name += f"_dp{parallel_state.get_data_parallel_rank():03d}"
    return name


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rng_state() -> dict:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": dict(get_cuda_rng_tracker().get_states()),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def save_checkpoint(root: str, *, iteration: int, consumed_samples: int, model_state: dict,
                    optimizer_state: dict, scheduler_state: dict, args) -> str:
    """Write the training state of this rank; returns the iteration directory."""
    final = _iter_dir(root, iteration)
    tmp = final + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharded = args.snake_offload  # each data-parallel rank holds its own optimizer shard
    writer = sharded or parallel_state.get_data_parallel_rank() == 0
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save of this iteration
        os.makedirs(tmp)
    _barrier()
    if writer:
        state = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "args": {k: getattr(args, k) for k in MUST_MATCH},
            "snake": {"offload": args.snake_offload,
                      "checkpoint_interval": args.snake_checkpoint_interval,
                      "schedule": args.snake_schedule,
                      "alpha": args.snake_alpha},
            "model": model_state,
            "optimizer": optimizer_state,
            "opt_param_scheduler": scheduler_state,
            "rng_state": rng_state(),
        }
        path = os.path.join(tmp, _rank_dir_name(sharded), "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path + ".part")
        with open(path + ".part", "rb") as f:
            os.fsync(f.fileno())
        os.replace(path + ".part", path)
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
    _barrier()
    return final


def load_checkpoint(root: str, *, args) -> dict:
    """Read this rank's state from the latest checkpoint under ``root``, checked against
    the flags of this run. The caller applies its "model", "optimizer",
    "opt_param_scheduler" and "rng_state" entries."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(
            f"--load {root}: no {TRACKER} in it; is this a --save directory of megatron_snake?")
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = os.path.join(_iter_dir(root, iteration), _rank_dir_name(args.snake_offload),
                        "model_optim_rng.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load {root}: checkpoint file {path} is missing")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"--load {path}: format version {state.get('format_version')} is not "
                         f"{FORMAT_VERSION}")
    mismatched = {k: (v, getattr(args, k)) for k, v in state["args"].items()
                  if getattr(args, k) != v}
    if mismatched:
        detail = ", ".join(f"--{k.replace('_', '-')} saved {a!r} now {b!r}"
                           for k, (a, b) in mismatched.items())
        raise ValueError(f"--load {root}: the checkpoint was saved with other settings: {detail}")
    if not args.no_load_optim and state["snake"]["offload"] != args.snake_offload:
        raise ValueError(
            f"--load {root}: the optimizer state was saved "
            f"{'with' if state['snake']['offload'] else 'without'} --snake-offload; load it "
            "the same way, or pass --no-load-optim to take only the weights")
    return state


def _barrier():
    if dist.is_initialized():
        dist.barrier()
