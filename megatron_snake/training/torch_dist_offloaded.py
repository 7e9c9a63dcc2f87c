"""The state of a ``--snake-offload`` run as Megatron's ``torch_dist`` checkpoint, written and
read one layout (unit) at a time: the file a plain Megatron-Core run writes, so either run
loads the other's checkpoint, with any tensor / pipeline / data-parallel layout.

Megatron names each tensor by its model key (``decoder.layers.mlp.linear_fc1.weight``, the
layers stacked on a leading axis) and the optimizer's by
``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model key>``. An offloaded run holds its
parameters' values in the store, each unit's flattened and sharded over data-parallel ranks,
so each rank writes and reads its own element range of each parameter as boxes of that
parameter's global tensor (``dcp_stream.fragment_sharded_tensors``): no gather, no whole
parameter in memory. The parameters that stay in the module (the tied embedding, buffers)
go through Megatron's own ShardedTensors. In fp32 the working weights are the master
weights and, as in Megatron's FP32Optimizer, no ``fp32_param`` is written.

The optimizer's plain part in ``common.pt`` (step count, parameter groups, loss scaler) has
the nesting of the optimizer a plain run builds (Megatron's FP32Optimizer, or its
Float16OptimizerWithFloat16Params under --bf16 / --fp16), so a plain run's
``optimizer.load_state_dict`` takes it.

With ``--use-precision-aware-optimizer`` the states are written as Megatron-Core's
distributed optimizer writes them (``get_unscaled_state``): the moments (and an fp16 master)
unscaled to fp32, and under master-weight remainders ``fp32_param`` holds the int16
remainders that, joined with the bf16 weights saved beside them, are the fp32 masters.
A load takes whichever form the checkpoint holds and converts it to this run's
(``OffloadedAdamW.native_master``, ``load_layout_state``).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                      ShardedTensorFactory, apply_factories)

from megatron_snake.models.gpt_units import unwrap_model
from megatron_snake.optim.dp_shards import all_reduce_on_backend
from megatron_snake.optim.precision import Precision
from megatron_snake.optim.unit_params import SHARED, FlatLayout
from megatron_snake.training import safe_dcp
from megatron_snake.training.checkpointing import CheckpointMismatchError
from megatron_snake.training.dcp_stream import fragment_sharded_tensors, stream_save

# our optimizer state names -> Megatron's
MEGATRON_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "fp32_param"}


@dataclass(frozen=True)
class Piece:
    """Where one ShardedTensor's elements are: ``state`` ("weights" or an optimizer state)
    of the layout keyed ``key``, elements [lo, hi) of this rank's flat shard of it."""

    key: object
    state: str
    lo: int
    hi: int


@contextlib.contextmanager
def _shaped_placeholders(layouts: list[FlatLayout]):
    """Each offloaded parameter, for the duration, a tensor of its real shape that holds one
    element (a broadcast), so that Megatron's ``sharded_state_dict()`` can describe it."""
    kept = [(seg.param, seg.param.data, seg.shape) for lay in layouts for seg in lay.segments]
    for param, data, shape in kept:
        param.data = torch.empty(1, dtype=data.dtype, device=data.device).expand(shape)
    try:
        yield
    finally:
        for param, data, _ in kept:
            param.data = data


def _parts(entry, shape: tuple, dtype: torch.dtype) -> list[tuple[ShardedTensor, int]]:
    """(ShardedTensor with meta ``.data``, first flat element) of each part of a parameter
    that the model's ``sharded_state_dict()`` entry describes: the whole, or the parts a
    factory cuts it into (SwiGLU's fc1 weight: its gate and up halves, each contiguous)."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    parts = entry.build_fn(entry.key, meta, entry.replica_id, None) \
        if isinstance(entry, ShardedTensorFactory) else [replace(entry, data=meta)]
    out, first = [], 0
    for part in parts:
        out.append((part, first))
        first += math.prod(part.local_shape)
    return out


def model_sharded_tensors(run) -> tuple[dict, dict]:
    """The model's ``sharded_state_dict()`` without the offloaded parameters, and
    {id(parameter): ``_parts``} for every parameter in it."""
    gpt, params = unwrap_model(run.model), run.offloaded.weights.params
    offloaded = {id(seg.param) for lay in params.units for seg in lay.segments}
    parts, resident = {}, {}
    with _shaped_placeholders(params.units):
        for name, entry in gpt.sharded_state_dict().items():
            if isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
                parts[id(entry.data)] = _parts(entry, tuple(entry.data.shape), entry.data.dtype)
                if id(entry.data) in offloaded:
                    continue
            resident[name] = entry
    return resident, parts


def states_saved(args, with_optimizer: bool) -> tuple[str, ...]:
    """The optimizer states a checkpoint holds: the moments and, in 16-bit runs, the fp32
    master weights (in fp32 the working weights are the masters, as in Megatron's
    FP32Optimizer)."""
    if not with_optimizer:
        return ()
    return ("exp_avg", "exp_avg_sq") + (("master",) if args.bf16 or args.fp16 else ())


def _layout_states(args, lay: FlatLayout, with_weights: bool, with_optimizer: bool) -> tuple:
    """The states of ``lay`` a checkpoint holds: a unit's working weights (the shared
    layout's are resident) and ``states_saved``."""
    return (("weights",) if with_weights and lay.key != SHARED else ()) + \
        states_saved(args, with_optimizer)


def checkpoint_dtypes(args, master: torch.dtype | None = None) -> dict:
    """The dtype of each state in a checkpoint (``Precision.checkpoint_dtype``);
    ``master``: the one a checkpoint being loaded holds its master weights in."""
    precision = Precision.from_args(args)
    dtypes = {name: precision.checkpoint_dtype(name)
              for name in ("weights", "master", "exp_avg", "exp_avg_sq")}
    if master is not None:
        dtypes["master"] = master
    return dtypes


def layout_fragments(run, lay: FlatLayout, parts: dict, *, with_weights: bool,
                     with_optimizer: bool,
                     master_dtype: torch.dtype | None = None) -> list[tuple[ShardedTensor, Piece]]:
    """This rank's element range of layout ``lay`` as ShardedTensors under Megatron's keys:
    its working weights (a unit's; the shared layout's are resident) and, with
    ``with_optimizer``, its master weights (16-bit runs) and moments (``master_dtype``: the
    master's dtype in a checkpoint being loaded)."""
    args, weights = run.args, run.offloaded.weights
    dtypes = checkpoint_dtypes(args, master_dtype)
    start, end, _ = weights.dp.shard(lay.numel)
    states = _layout_states(args, lay, with_weights, with_optimizer)
    out = []
    for seg in lay.segments:
        if id(seg.param) not in parts:
            raise RuntimeError(f"{seg.name} has no entry in the model's sharded_state_dict(): "
                               "torch_dist cannot name it")
        for part, first in parts[id(seg.param)]:
            # this rank's elements of the part, relative to the part
            part_start = seg.offset + first
            lo = max(start, part_start) - part_start
            hi = min(end, part_start + math.prod(part.local_shape)) - part_start
            if lo >= hi:
                continue
            for state in states:
                key = part.key if state == "weights" else \
                    f"optimizer.state.{MEGATRON_NAMES[state]}.{part.key}"
                for fragment, a, b in fragment_sharded_tensors(key, part, lo, hi,
                                                               dtypes[state]):
                    out.append((fragment, Piece(lay.key, state, part_start + a - start,
                                                part_start + b - start)))
    return out


def optimizer_common(run) -> dict:
    """The plain part of the optimizer's state, nested as a plain run's optimizer nests it:
    the step count, Megatron's two parameter groups and the fp16 loss scaler."""
    args, optimizer = run.args, run.optimizer
    groups = [{"wd_mult": g["wd_mult"], "lr_mult": 1.0, "is_expert_parallel": False,
               "is_decoupled_lr": False, "default_config": True, "max_lr": args.lr,
               "min_lr": args.min_lr, "lr": g["lr"], "betas": (args.adam_beta1, args.adam_beta2),
               "eps": args.adam_eps, "weight_decay": g["weight_decay"], "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "decoupled_weight_decay": True}
              for g in optimizer.param_groups]
    inner = {"state": {"common_step": torch.tensor(float(optimizer.iteration))},
             "param_groups": groups}
    if not (args.bf16 or args.fp16):
        return inner                                   # FP32Optimizer
    common = {"optimizer": inner}                      # Float16OptimizerWithFloat16Params
    if optimizer.grad_scaler is not None:
        common["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return common


def saved_step(common: dict) -> tuple[int, dict | None]:
    """(the optimizer's step count, the loss scaler's state or None) from ``common.pt``'s
    "optimizer" entry, of either nesting."""
    inner = common.get("optimizer", common)
    try:
        return int(inner["state"]["common_step"]), common.get("grad_scaler")
    except (KeyError, TypeError):
        raise KeyError("optimizer step count (optimizer.state.common_step)") from None


def save(directory: str, run, *, with_optimizer: bool, extra: dict, common: dict) -> None:
    """Write the run's state into ``directory`` (collective): the resident model tensors,
    ``extra`` (ShardedObjects such as the RNG state), every layout's fragments (read from
    its tier one layout at a time) and ``common``, with the optimizer's plain part added."""
    weights = run.offloaded.weights
    weights.sync_resident()
    resident, parts = model_sharded_tensors(run)
    apply_factories(resident)   # (the load merges them back itself)
    layouts = weights.params.all_layouts()
    fragments = [pair for lay in layouts for pair in layout_fragments(
        run, lay, parts, with_weights=True, with_optimizer=with_optimizer)]
    where = {(sh.key, tuple(sh.global_offset)): piece for sh, piece in fragments}
    position = {lay.key: i for i, lay in enumerate(layouts)}
    states = states_saved(run.args, with_optimizer)
    cache: dict = {}

    def produce(key, offsets, sizes, dtype):
        piece = where[(key, offsets)]
        if piece.key not in cache:   # one layout's state in memory at a time
            cache.clear()
            cache[piece.key] = weights.unit_state(piece.key, states=states)
        return cache[piece.key][piece.state][piece.lo:piece.hi]

    if with_optimizer:
        common = dict(common, optimizer=optimizer_common(run))
    stream_save({"model": resident, "fragments": [sh for sh, _ in fragments], **extra}, common,
                directory, produce, is_lazy=lambda key, offsets: (key, offsets) in where,
                order=lambda key, offsets: position[where[(key, offsets)].key]
                if (key, offsets) in where else -1)
    cache.clear()


def check_recorded(metadata, pairs, where: str) -> None:
    """Each fragment a load reads must be recorded in ``metadata`` (``where``'s
    ``.metadata``) in the dtype this run reads it in (``checkpoint_dtypes``) and with its
    global shape (but a padded vocabulary's rows): torch's reader would cast another dtype into the run's buffers without a
    word. (Each chunk is held to ``.metadata`` as it is read: ``safe_dcp``.)"""
    entries = metadata.state_dict_metadata
    for fragment, _ in pairs:
        entry = entries.get(fragment.key)
        if entry is None or not hasattr(entry, "properties"):
            continue   # not there: Megatron's load names the missing key
        have, want = (entry.properties.dtype, tuple(entry.size)), \
            (fragment.dtype, tuple(fragment.global_shape))
        # a padded vocabulary's rows change with the tensor-parallel size: Megatron reads
        # the rows both have (allow_shape_mismatch), so only its dtype must agree
        if have != want and not (getattr(fragment, "allow_shape_mismatch", False)
                                 and have[0] == want[0]):
            raise CheckpointMismatchError(
                f"{where} records {fragment.key!r} as {have[0]} of shape {have[1]}, where "
                f"this run reads {want[0]} of shape {want[1]}: not a checkpoint of this "
                "model and these flags; load another")


def load(iter_dir: str, run, *, with_optimizer: bool, extra: dict,
         master_dtype: torch.dtype | None = None, metadata=None) -> dict:
    """Load ``iter_dir`` (a torch_dist checkpoint of either kind of run, any layout) into
    the offloaded run: the resident model tensors, ``extra`` and the shared layout's
    optimizer state in one collective load, then each unit in its own, one at a time.
    ``master_dtype``: the dtype the checkpoint holds the master weights in (fp32, or int16
    remainders; None: this run's). ``metadata``: its ``.metadata``, which every fragment
    is checked against (``check_recorded``). Returns the loaded ``extra``."""
    where = os.path.join(iter_dir, ".metadata")

    def checked(pairs):
        if metadata is not None:
            check_recorded(metadata, pairs, where)
        return pairs

    weights, gpt = run.offloaded.weights, unwrap_model(run.model)
    resident, parts = model_sharded_tensors(run)
    # Megatron's per-layer extra state is empty here (no Transformer Engine): not read
    resident = {k: v for k, v in resident.items() if not isinstance(v, ShardedObject)}
    shared = weights.params.shared
    pairs = checked(layout_fragments(run, shared, parts, with_weights=False,
                                     with_optimizer=with_optimizer,
                                     master_dtype=master_dtype)) if shared.segments else []
    state = _buffers(run, shared, pairs, with_optimizer, master_dtype)
    loaded = _load(iter_dir, {"model": resident, "fragments": _targets(pairs, state),
                              **extra})
    # (Megatron's load drops the entries that held nothing: a stage without resident state)
    _fill(state, pairs, loaded.get("fragments", []))
    weights.load_resident_state_dict(gpt, loaded.get("model", {}))
    if pairs:
        if "master" not in state:   # fp32: the (resident) weights are the masters
            state["master"] = _resident_shard(shared, *state["shard"])
        weights.load_shared_optimizer_state(state)
    result = {k: loaded[k] for k in extra}
    del loaded, pairs, state   # before the units' buffers
    units = weights.params.units
    # every load is collective: a stage with fewer units joins the others' with nothing
    rounds = all_reduce_on_backend(torch.tensor([len(units)]), group=None,
                                   op=dist.ReduceOp.MAX)
    for index in range(int(rounds)):
        if index >= len(units):
            _load(iter_dir, {})
            continue
        lay = units[index]
        pairs = checked(layout_fragments(run, lay, parts, with_weights=True,
                                         with_optimizer=with_optimizer,
                                         master_dtype=master_dtype))
        state = _buffers(run, lay, pairs, with_optimizer, master_dtype)
        _fill(state, pairs, _load(iter_dir, {"fragments": _targets(pairs, state)}
                                  ).get("fragments", []))
        if with_optimizer and "master" not in state:   # fp32: the weights are the masters
            state["master"] = state["weights"].float()
        weights.load_unit_state(lay.key, state, optimizer=with_optimizer)
        del state, pairs
    return result


def _resident_shard(lay: FlatLayout, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of a resident layout's parameters, flat, fp32, on the CPU."""
    return torch.cat([seg.param.detach().reshape(-1)[span.start - seg.offset:
                                                     span.stop - seg.offset].float().cpu()
                      for seg, span in lay.pieces(start, end)] or [torch.empty(0)])


def _buffers(run, lay: FlatLayout, pairs, with_optimizer: bool,
             master_dtype: torch.dtype | None = None) -> dict:
    """Flat buffers, zeroed, for this rank's shard of each state of ``lay`` a load reads
    (even an empty shard), in the checkpoint's dtypes, with the entries
    ``OffloadedUnits.load_unit_state`` checks. (Zeroed: rows a smaller padded vocabulary
    did not have stay 0.)"""
    weights = run.offloaded.weights
    start, end, _ = weights.dp.shard(lay.numel)
    state = {"numel": lay.numel, "shard": [start, end],
             "segments": [[s.name, list(s.shape), s.offset, s.numel] for s in lay.segments]}
    dtypes = checkpoint_dtypes(run.args, master_dtype)
    for name in _layout_states(run.args, lay, True, with_optimizer):
        state[name] = torch.zeros(end - start, dtype=dtypes[name])
    return state


def _targets(pairs, state: dict) -> list[ShardedTensor]:
    for fragment, piece in pairs:   # load targets: views of the flat buffers
        fragment.data = state[piece.state][piece.lo:piece.hi].view(fragment.local_shape)
    return [fragment for fragment, _ in pairs]


def _fill(state: dict, pairs, tensors: list) -> None:
    for (_, piece), tensor in zip(pairs, tensors):
        target = state[piece.state][piece.lo:piece.hi]
        if tensor.data_ptr() != target.data_ptr():
            target.copy_(tensor.reshape(-1))


def _load(iter_dir: str, sharded: dict) -> dict:
    return safe_dcp.load(sharded, iter_dir)
