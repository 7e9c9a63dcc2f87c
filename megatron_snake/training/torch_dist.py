"""``--ckpt-format torch_dist`` (the default): Megatron-Core's distributed checkpoint format,
through ``megatron.core.dist_checkpointing``, for runs with and without ``--snake-offload``.

What is saved is what Megatron-LM saves: the model's ``sharded_state_dict()`` (each tensor
with its global shape and this rank's offsets, so a checkpoint saved with one TP / PP / DP
layout loads into another), the optimizer's (``optimizer.state.<exp_avg|...>.<key>``), and
in ``common.pt`` the flags as an ``argparse.Namespace`` of plain values (with
``consumed_train_samples``), ``checkpoint_version`` 3.0, the iteration and the learning-rate
schedule. The RNG state of each (pipeline, tensor) rank is a ShardedObject
``snake_rng_state`` (Megatron-LM's own ``rng_state`` holds numpy objects, which the safe
reader refuses: load Megatron-LM's checkpoints with ``--no-load-rng``). An offloaded run
writes and reads the same files one unit at a time (``torch_dist_offloaded``), so a
checkpoint of either kind of run loads into the other.

The iteration directory is written under a temporary name (``iter_0000005.tmp``, 0700) and
renamed, then the tracker is replaced, as in the ``torch`` format: a crash mid-save leaves
the previous checkpoint valid. Every file is a new 0600 file, never written through a link.
Loading goes through ``safe_dcp``: nothing in the files is run, no file is read through a
link or outside the iteration directory, and a damaged file is refused naming it; the
iteration stored in ``common.pt`` must be the one the directory's name says.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from torch.distributed.checkpoint.api import CheckpointException

from megatron_snake.training import safe_dcp
from megatron_snake.training.safe_dcp import corrupt, open_checkpoint_file, read_metadata
from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.optim.precision import REMAINDER, Precision, dtype_name, join_flat
from megatron_snake.training import checkpointing as ckpt
from megatron_snake.training import torch_dist_offloaded
from megatron_snake.training.dcp_stream import stream_save
from megatron_snake.training.checkpointing import CheckpointCorruptError, UnsafeCheckpointError

CHECKPOINT_VERSION = 3.0
LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size")   # may differ on load
RNG_KEY = "snake_rng_state"
MEGATRON_LM_RNG_KEY = "rng_state"   # Megatron-LM's (numpy objects inside: never read here)
# How the optimizer's keys were made (Megatron-LM writes it; its load reads it back)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
CONFIG_FILE = "metadata.json"     # Megatron writes it last; its presence marks the format
_CONFIG_KEYS = {f.name for f in dataclasses.fields(CheckpointingConfig)}
_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def is_torch_dist(iter_dir: str) -> bool:
    return os.path.isfile(os.path.join(iter_dir, CONFIG_FILE))


def _rng_object(state) -> ShardedObject:
    pp, tp = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank())
    sizes = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    return ShardedObject(RNG_KEY, state, sizes, (pp, tp),
                         replica_id=parallel_state.get_data_parallel_rank())


def _flags(args, consumed_samples: int) -> argparse.Namespace:
    """The flags as Megatron-LM keeps them in common.pt: plain values only (Megatron-LM's
    own flags keep their consumed-sample counts there too)."""
    # exact types: a subclass (Megatron-LM's exit_signal is an IntEnum) pickles as a
    # reference to its class, which the safe loader refuses
    plain = {k: v for k, v in vars(args).items()
             if type(v) in _PLAIN or (type(v) in (list, tuple) and
                                      all(type(x) in _PLAIN for x in v))}
    plain.update(consumed_train_samples=consumed_samples,
                 consumed_valid_samples=getattr(args, "consumed_valid_samples", 0))
    return argparse.Namespace(**plain)


def _sharded_state(model, optimizer, *, with_optimizer: bool, loading: bool = False) -> dict:
    # the bare GPTModel's keys (a DDP wrapper would prefix every key with "module.")
    model_sd = unwrap_model(model).sharded_state_dict()
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading)
    return state


def save(root: str, *, iteration: int, consumed_samples: int, run, flops_so_far: float = 0,
         megatron_lm_rng=None) -> str:
    """Write ``iter_<iteration>`` under ``root`` in Megatron's format (collective); returns
    its path. An offloaded run writes one layout at a time (``torch_dist_offloaded``).
    ``megatron_lm_rng``: Megatron-LM's own ``rng_state`` object, written beside this
    project's so that Megatron-LM loads the checkpoint with its RNG (the plug-in)."""
    args = run.args
    tmp = ckpt.begin_iteration_dir(root, iteration)
    extra = {}
    if not args.no_save_rng:
        extra[RNG_KEY] = _rng_object([ckpt.rng_state()])
        if megatron_lm_rng is not None:
            extra[MEGATRON_LM_RNG_KEY] = megatron_lm_rng
    common = dict(args=_flags(args, consumed_samples), checkpoint_version=CHECKPOINT_VERSION,
                  iteration=iteration, opt_param_scheduler=run.scheduler.state_dict(),
                  num_floating_point_operations_so_far=flops_so_far,
                  content_metadata=CONTENT_METADATA)
    with ckpt._failed_save(root, tmp, cleanup=tmp if dist.get_rank() == 0 else None), \
            _first_cause():   # a full disk is reported as itself, not as DCP's wrapper
        if run.offloaded:
            torch_dist_offloaded.save(tmp, run, with_optimizer=not args.no_save_optim,
                                      extra=extra, common=common)
        else:
            # Megatron's split into sharded and common parts, then the same writer (one
            # file per rank, written in this process: Megatron's own forks writers)
            state = _sharded_state(run.model, run.optimizer,
                                   with_optimizer=not args.no_save_optim)
            sharded, plain = save_preprocess({**state, **extra, **common},
                                             validate_access_integrity=False)
            stream_save(sharded, plain, tmp)
    return ckpt.publish_iteration_dir(root, iteration)


def load(iter_dir: str, *, root: str, run, takes_optimizer: bool, takes_rng: bool) -> dict:
    """Load ``iter_dir``'s model (and optimizer and RNG state, as asked) into the run,
    resharded to this run's layout, whichever kind of run saved it. Returns the saved
    "iteration", "consumed_samples", "opt_param_scheduler" (for the caller to apply) and
    "notes" for the log."""
    args = run.args
    expected = _iteration_named(iter_dir)
    config = _read_config(iter_dir)
    if config.get("sharded_backend") != "torch_dist":
        raise ckpt.CheckpointMismatchError(
            f"--load {root}: {iter_dir} is a {config.get('sharded_backend')!r} checkpoint; "
            "this run reads torch_dist and its own torch format")
    # both pickles checked here, before any collective: a refusal names the file
    metadata = read_metadata(os.path.join(iter_dir, ".metadata"))
    common = safe_dcp.load_common_state(iter_dir)
    # a directory copied or linked from another run holds another iteration
    ckpt.check_saved_iteration(root, iter_dir, expected=expected, saved=common.get("iteration"))
    saved_args = common.get("args")
    if not isinstance(saved_args, argparse.Namespace):
        raise corrupt(os.path.join(iter_dir, "common.pt"), "it has no flags (args)")
    # the model's flags must match; the parallel layout may differ (resharding)
    ckpt.refuse_other_settings(root, vars(saved_args), args,
                               keys=[k for k in ckpt.MUST_MATCH if k not in LAYOUT])
    if takes_optimizer and getattr(saved_args, "no_save_optim", False):
        raise ckpt.CheckpointMismatchError(
            f"--load {root}: the checkpoint was saved with --no-save-optim and holds no "
            "optimizer state; pass --no-load-optim (or --finetune)")
    if takes_rng and getattr(saved_args, "no_save_rng", False):
        raise ckpt.CheckpointMismatchError(f"--load {root}: the checkpoint was saved with "
                                           "--no-save-rng; pass --no-load-rng")
    notes = []
    same_layout = all(getattr(saved_args, k, None) == getattr(args, k) for k in LAYOUT)
    if takes_rng and not same_layout:
        takes_rng = False   # another layout's ranks have other RNG streams
        notes.append("RNG state not loaded: saved with another tensor / pipeline layout")
    saved_keys = {key.split("/")[0] for key in metadata.state_dict_metadata}
    if takes_rng and RNG_KEY not in saved_keys and MEGATRON_LM_RNG_KEY in saved_keys:
        takes_rng = False   # a plain Megatron-LM run's: numpy objects, which are not read
        notes.append("RNG state not loaded: the checkpoint holds only Megatron-LM's own "
                     "(numpy objects, which megatron_snake does not unpickle); the run "
                     "continues with its own RNG (--no-load-rng says so explicitly)")
    extra = {RNG_KEY: _rng_object(None)} if takes_rng else {}
    master_dtype = _saved_master_dtype(metadata)
    if takes_optimizer:
        notes += precision_notes(saved_args, args, master_dtype)
    with _refusals(root, iter_dir):
        if run.offloaded:
            loaded = torch_dist_offloaded.load(iter_dir, run, with_optimizer=takes_optimizer,
                                               extra=extra, master_dtype=master_dtype,
                                               metadata=metadata)
        else:
            loaded = _load_in_memory(iter_dir, root, run, takes_optimizer, extra,
                                     master_dtype)
    if takes_optimizer and run.offloaded:
        step, scaler = torch_dist_offloaded.saved_step(common.get("optimizer") or {})
        run.optimizer.load_state_dict({"iteration": step, "param_groups": [],
                                       **({"grad_scaler": scaler} if scaler else {})})
    elif run.offloaded:   # a fresh optimizer's masters: the loaded weights instead
        run.offloaded.weights.reload_master_weights()
    if takes_rng:
        ckpt.set_rng_state(loaded[RNG_KEY][0])
    return {"iteration": common["iteration"],
            "consumed_samples": int(saved_args.consumed_train_samples),
            "consumed_valid_samples": int(getattr(saved_args, "consumed_valid_samples", 0)),
            "flops_so_far": common.get("num_floating_point_operations_so_far", 0),
            "opt_param_scheduler": common["opt_param_scheduler"], "notes": notes}


MASTER_PREFIX = "optimizer.state.fp32_param."


def _saved_master_dtype(metadata) -> torch.dtype | None:
    """The dtype the checkpoint holds its master weights (``fp32_param``) in: float32, or
    int16 remainders (Megatron-Core's precision-aware optimizer under bf16); None without
    them (fp32 training, where the weights are the masters)."""
    dtypes = {getattr(getattr(meta, "properties", None), "dtype", None)
              for key, meta in metadata.state_dict_metadata.items()
              if key.startswith(MASTER_PREFIX)}
    dtypes.discard(None)
    if len(dtypes) > 1:
        raise ckpt.CheckpointMismatchError(f"the checkpoint's master weights are in several "
                                           f"dtypes ({sorted(map(str, dtypes))})")
    return dtypes.pop() if dtypes else None


def _saved_precision(saved_args, master_dtype: torch.dtype | None) -> Precision | None:
    """The dtypes the saving run stored its optimizer states in, from its flags."""
    try:
        return Precision.from_args(saved_args)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def precision_notes(saved_args, args, master_dtype: torch.dtype | None) -> list[str]:
    """What a load converts between the saving run's optimizer dtypes and this run's (a
    checkpoint holds fp32 moments and fp32 or remainder masters either way), in words."""
    here = Precision.from_args(args)
    saved = _saved_precision(saved_args, master_dtype)
    notes = []
    if master_dtype == REMAINDER and not here.remainders:
        notes.append("optimizer: master weights rebuilt from the checkpoint's bf16 weights "
                     "and 16-bit remainders (exact)")
    elif master_dtype == torch.float32 and here.remainders:
        notes.append("optimizer: fp32 master weights split into bf16 weights and 16-bit "
                     "remainders (exact; a working weight takes the split's rounding, ties "
                     "away from zero, where a master lies halfway between two bf16 values)")
    if saved is None:
        return notes
    for name, flag in (("exp_avg", "--exp-avg-dtype"), ("exp_avg_sq", "--exp-avg-sq-dtype"),
                       ("master", "--main-params-dtype")):
        was, now = saved.dtype(name), here.dtype(name)
        if name == "master":
            was = torch.float32 if was == REMAINDER else was
            now = torch.float32 if now == REMAINDER else now
        if was != now:
            notes.append(f"optimizer: {name} saved by a run that stored it in "
                         f"{dtype_name(was)}, stored here in {dtype_name(now)} ({flag}): "
                         + ("rounded on load by Transformer Engine's rule (approximate)"
                            if now != torch.float32 else "taken as saved"))
    return notes


def _iteration_named(iter_dir: str) -> int:
    """The iteration in the directory's name as a save writes it (``iter_0000005``: 5)."""
    name = os.path.basename(os.path.normpath(iter_dir))
    found = re.fullmatch(r"iter_([0-9]{7,})", name)
    if not found or name != f"iter_{int(found.group(1)):07d}":
        raise ValueError(f"{iter_dir} is not named iter_<iteration> as a save names it")
    return int(found.group(1))


def _read_config(iter_dir: str) -> dict:
    """``metadata.json``: Megatron's CheckpointingConfig as a JSON object (Megatron's loader
    reads it again and passes its keys to CheckpointingConfig)."""
    path = os.path.join(iter_dir, CONFIG_FILE)
    with open_checkpoint_file(path) as f:
        raw = f.read(1 << 16)
    try:
        config = json.loads(raw.decode("utf-8"))
    except ValueError:   # not UTF-8, not JSON (truncated, empty)
        config = None
    if not isinstance(config, dict) or not set(config) <= _CONFIG_KEYS:
        raise corrupt(path, "not the JSON object a save writes")
    return config


def _load_in_memory(iter_dir: str, root: str, run, takes_optimizer: bool, extra: dict,
                    master_dtype: torch.dtype | None = None) -> dict:
    """Megatron's own load into a run that holds its model: one collective read. Master
    weights saved as remainders (an offloaded run's precision-aware optimizer under bf16)
    are read as int16 and joined with the loaded bf16 weights into the fp32 masters."""
    state = _sharded_state(run.model, run.optimizer, with_optimizer=takes_optimizer,
                           loading=True)
    remainders = takes_optimizer and master_dtype == REMAINDER
    if remainders:
        _read_masters_as_remainders(run.optimizer, state["optimizer"])
    loaded = safe_dcp.load({**state, **extra}, iter_dir)
    result = unwrap_model(run.model).load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ckpt.CheckpointMismatchError(
            f"--load {root}: the checkpoint's model does not match this run's (missing "
            f"{missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    if remainders:
        _join_remainders(run.optimizer, loaded["optimizer"])
    if takes_optimizer:
        run.optimizer.load_state_dict(loaded["optimizer"])
    else:
        run.optimizer.reload_model_params()
    return loaded


def _float16_optimizers(optimizer, state: dict) -> list[tuple[object, dict]]:
    """(Megatron's Float16OptimizerWithFloat16Params, its part of ``state``) of a plain run's
    optimizer: itself, or each one a ChainedOptimizer chains (one: its state unprefixed)."""
    inners = getattr(optimizer, "chained_optimizers", None)
    if inners is None:
        return [(optimizer, state)]
    if len(inners) == 1:
        return [(inners[0], state)]
    return [(inner, state[i]) for i, inner in enumerate(inners)]


def _masters(optimizer_state) -> list:
    """The master-weight groups of one of Megatron's Float16OptimizerWithFloat16Params'
    state (``fp32_from_fp16_params``)."""
    masters = optimizer_state.get("fp32_from_fp16_params") if isinstance(
        optimizer_state, dict) else None
    if masters is None:
        raise ckpt.CheckpointMismatchError(
            "the checkpoint's master weights are bf16 weights + 16-bit remainders, and this "
            "run's optimizer keeps no fp32 master weights to rebuild them into (train with "
            "--bf16, as the saving run did)")
    return masters


def _read_masters_as_remainders(optimizer, optimizer_state: dict) -> None:
    """Make the plain optimizer's master-weight targets int16, the checkpoint's dtype."""
    for _, state in _float16_optimizers(optimizer, optimizer_state):
        for group in _masters(state):
            for i, sh in enumerate(group):
                group[i] = dataclasses.replace(
                    sh, data=torch.empty_like(sh.data, dtype=REMAINDER), dtype=REMAINDER)


def _join_remainders(optimizer, loaded_state: dict) -> None:
    """The loaded int16 remainders, joined with the model's loaded bf16 weights, as fp32
    masters in place in ``loaded_state`` (what ``load_state_dict`` copies)."""
    for inner, state in _float16_optimizers(optimizer, loaded_state):
        for params, group in zip(inner.float16_groups, _masters(state)):
            for i, (param, rem) in enumerate(zip(params, group)):
                master = join_flat(param.detach().reshape(-1).cpu(), rem.reshape(-1).cpu())
                group[i] = master.view(param.shape).to(param.device)


def _causes(exc: CheckpointException) -> list[BaseException]:
    """The failures DCP gathered from every rank into one CheckpointException."""
    return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]


@contextlib.contextmanager
def _first_cause():
    try:
        yield
    except CheckpointException as exc:
        causes = _causes(exc)
        if not causes:
            raise
        raise causes[0] from exc


@contextlib.contextmanager
def _refusals(root: str, iter_dir: str):
    """One error naming --load for what DCP gathered from the ranks: a refused object or a
    corrupt file as it is, a missing key with what to pass instead, anything else (a shape
    that does not match) with its type and its own words."""
    try:
        yield
    except CheckpointException as exc:
        causes = _causes(exc)
        ours = [e for e in causes if isinstance(e, (UnsafeCheckpointError,
                                                    CheckpointCorruptError))]
        if ours:
            raise ours[0] from None
        if not causes:
            raise
        missing = next((e for e in causes if isinstance(e, KeyError)), None)
        if missing is None:
            cause = causes[0]
            # some of Megatron's and torch's checks raise without a message
            why = " ".join(str(cause).split())[:300] or \
                "raised without a message while Megatron's loader read it"
            raise ckpt.CheckpointMismatchError(
                f"--load {root}: {iter_dir} does not fit this run: "
                f"{type(cause).__name__}: {why}") from cause
        # Megatron's message: "<key> from model not in state dict: <every key saved>"
        key = str(missing).strip("'\"").split(" from model not in state dict")[0]
        advice = ("pass --no-load-optim (it was saved without, or by another optimizer)"
                  if key.startswith("optimizer.") else "pass --no-load-rng"
                  if key.startswith(RNG_KEY) else "is it a checkpoint of this model?")
        raise ckpt.CheckpointMismatchError(
            f"--load {root}: {iter_dir} lacks {key}: {advice}") from None
