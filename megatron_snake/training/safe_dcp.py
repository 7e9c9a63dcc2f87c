"""Reading Megatron's distributed checkpoints (``--ckpt-format torch_dist``) without running
anything stored in them.

Megatron-Core's loader goes through four readers that unpickle more than tensors and plain
values: torch's ``FileSystemReader.read_metadata`` (plain ``pickle.load`` of ``.metadata``),
the load planner's ``load_bytes`` (``torch.load(weights_only=False)`` of every
ShardedObject), and ``common.pt`` and the tensor chunks (``torch.load(weights_only=True)``,
but under torch's process-wide allowlist, which importing megatron.core widens to some
thirty classes). This module replaces each with a reader that
accepts only what a checkpoint of tensors and plain values needs, and plugs them into
Megatron's own ``dist_checkpointing.load``:

    safe_dcp.load(sharded_state_dict, path)

Until megatron-core 0.16 the common state is ``common.pt``, read through the load's
``common_strategy`` argument; from 0.17 a save puts it in the DCP files (a ShardedObject
``common_state``), the load reads it through ``serialization.load_common_state_dict`` and
takes no common strategy: that name is pointed at ``load_common_state`` for the call
(``releases.Release.common_in_dcp``). ``load_common_state`` reads either layout.

Anything else is refused with an UnsafeCheckpointError naming the file and the object.

The files are opened as regular files, never through a link (``NoFollowFileSystem``), and
``.metadata`` is checked as soon as it is read (``read_metadata``): every data file it names
must be one file of the checkpoint's own directory, holding every byte range it names; a
file that is not what a save writes (truncated, empty, garbage) is a CheckpointCorruptError
naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import io
import os
import pickle
import re
import signal
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.torch import (MCoreLoadPlanner,
                                                               TorchDistLoadShardedStrategy)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorStorageMetadata)

from megatron_snake import releases
from megatron_snake.storage.errors import UnsafePathError
from megatron_snake.storage.safe_files import create_file, open_regular_file
from megatron_snake.training.checkpointing import (CheckpointCorruptError, UnsafeCheckpointError,
                                                   only_safe_globals, refused_object)

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


def _flag_enums() -> tuple:
    """The enum classes Megatron-LM's flags and common state hold (``--exit-signal``'s
    signal, the model type, the attention backend, the rerun mode, ...): every enum of
    megatron.core's two enum modules and of its rerun state machine.
    Unpickling one calls the class with a member's value, which looks the member up and
    runs nothing else."""
    from megatron.core import enums as core_enums
    from megatron.core import rerun_state_machine
    from megatron.core.transformer import enums as transformer_enums

    found = [signal.Signals]
    # (the rerun state machine's mode and state: in the common state megatron-core 0.17+
    # saves in the DCP files)
    for module in (core_enums, transformer_enums, rerun_state_machine):
        found += [value for value in vars(module).values()
                  if isinstance(value, type) and issubclass(value, enum.Enum)
                  and value.__module__ == module.__name__]
    return tuple(found)


# What ``common.pt`` and ShardedObjects may hold beyond torch's own weights_only types:
# Megatron-LM keeps its flags in an argparse.Namespace, with a few enums among them.
COMMON_GLOBALS = (argparse.Namespace, *_flag_enums())
# The one kind of data file a save writes, in the iteration directory itself: torch's and
# Megatron's writers name them "<prefix>__<rank>_<n>.distcp" (the prefix: Megatron's
# separation hint, empty by default). No "/", so no other directory and no "..".
_DATA_FILE = re.compile(r"[A-Za-z0-9_-]*__[0-9]+_[0-9]+\.distcp")
# torch's weights-only unpickler refusing an object (not a malformed file) says one of these
_REFUSAL = re.compile(r"GLOBAL|allowlisted|persistent")
ADVICE = "restore it from a copy or load an earlier iteration"


def corrupt(path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path} is corrupt ({what}); {ADVICE}")


def _why(exc: BaseException) -> str:
    """An exception in a few words: its type and its message's first sentence."""
    text = str(exc).strip().split("\n")[0].split(". ")[0][:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def open_checkpoint_file(path: str):
    """The checkpoint file ``path`` opened for reading: a regular file, never through a
    link (a FIFO, a device or a link is refused without reading from it)."""
    try:
        fd = open_regular_file(str(path), what="checkpoint file")
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint file {path} is missing; {ADVICE}") from None
    except UnsafePathError as exc:
        raise UnsafeCheckpointError(f"{exc}: refused, nothing in it was read") from None
    return os.fdopen(fd, "rb")


class NoFollowFileSystem(FileSystem):
    """torch's FileSystem for DCP's reader and writer, with streams that never go through a
    link: a file written is new and 0600 (``create_file``), a file read is a regular file
    (``open_checkpoint_file``)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode == "wb":
            stream = os.fdopen(create_file(str(path), what="checkpoint file"), "wb")
        elif mode == "rb":
            stream = open_checkpoint_file(str(path))
        else:
            raise ValueError(f"checkpoint file {path}: mode {mode!r} is not used")
        with stream:
            yield stream


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"refers to {module}.{name}, which a checkpoint's "
                                    ".metadata never needs: refused, nothing in it was run")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError("holds a persistent id: refused")


def read_metadata(path: str) -> Metadata:
    """The DCP ``Metadata`` in ``path`` (a ``.metadata`` file), unpickled with the
    allowlist above, its storage checked (``check_storage``) before anything reads it."""
    with open_checkpoint_file(path) as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as exc:
            raise UnsafeCheckpointError(f"{path} {exc}") from None
        except Exception as exc:   # noqa: BLE001 - truncated or garbage: not a save's pickle
            raise corrupt(path, f"not the pickle a save writes: {_why(exc)}") from None
    if type(metadata) is not Metadata:
        raise corrupt(path, f"it holds a {type(metadata).__name__}, not a checkpoint's Metadata")
    if type(getattr(metadata, "state_dict_metadata", None)) is not dict:
        raise corrupt(path, "its table of entries is not the dict a save writes")
    check_storage(path, getattr(metadata, "storage_data", None))
    return metadata


def check_storage(path: str, storage) -> None:
    """The storage table of the ``.metadata`` at ``path``: each entry in a data file of the
    checkpoint's own directory (one name of the form a save writes), a regular file not
    reached through a link, whose size covers every byte range named in it. Without this,
    an entry naming ``/dev/zero`` would be read for as many bytes as it says, and a FIFO
    forever."""
    if type(storage) is not dict:
        raise corrupt(path, f"its storage table is a {type(storage).__name__}")
    ends = {}   # data file -> (the end of its last byte range, the entry there)
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise corrupt(path, f"a storage entry is a {type(index).__name__}: "
                                f"{type(info).__name__}")
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset",
                                                                 "length"))
        if type(name) is not str or not _DATA_FILE.fullmatch(name):
            raise UnsafeCheckpointError(
                f"{path} places {index.fqn!r} in {name!r}: a checkpoint's data lies in files "
                "of its own directory named like __0_0.distcp; refused, nothing was read")
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"{path} asks to decode {index.fqn!r} with {info.transform_descriptors!r}, "
                "which a torch_dist save never writes; refused, nothing was read")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise corrupt(path, f"{index.fqn!r} has offset {offset!r}, length {length!r}")
        if name not in ends or offset + length > ends[name][0]:
            ends[name] = (offset + length, offset, index.fqn)
    for name, (end, offset, fqn) in ends.items():
        data_file = os.path.join(os.path.dirname(path), name)
        with open_checkpoint_file(data_file) as f:
            size = os.fstat(f.fileno()).st_size
        if size < end:
            raise corrupt(data_file, f"{size} bytes, but {os.path.basename(path)} places "
                                     f"{fqn!r} at bytes {offset}..{end}")


def load_plain(source, what: str):
    """``torch.load`` of tensors and plain values (and COMMON_GLOBALS) only, whatever other
    modules added to torch's process-wide allowlist. A file torch cannot parse is
    corrupt."""
    try:
        with only_safe_globals(COMMON_GLOBALS):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _unpickling_error(exc, what) from None
    except Exception as exc:   # noqa: BLE001 - truncated, empty, garbage
        raise corrupt(what, f"not a file torch.save wrote: {_why(exc)}") from None


def _unpickling_error(exc: pickle.UnpicklingError, what: str) -> ValueError:
    """torch's weights-only unpickler's error as ours: an object refused, or a malformed
    pickle (a corrupt file)."""
    if _REFUSAL.search(str(exc)):
        return UnsafeCheckpointError(f"{what} holds objects other than tensors and plain "
                                     f"values ({refused_object(exc)}): refused, nothing in it "
                                     "was run")
    return corrupt(what, f"not a file torch.save wrote: {refused_object(exc)}")


class _SafeReader(FileSystemReader):
    """torch's reader with the checked ``read_metadata`` and files opened through
    ``NoFollowFileSystem``; a failure while reading the data names the bytes being read.
    Every tensor chunk read must be of the dtype and shape ``.metadata`` records for it:
    torch's reader casts a chunk of another dtype into its target and narrows a larger one
    without a word."""

    def __init__(self, path):
        super().__init__(path)
        self.fs = NoFollowFileSystem()
        self._reading = f"the data files of {self.path}"
        self._chunk = None        # (entry, dtype, shape) .metadata records for the one read
        self._chunks: dict = {}   # id(storage info) -> that

    def set_up_storage_reader(self, metadata, *args, **kwargs):
        super().set_up_storage_reader(metadata, *args, **kwargs)
        entries = metadata.state_dict_metadata
        for index, info in metadata.storage_data.items():
            entry = entries.get(index.fqn)
            if isinstance(entry, TensorStorageMetadata):
                shape = next((tuple(c.sizes) for c in entry.chunks
                              if tuple(c.offsets) == tuple(index.offset or ())), None)
                self._chunks[id(info)] = (index.fqn, entry.properties.dtype, shape)

    def _slice_file(self, file, sinfo):
        self._reading = (f"{os.path.join(self.path, sinfo.relative_path)} bytes "
                         f"{sinfo.offset}..{sinfo.offset + sinfo.length}")
        self._chunk = self._chunks.get(id(sinfo))
        return super()._slice_file(file, sinfo)

    def _checked_narrow(self, tensor, offsets, lengths):
        """torch's ``narrow_tensor_by_index``, called by its reader on each chunk it has
        just loaded (before the copy into its target): the chunk checked first."""
        if self._chunk is not None:
            fqn, dtype, shape = self._chunk
            if tensor.dtype != dtype or (shape is not None and tuple(tensor.shape) != shape):
                raise CheckpointCorruptError(
                    f"{fqn!r} holds a {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
                    f"where .metadata records {dtype} of shape {shape}; {ADVICE}")
        return _narrow(tensor, offsets, lengths)

    def read_data(self, plan, planner):
        try:
            # the tensor chunks are read with weights_only=True: under torch's own
            # allowlist, not the one megatron.core widened; each is checked as it is read
            # (the reader looks the narrowing function up in its module at each call)
            with only_safe_globals(()), _narrowing(self._checked_narrow):
                return super().read_data(plan, planner)
        except MemoryError:
            raise
        except (UnsafeCheckpointError, CheckpointCorruptError) as exc:   # an object's bytes
            raise type(exc)(f"{self._reading}: {exc}") from None
        except pickle.UnpicklingError as exc:   # a tensor chunk's
            raise _unpickling_error(exc, self._reading) from None
        except Exception as exc:   # noqa: BLE001 - what the file holds is not what was saved
            raise CheckpointCorruptError(f"{self._reading} cannot be read ({_why(exc)}): the "
                                         f"checkpoint is corrupt; {ADVICE}") from exc

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(os.path.join(self.path, ".metadata"))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_narrow = dcp_filesystem.narrow_tensor_by_index


@contextlib.contextmanager
def _narrowing(function):
    """torch's DCP reader with ``function`` as its ``narrow_tensor_by_index`` (one load at
    a time: loads are collective)."""
    dcp_filesystem.narrow_tensor_by_index = function
    try:
        yield
    finally:
        dcp_filesystem.narrow_tensor_by_index = _narrow


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

    def load(self, sharded_state_dict, checkpoint_dir: Path, *args, **kwargs):
        # Megatron's load builds its reader and planner through these two module names;
        # point them at ours for this call (one load at a time: loads are collective).
        # (From 0.17 the load also takes an async strategy, which names the reader's class.)
        reader, planner = mcore_torch._get_filesystem_reader, mcore_torch.MCoreLoadPlanner
        mcore_torch._get_filesystem_reader = lambda path, *a, **k: _SafeReader(path)
        mcore_torch.MCoreLoadPlanner = _SafeLoadPlanner
        try:
            return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
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


COMMON_STATE_KEY = "common_state"   # megatron-core 0.17's ShardedObject of the common state


def load_common_state(checkpoint_dir) -> dict:
    """The checkpoint's common state (the flags, the iteration, ...) through ``load_plain``:
    ``common.pt`` where there is one (megatron-core 0.16's layout, and this project's
    saves), else the ShardedObject a megatron-core 0.17 save puts in the DCP files."""
    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    if os.path.lexists(path) or not os.path.lexists(os.path.join(checkpoint_dir, ".metadata")):
        with open_checkpoint_file(path) as f:
            common = load_plain(f, path)
    else:
        key = ShardedObject(COMMON_STATE_KEY, None, (1,), (0,)).unique_key
        path = f"{checkpoint_dir} ({key})"
        state = {key: io.BytesIO()}
        torch.distributed.checkpoint.load(state, storage_reader=_SafeReader(checkpoint_dir),
                                          planner=_SafeLoadPlanner(), no_dist=True)
        common = state[key]
        if isinstance(common, io.BytesIO):
            common.seek(0)
            common = load_plain(common, path)
        if isinstance(common, list) and len(common) == 1:   # what save_common wrote
            common = common[0]
    if type(common) is not dict:
        raise corrupt(path, f"it holds a {type(common).__name__}, not the dict a save writes")
    return common


def load(sharded_state_dict: dict, checkpoint_dir: str) -> dict:
    """Megatron's ``dist_checkpointing.load`` with the safe readers (module docstring)."""
    strategy = SafeTorchDistLoadStrategy()
    if not releases.imported().common_in_dcp:
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

        class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
            def load_common(self, checkpoint_dir):
                return load_common_state(checkpoint_dir)

        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir,
                                       sharded_strategy=strategy,
                                       common_strategy=SafeCommonLoadStrategy())
    original = serialization.load_common_state_dict
    serialization.load_common_state_dict = load_common_state
    try:
        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir,
                                       sharded_strategy=strategy)
    finally:
        serialization.load_common_state_dict = original
