"""Reading Megatron's distributed checkpoints (``--ckpt-format torch_dist``) without running
anything stored in them.

Megatron-Core's loader goes through four readers that unpickle more than tensors and plain
values: torch's ``FileSystemReader.read_metadata`` (plain ``pickle.load`` of ``.metadata``),
the load planner's ``load_bytes`` (``torch.load(weights_only=False)`` of every
ShardedObject), and ``common.pt`` and the tensor chunks (``torch.load(weights_only=True)``,
but under torch's process-wide allowlist, which importing megatron.core widens to some
thirty classes). This module replaces each with a reader that
accepts only what a checkpoint of tensors and plain values needs, and plugs them into
Megatron's own ``dist_checkpointing.load`` through its strategy arguments:

    dist_checkpointing.load(sharded_state_dict, path,
                            sharded_strategy=SafeTorchDistLoadStrategy(),
                            common_strategy=SafeCommonLoadStrategy())

Anything else is refused with an UnsafeCheckpointError naming the file and the object.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.common import (COMMON_STATE_FNAME,
                                                                TorchCommonLoadStrategy)
from megatron.core.dist_checkpointing.strategies.torch import (MCoreLoadPlanner,
                                                               TorchDistLoadShardedStrategy)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from megatron_snake.training.checkpointing import (UnsafeCheckpointError, only_safe_globals,
                                                   refused_object)

# What ``.metadata`` (torch's Metadata dataclasses; Megatron adds its pickled save plans)
# may name, by module and name.
_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")]
    + [("torch.distributed.checkpoint.filesystem", n) for n in ("_StorageInfo",
                                                                 "_StoragePrefix")]
    + [("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
       ("torch", "Size"), ("torch", "strided"), ("torch", "contiguous_format"),
       ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")]
    + [("torch", str(d).removeprefix("torch.")) for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
        torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)])
# What ``common.pt`` and ShardedObjects may hold beyond torch's own weights_only types:
# Megatron-LM keeps its flags in an argparse.Namespace.
COMMON_GLOBALS = (argparse.Namespace,)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"refers to {module}.{name}, which a checkpoint's "
                                    ".metadata never needs: refused, nothing in it was run")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError("holds a persistent id: refused")


def read_metadata(path: str):
    """The DCP ``Metadata`` in ``path`` (a ``.metadata`` file), unpickled with the
    allowlist above."""
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(f"{path} {exc}") from None


def load_plain(source, what: str):
    """``torch.load`` of tensors and plain values (and COMMON_GLOBALS) only, whatever other
    modules added to torch's process-wide allowlist."""
    try:
        with only_safe_globals(COMMON_GLOBALS):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{what} holds objects other than tensors and plain "
                                    f"values ({refused_object(exc)}): refused, nothing in it "
                                    "was run") from None


class _SafeReader(FileSystemReader):
    def read_data(self, plan, planner):
        # the tensor chunks are read with weights_only=True: under torch's own allowlist,
        # not the one megatron.core widened
        with only_safe_globals(()):
            return super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(os.path.join(self.path, ".metadata"))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(MCoreLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # torch's DefaultLoadPlanner.load_bytes, with load_plain for its unrestricted load
        fqn = read_item.dest_index.fqn
        obj = load_plain(value, f"checkpoint object {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load with the safe metadata reader and planner (its ``load``,
    with those two swapped in for the module-level ones it names)."""

    def load(self, sharded_state_dict, checkpoint_dir: Path):
        # Megatron's load builds its reader and planner through these two module names;
        # point them at ours for this call (one load at a time: loads are collective)
        reader, planner = mcore_torch._get_filesystem_reader, mcore_torch.MCoreLoadPlanner
        mcore_torch._get_filesystem_reader = lambda path, cache_metadata=False: \
            _SafeReader(path)
        mcore_torch.MCoreLoadPlanner = _SafeLoadPlanner
        try:
            return super().load(sharded_state_dict, checkpoint_dir)
        finally:
            mcore_torch._get_filesystem_reader, mcore_torch.MCoreLoadPlanner = reader, planner

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata=None):
        if metadata is None:
            metadata = read_metadata(os.path.join(checkpoint_dir, ".metadata"))
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path):
        metadata = read_metadata(os.path.join(checkpoint_dir, ".metadata"))
        sharded = {}
        for key, storage in metadata.state_dict_metadata.items():
            if isinstance(storage, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                sharded[obj.unique_key] = obj
        sharded.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return sharded


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """``common.pt`` through ``load_plain``."""

    def load_common(self, checkpoint_dir):
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        with open(path, "rb") as f:
            return load_plain(f, path)
