"""Writing a Megatron-Core sharded state dict in the ``torch_dist`` layout one tensor at a
time, for state that is never whole in memory (the offloaded state of a ``--snake-offload``
run).

Megatron's ``dist_checkpointing.save`` resolves every tensor of a rank before it writes
(and torch's ``FileSystemWriter`` keeps each written tensor of a file alive until the file
closes, for its safetensors format), so a rank's whole state would be in memory at once.
Here the ShardedTensors carry meta ``.data`` and ``LazySavePlanner`` asks a ``produce``
function for each write item's bytes when the writer reaches it; ``StreamingWriter`` writes
and drops each before asking for the next, in an order the caller gives (one unit's pieces
together, so the caller reads each unit from its tier once). The files are the ones
Megatron writes (``.metadata``, ``__<rank>_0.distcp``, ``common.pt``, ``metadata.json``
last) and ``megatron.core.dist_checkpointing.load`` reads them. Each is a new 0600 file,
created without following a link (``safe_dcp.NoFollowFileSystem``, ``safe_files``), where
torch's and Megatron's writers make 0644 files through whatever is at the path.

``fragment_sharded_tensors`` describes an arbitrary flat element range of a parameter (a
data-parallel shard of a flat layout) as rectangular boxes of the parameter's global
tensor, which Megatron 0.16 accepts as an irregular grid (it refuses ``flattened_range``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import queue
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                         validate_sharding_integrity)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future

from megatron_snake.optim.dp_shards import all_reduce_on_backend
from megatron_snake.storage.safe_files import create_file
from megatron_snake.training.safe_dcp import NoFollowFileSystem

# (fqn, global offsets, sizes, dtype) -> a CPU tensor of those sizes
Produce = Callable[[str, tuple, tuple, torch.dtype], torch.Tensor]

# torch's private pieces the writer relies on (pinned like the Megatron patches: a torch
# whose writer changed fails check_torch_sites, and its test, instead of writing wrongly)
_TORCH_SITES = ((dcp_filesystem, "_write_files_from_queue", "tensor_dict[write_item.index.fqn]"),
                (dcp_filesystem, "_write_item", "serialization_format"),
                (dcp_filesystem.FileSystemWriter, "write_data", "self._write_data(planner, "))


def check_torch_sites() -> None:
    for owner, name, fragment in _TORCH_SITES:
        if fragment not in inspect.getsource(getattr(owner, name)):
            raise RuntimeError(f"torch {torch.__version__}: {name} no longer contains "
                               f"{fragment!r}; megatron_snake's streaming checkpoint writer "
                               "must be checked against it")


class LazySavePlanner(MCoreSavePlanner):
    """Megatron's save planner whose tensors come from ``produce`` when written (items it
    does not know, ``is_lazy`` False, resolve as usual), ordered by ``order(fqn, offsets)``."""

    def __init__(self, produce: Produce, is_lazy: Callable[[str, tuple], bool],
                 order: Callable[[str, tuple], int], **kwargs):
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False, **kwargs)
        self.produce, self.is_lazy, self.order = produce, is_lazy, order

    @staticmethod
    def _where(item) -> tuple[str, tuple]:
        return item.index.fqn, tuple(item.tensor_data.chunk.offsets)

    def create_local_plan(self):
        plan = super().create_local_plan()
        tensors = sorted((i for i in plan.items if i.type != WriteItemType.BYTE_IO),
                         key=lambda i: self.order(*self._where(i)))
        plan.items[:] = [i for i in plan.items if i.type == WriteItemType.BYTE_IO] + tensors
        return plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO or not self.is_lazy(*self._where(write_item)):
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        return self.produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes),
                            write_item.tensor_data.properties.dtype).reshape(tuple(chunk.sizes))


class StreamingWriter(FileSystemWriter):
    """One file per rank, in plan order; each tensor is resolved, written and dropped before
    the next, so the writer holds one tensor (torch's own keeps the whole file's)."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs = NoFollowFileSystem()   # the .distcp files and .metadata: new, 0600

    def _write_data(self, planner, file_queue: queue.Queue) -> Future:
        results = []
        while True:
            try:
                path, storage_key, items = file_queue.get_nowait()
            except queue.Empty:
                break
            with self.fs.create_stream(path, "wb") as file:
                stream = _WriteErrors(file)
                for item in items:
                    data = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        data = data.detach().cpu()
                        if data.untyped_storage().nbytes() != data.nbytes:
                            data = data.clone()   # torch.save writes a view's whole storage
                    with stream.reported():
                        results.append(dcp_filesystem._write_item(
                            self.transforms, stream, data, item, storage_key,
                            dcp_filesystem.SerializationFormat.TORCH_SAVE))
                    del data
                os.fsync(file.fileno())
        done = Future()
        done.set_result(results)
        return done


class _WriteErrors:
    """A file whose failed writes are kept: torch.save reports a write that failed (a full
    disk) as "unexpected pos", so the writer raises the OSError itself instead."""

    def __init__(self, file):
        self._file, self.error = file, None

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name):
        return getattr(self._file, name)

    @contextlib.contextmanager
    def reported(self):
        """torch.save's RuntimeError for a failed write, raised as the OSError itself."""
        try:
            yield
        except RuntimeError as exc:
            if self.error is None:
                raise
            raise self.error from exc


def stream_save(sharded: dict, common: dict, directory: str, produce: Produce | None = None,
                is_lazy: Callable[[str, tuple], bool] = lambda key, offsets: False,
                order: Callable[[str, tuple], int] = lambda key, offsets: 0) -> None:
    """Write ``sharded`` (ShardedTensors, lazy ones with meta ``.data``, and ShardedObjects)
    and ``common`` (``common.pt``, rank 0) into the existing ``directory`` as Megatron's
    ``dist_checkpointing.save`` would (collective). Without ``produce`` every tensor is
    written as it is (a run that holds its model)."""
    check_torch_sites()
    # what dist_checkpointing.save checks on regular grids (DCP's own plan check covers the
    # boxes: each element saved once)
    validate_sharding_integrity(determine_global_metadata(sharded)[1])
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    dcp.save(mcore_to_pyt_state_dict(flat, False), storage_writer=StreamingWriter(directory),
             planner=LazySavePlanner(produce, is_lazy, order))
    error = None
    if dist.get_rank() == 0:
        try:
            _write_durably(os.path.join(directory, "common.pt"), lambda f: torch.save(common, f))
            # last: marks it whole (Megatron's save_config, as a 0600 file)
            config = json.dumps(dataclasses.asdict(CheckpointingConfig("torch_dist", 1)))
            _write_durably(os.path.join(directory, "metadata.json"),
                           lambda f: f.write(config.encode()))
        except Exception as exc:   # noqa: BLE001 (reported on every rank below)
            error = exc
    # every rank learns whether rank 0's files made it (none waits for a rank that failed)
    failed = all_reduce_on_backend(torch.tensor([float(error is not None)]), group=None)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"rank 0 failed to write common.pt / metadata.json in {directory}: "
                           "its log has the cause")


def _write_durably(path: str, write) -> None:
    """``write(file)`` into a new 0600 file ``path`` (never through a link), fsynced."""
    with os.fdopen(create_file(path, what="checkpoint file"), "wb") as f:
        stream = _WriteErrors(f)
        with stream.reported():
            write(stream)
        f.flush()
        os.fsync(f.fileno())


def flat_range_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """(offset, size) boxes covering the flat elements [lo, hi) of a C-contiguous tensor of
    ``shape``, in order, each itself a contiguous flat run (at most 2 * ndim - 1)."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [((first, *o), (1, *s))
                for o, s in flat_range_boxes(shape[1:], lo - first * inner, hi - first * inner)]
    boxes = []
    if lo % inner:   # the end of a partial first row
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo % inner, inner)]
        first += 1
    whole_end = hi // inner
    if whole_end > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if hi % inner:   # the start of a partial last row
        boxes += [((whole_end, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, hi % inner)]
    return boxes


def fragment_sharded_tensors(key: str, model_sh: ShardedTensor, lo: int, hi: int,
                             dtype: torch.dtype) -> list[tuple[ShardedTensor, int, int]]:
    """ShardedTensors (irregular grid, meta ``.data``) under ``key`` for the elements
    [lo, hi) of the flattened local (tensor-parallel) tensor that the model's ShardedTensor
    ``model_sh`` describes, with its replica over data parallelism dropped (each
    data-parallel rank holds its own range). Returns [(ShardedTensor, lo, hi)] per box."""
    stacked = model_sh.prepend_axis_num        # the layer axis of stacked decoder layers
    replica = model_sh.replica_id
    replica = (*replica[:-1], 0) if isinstance(replica, tuple) else 0   # last: the DP rank
    out, start = [], lo
    for offset, size in flat_range_boxes(model_sh.local_shape, lo, hi):
        shape = (1,) * stacked + tuple(size)
        out.append((ShardedTensor(
            key=key, data=torch.empty(shape, dtype=dtype, device="meta"), dtype=dtype,
            local_shape=shape, global_shape=model_sh.global_shape,
            global_offset=tuple(model_sh.global_offset[:stacked]) + tuple(
                g + o for g, o in zip(model_sh.global_offset[stacked:], offset)),
            axis_fragmentations=None, replica_id=replica, prepend_axis_num=0,
            # a padded vocabulary differs between TP sizes: Megatron reads what overlaps
            allow_shape_mismatch=model_sh.allow_shape_mismatch),
            start, start + math.prod(size)))
        start += math.prod(size)
    return out
