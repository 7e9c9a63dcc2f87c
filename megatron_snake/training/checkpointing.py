"""--save / --load: the whole training state, written atomically, checksummed, and read
without running anything stored in it.

Layout (Megatron-LM's names): ``<save>/iter_0000005/mp_rank_00/model_optim_rng.pt``, its
checksum file ``model_optim_rng.pt.sha256.json`` beside it, and
``<save>/latest_checkpointed_iteration.txt``. An iteration directory is written under a
temporary name and renamed only when every file in it is complete (each file fsynced, each
rename made durable by an fsync of its directory), and the tracker file is replaced
atomically after that, so a crash or a full disk during a save leaves the previous checkpoint
valid; a failed save removes what it wrote.

An offloaded run (``--snake-offload``) never holds its whole state in memory, and neither
does its checkpoint: ``model_optim_rng.pt`` holds the small part (iteration, flags,
scheduler, RNG, the optimizer's step count and hyper-parameters, the parameters and buffers
that stay resident, and the list of layouts), and each flat layout of the offloaded state
(a unit, or the shared parameters) has its own file ``unit_<key>.bin`` (with its checksum
file): this rank's shard of the layout's working weights, fp32 master weights and both
moments. A save reads one layout from its tier, writes its file and drops it before the
next; a load reads, verifies and puts back one file at a time. A unit file is not a pickle
but a JSON header and the raw bytes of its tensors (``_write_unit``): reading it runs
nothing and fills one buffer, no larger than the file, that its tensors are views of.

What a save creates inside ``--save`` (iteration, rank and temporary directories, files,
the tracker) is made 0700 / 0600 without following symbolic links (``safe_files``); the
``--save`` directory itself is the user's choice and may be a link.

``--load`` checks each file's size and SHA-256 against its checksum file before parsing it,
then unpickles the state file with ``torch.load(weights_only=True)`` allowing nothing but
tensors, plain Python values and ``_SAFE_GLOBALS``: a checkpoint that holds any other object
is refused, and nothing in it is run. The writer holds the state to the same rule before it
writes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import stat
import sys
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_snake.errors import UserError
from megatron_snake.offload.unit_weights import SavedUnitMismatch
from megatron_snake.storage.errors import UnsafePathError
from megatron_snake.storage.safe_files import (create_file, fsync_dir, private_dir,
                                               write_file_atomically)
from megatron_snake.training.checkpoint_dir import (TRACKER, Checkpoint, check_not_there,
                                                    describe_saved, iter_dir)

STATE_FILE = "model_optim_rng.pt"
CHECKSUM_SUFFIX = ".sha256.json"   # <file>.sha256.json: {"bytes", "sha256", ...} of <file>
UNIT_FILE = "unit_{}.bin"          # one offloaded layout's state (--snake-offload)
# 2: checksum files; the numpy RNG state stored as plain values (no numpy objects), so
# the file loads with weights_only=True and torch's own allowlist.
# 3: an offloaded run's layouts each in their own unit file, written and read one at a time.
FORMAT_VERSION = 3
# A unit file: UNIT_MAGIC, the header's length (8 bytes, little-endian), the JSON header
# (padded with spaces to a multiple of _ALIGN), then each tensor's bytes at its offset from
# there (multiples of _ALIGN, so every tensor is an aligned view of the file's buffer).
UNIT_MAGIC = b"SNAKEU03"
_ALIGN = 64
_UNIT_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
_READ_CHUNK = 64 << 20
# Settings that must match between the run that saved and the run that loads.
MUST_MATCH = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "seq_length", "position_embedding_type",
              "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "bf16", "fp16")
# Not in the list: the micro-batch and global batch sizes, which may change on resume as in
# Megatron-LM (the data goes on from the consumed samples; the learning-rate schedule,
# counted in samples, then differs and Megatron's scheduler refuses it unless
# --use-checkpoint-opt_param-scheduler or --override-opt_param-scheduler says which to keep).
# What the unpickler may construct beyond torch's own weights_only allowlist (tensors,
# storages, dtypes, torch.Size, torch.device, OrderedDict) and plain values (dict, list,
# tuple, str, bytes, int, float, bool, None). io.BytesIO: Transformer Engine layers
# (--transformer-impl transformer_engine) may keep their ``_extra_state`` in one; making a
# BytesIO runs nothing, and what TE later unpickles from it is checked first
# (extra_state.py).
_SAFE_GLOBALS = (io.BytesIO,)
_PLAIN = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype,
          torch.device, torch.Size, torch.Tensor, torch.nn.Parameter, *_SAFE_GLOBALS)
_CONTAINERS = (dict, OrderedDict, list, tuple, set)
_WRITE_BUFFER = 1 << 20      # small writes of torch.save are gathered up to this size
_WRITE_CHUNK = 64 << 20      # one os.write at most


class CheckpointCorruptError(UserError, ValueError):
    """A checkpoint file is not the one that was saved (checksum or size mismatch, missing
    or unreadable checksum file). Names the file and what to do."""


class UnsafeCheckpointError(UserError, ValueError):
    """A checkpoint file holds objects other than tensors and plain values: refused
    without unpickling them."""


class CheckpointWriteError(UserError, OSError):
    """A save failed in the file system (no space left, I/O error, ...). Names the path;
    the previous checkpoint and the tracker are unchanged."""

    def __init__(self, errno_, message, filename=None):
        super().__init__(errno_, message)
        self.message, self.filename = message, filename

    def __str__(self):
        return self.message


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


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "random": random.getstate(),
        # plain values: an ndarray would need numpy's reconstructors in the allowlist
        "numpy": (str(name), [int(k) for k in keys], int(pos), int(has_gauss),
                  float(cached_gaussian)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": dict(get_cuda_rng_tracker().get_states()),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                         cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))


# --- saving ------------------------------------------------------------------------------
def save_checkpoint(root: str, *, iteration: int, consumed_samples: int, model_state: dict,
                    optimizer_state: dict, scheduler_state: dict, args,
                    units: dict[object, Callable[[], dict]] | None = None) -> str:
    """Write the training state of this rank; returns the iteration directory.

    ``units`` (an offloaded run): {layout key: a function that reads that layout's state},
    for the state too large to hold at once; ``model_state`` and ``optimizer_state`` then
    hold the rest. Each function is called after the state file is written, its result
    (tensors and plain JSON values, ``_write_unit``) written to ``unit_<key>.bin`` and
    dropped before the next is called: the save holds one layout at a time."""
    tmp = begin_iteration_dir(root, iteration)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharded = args.snake_offload  # each data-parallel rank holds its own optimizer shard
    writer = sharded or parallel_state.get_data_parallel_rank() == 0
    units = units or {}
    if writer:
        state = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "args": {k: getattr(args, k) for k in MUST_MATCH},
            "snake": {"offload": args.snake_offload,
                      "checkpoint_interval": args.snake_checkpoint_interval,
                      "schedule": args.snake_schedule,
                      "alpha": args.snake_alpha,
                      # the dtype each optimizer state was stored in (the unit files hold
                      # Megatron's checkpoint form: fp32 moments, fp32 or int16 masters)
                      "precision": optimizer_precision(args)},
            "model": model_state,
            "optimizer": None if args.no_save_optim else optimizer_state,
            "opt_param_scheduler": scheduler_state,
            "rng_state": None if args.no_save_rng else rng_state(),
            "units": list(units),   # the unit files of this rank, in the order written
        }
        rank_dir = os.path.join(tmp, _rank_dir_name(sharded))
        path = os.path.join(rank_dir, STATE_FILE)
        cleanup = tmp if rank == 0 else rank_dir
        with _failed_save(root, path, cleanup=cleanup):
            _check_plain(state, "state")  # what --load would refuse is never written
            for key in units:
                _check_unit_key(key)
            private_dir(rank_dir, what="checkpoint directory")
            _write_state(path, state)
        for key, read in units.items():
            unit_path = os.path.join(rank_dir, UNIT_FILE.format(key))
            try:
                entry = read()   # this layout only, read from its tier
            except BaseException:
                with contextlib.suppress(OSError):
                    _remove(cleanup)
                raise
            with _failed_save(root, unit_path, cleanup=cleanup):
                _write_unit(unit_path, key, entry)
            del entry            # before the next layout is read
    return publish_iteration_dir(root, iteration)


def begin_iteration_dir(root: str, iteration: int) -> str:
    """Rank 0 makes ``iter_<iteration>.tmp`` (0700, a crashed earlier attempt removed) under
    ``root``; every rank waits for it. Returns its path. Both formats write into it."""
    check_not_there(root, iteration)   # on every rank, so that all of them stop
    tmp = iter_dir(root, iteration) + ".tmp"
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        with _failed_save(root, tmp, cleanup=tmp):
            if not os.path.isdir(root):
                os.makedirs(root, mode=0o700, exist_ok=True)
            _remove(tmp)  # a crashed earlier save of this iteration
            private_dir(tmp, what="checkpoint directory")
    _barrier()
    return tmp


def publish_iteration_dir(root: str, iteration: int) -> str:
    """Once every rank has written into ``begin_iteration_dir``'s directory: rank 0 renames
    it to ``iter_<iteration>`` and then replaces the tracker, each step durable. Returns
    the final path."""
    final = iter_dir(root, iteration)
    tmp = final + ".tmp"
    _barrier()
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        with _failed_save(root, final, cleanup=tmp):
            fsync_dir(tmp)        # the rank directories' entries
            os.replace(tmp, final)   # begin_iteration_dir made sure nothing is there
            fsync_dir(root)
        tracker = os.path.join(root, TRACKER)
        with _failed_save(root, tracker, cleanup=None):
            write_file_atomically(tracker, str(iteration).encode(), what="checkpoint tracker")
    _barrier()
    return final


def _write_state(path: str, state: dict) -> None:
    """``state`` to ``path`` with torch.save (see ``_write_checksummed``)."""
    _write_checksummed(path, lambda out: torch.save(state, out))


def _write_checksummed(path: str, write: Callable[["_ChecksummedWriter"], None]) -> None:
    """What ``write`` writes to the file object it is given, to ``path`` (through
    ``path.part``, 0600, never through a link, fsynced), and its checksum file beside it;
    both renames made durable."""
    part = path + ".part"
    out = _ChecksummedWriter(create_file(part, what="checkpoint file"), part)
    try:
        write(out)
        out.close()
    except BaseException as exc:
        out.abort()
        _unlink(part)
        if out.error is not None and out.error is not exc:
            raise out.error from None  # the file system's error, not torch's echo of it
        raise
    os.replace(part, path)
    manifest = {"format_version": FORMAT_VERSION, "file": os.path.basename(path),
                "bytes": out.size, "sha256": out.sha256.hexdigest()}
    # also fsyncs the directory, after both renames
    write_file_atomically(path + CHECKSUM_SUFFIX, (json.dumps(manifest) + "\n").encode(),
                          what="checkpoint checksum file")


def _check_unit_key(key) -> None:
    """A layout key names a file: a unit index or a plain word, nothing a path is made of."""
    if not (type(key) is int and key >= 0 or
            type(key) is str and re.fullmatch(r"[A-Za-z0-9_]{1,64}", key)):
        raise ValueError(f"checkpoint unit key {key!r} is not a unit index or a plain word")


def _write_unit(path: str, key, entry: dict) -> None:
    """One layout's ``entry`` to ``path``: its tensors as raw bytes after a JSON header that
    says where each is (name, dtype, shape, offset, bytes), its other values in the header
    under "meta" (plain JSON values); checksummed like the state file."""
    tensors = {name: value.detach() for name, value in entry.items() if torch.is_tensor(value)}
    meta = {name: value for name, value in entry.items() if not torch.is_tensor(value)}
    index, offset = [], 0
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _UNIT_DTYPES or tensor.layout != torch.strided:
            raise TypeError(f"checkpoint unit {key!r} entry {name!r} is a {tensor.dtype} "
                            f"{tensor.layout} tensor; a unit file holds dense tensors of "
                            f"{', '.join(_UNIT_DTYPES)}")
        nbytes = tensor.numel() * tensor.element_size()
        index.append({"name": name, "dtype": dtype, "shape": list(tensor.shape),
                      "offset": offset, "bytes": nbytes})
        offset += -(-nbytes // _ALIGN) * _ALIGN
    try:
        header = json.dumps({"format_version": FORMAT_VERSION, "layout": key,
                             "byteorder": sys.byteorder, "meta": meta, "tensors": index},
                            allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint unit {key!r}: its values other than tensors must be "
                        f"plain JSON values ({exc})") from None
    start = len(UNIT_MAGIC) + 8 + len(header)
    header += b" " * (-start % _ALIGN)

    def write(out):
        out.write(UNIT_MAGIC + len(header).to_bytes(8, "little") + header)
        written = 0
        for item, tensor in zip(index, tensors.values()):
            out.write(bytes(item["offset"] - written))   # the padding before it
            if item["bytes"]:
                raw = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
                out.write(raw.numpy())
            written = item["offset"] + item["bytes"]

    _write_checksummed(path, write)


class _ChecksummedWriter:
    """The write-only file object torch.save writes to: every byte goes to ``fd`` through
    ``os.write`` (so a full disk is an OSError with its errno and this path, not a C++
    stream error) and into a SHA-256 and a byte count."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path
        self.sha256, self.size = hashlib.sha256(), 0
        self.buffer = bytearray()
        self.error: OSError | None = None

    def write(self, data) -> int:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        n = view.nbytes
        if len(self.buffer) + n <= _WRITE_BUFFER:
            self.buffer += view
            return n
        self.flush()
        if n < _WRITE_BUFFER:
            self.buffer += view
        else:
            self._write_all(view)
        return n

    def flush(self) -> None:
        if self.error is not None:
            raise self.error
        if self.buffer:
            pending, self.buffer = self.buffer, bytearray()
            self._write_all(memoryview(pending))

    def _write_all(self, view: memoryview) -> None:
        offset = 0
        try:
            while offset < len(view):
                chunk = view[offset:offset + _WRITE_CHUNK]
                written = os.write(self.fd, chunk)
                if written <= 0:
                    raise OSError(errno.EIO, f"write returned {written}")
                self.sha256.update(chunk[:written])
                self.size += written
                offset += written
        except OSError as exc:
            self._fail(exc)

    def close(self) -> None:
        self.flush()
        try:
            os.fsync(self.fd)
        except OSError as exc:
            self._fail(exc)
        fd, self.fd = self.fd, -1
        os.close(fd)

    def abort(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def _fail(self, exc: OSError):
        if exc.filename is None:
            exc = OSError(exc.errno, exc.strerror or str(exc), self.path)
        self.error = exc
        raise exc


def _check_plain(value, where: str) -> None:
    """Refuse (before writing) a state that ``--load`` would refuse: anything but tensors,
    plain values and _SAFE_GLOBALS. Exact types: a subclass (numpy.float64 is a float, a
    namedtuple a tuple) pickles as a reference to its class, which the loader refuses."""
    kind = type(value)
    if kind in _PLAIN:
        return
    if kind in _CONTAINERS:
        items = value.items() if kind in (dict, OrderedDict) else enumerate(value)
        for key, item in items:
            if type(key) not in _PLAIN:
                raise TypeError(f"checkpoint entry {where} has a key of type "
                                f"{type(key).__qualname__}; keys must be plain values")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"checkpoint entry {where} is a {kind.__module__}.{kind.__qualname__}; a checkpoint "
        "holds only tensors and plain Python values (so that --load never runs code stored "
        "in a file): convert it to those in its state_dict")


@contextlib.contextmanager
def _failed_save(root: str, path: str, *, cleanup: str | None):
    """On an error: remove ``cleanup`` (this save's partial files), and raise a file
    system error again as one CheckpointWriteError naming the path and what to do."""
    try:
        yield
    except BaseException as exc:
        if cleanup is not None:
            with contextlib.suppress(OSError):
                _remove(cleanup)
        if isinstance(exc, (UnsafePathError, CheckpointWriteError)) or \
                not isinstance(exc, (OSError, RuntimeError)):
            raise
        raise _write_error(root, path, exc) from exc


def _write_error(root: str, path: str, exc: BaseException) -> CheckpointWriteError:
    code = getattr(exc, "errno", None)
    where = getattr(exc, "filename", None) or path
    if code == errno.ENOSPC or "no space left on device" in str(exc).lower():
        code = errno.ENOSPC
        reason = "no space left on device (ENOSPC)"
        advice = ("free space on that file system, or give --save a directory with room "
                  "for one more checkpoint")
    elif code == getattr(errno, "EDQUOT", None):
        reason = "disk quota exceeded (EDQUOT)"
        advice = "raise the quota, free space, or give --save another directory"
    else:
        reason = (f"{exc.strerror} (errno {code})" if isinstance(exc, OSError) and
                  exc.strerror else str(exc))
        advice = "check that the file system of --save is mounted, writable and healthy"
    return CheckpointWriteError(
        code, f"--save {root}: writing the checkpoint failed at {where}: {reason}. The "
        f"partial files were removed; the previous checkpoint and {TRACKER} are unchanged "
        f"(--load {root} resumes from it). {advice[0].upper()}{advice[1:]}", where)


def _remove(path: str) -> None:
    """Delete the entry ``path`` without following a link: a link (or file) is unlinked,
    a directory of this user removed with what is in it (shutil.rmtree does not follow
    links below it); another user's directory is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _unlink(path)
        return
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"checkpoint directory {path} is owned by uid {st.st_uid}, not "
                              f"by this user (uid {os.geteuid()}); remove it or choose "
                              "another --save directory")
    shutil.rmtree(path)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# --- loading -----------------------------------------------------------------------------
class CheckpointMismatchError(UserError, ValueError):
    """An intact checkpoint that does not fit this run: other settings, another parallel
    layout or unit partition, or a part this run would take that it does not hold."""


def check_saved_iteration(root: str, folder: str, expected: int, saved) -> int:
    """The iteration stored inside the checkpoint ``folder`` must be the one its tracker and
    its directory name say (``expected``): a directory copied, renamed or linked from
    another run is refused, in both formats. Returns it."""
    if type(saved) is not int or saved != expected:
        raise CheckpointCorruptError(
            f"--load {root}: {folder} holds iteration {saved!r}, but {TRACKER} and the "
            f"directory's name say {expected}: it was copied, renamed or linked from another "
            f"checkpoint; restore it from a copy or load another iteration "
            f"({describe_saved(root)})")
    return saved


# The state file's entries and their types (plain values: the unpickler allowed nothing
# else); anything else is refused before a value is used.
_STATE_ENTRIES = {"format_version": int, "iteration": int, "consumed_samples": int,
                  "args": dict, "snake": dict, "model": dict, "optimizer": (dict, type(None)),
                  "opt_param_scheduler": dict, "rng_state": (dict, type(None)), "units": list}
_SNAKE_ENTRIES = {"offload": bool, "checkpoint_interval": int, "schedule": str,
                  "alpha": (int, float, type(None))}


def _check_state(root: str, path: str, state) -> None:
    if not isinstance(state, dict):
        raise _corrupt(root, path, f"it holds a {type(state).__name__}, not a state")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatchError(f"--load {path}: format version "
                                      f"{state.get('format_version')} is not {FORMAT_VERSION}")
    for entries, where in ((_STATE_ENTRIES, state), (_SNAKE_ENTRIES, state.get("snake"))):
        for name, kind in entries.items():
            if not isinstance(where.get(name), kind) or isinstance(where.get(name), bool) \
                    and kind is int:
                raise _corrupt(root, path, f"its entry {name!r} is "
                               f"{type(where.get(name)).__name__}, not what a save writes")
    if state["consumed_samples"] < 0:
        raise _corrupt(root, path, f"consumed_samples is {state['consumed_samples']}")


def load_checkpoint(checkpoint: Checkpoint, *, args, optimizer: bool = True) -> dict:
    """Read this rank's state from ``checkpoint`` (a torch-format iteration directory),
    checked against the flags of this run (``optimizer``: whether its optimizer state will
    be taken). The caller applies its "model", "optimizer", "opt_param_scheduler" and
    "rng_state" entries."""
    root, folder = checkpoint.root, checkpoint.folder
    path = os.path.join(folder, _rank_dir_name(args.snake_offload), STATE_FILE)
    if not os.path.isfile(path):
        differs = _saved_layout_differs(folder, args)
        if differs:
            raise CheckpointMismatchError(f"--load {root}: checkpoint file {path} is "
                                          f"missing{differs}")
        raise CheckpointCorruptError(f"--load {root}: checkpoint file {path} is missing; "
                                     f"restore it from a copy or load an earlier iteration "
                                     f"({describe_saved(root)})")
    manifest = _read_checksum_file(root, path)
    with _open_saved(root, path) as f:
        _verify(root, path, f, manifest)
        f.seek(0)
        state = _unpickle(root, path, f)
    _check_state(root, path, state)
    check_saved_iteration(root, folder, checkpoint.iteration, state["iteration"])
    refuse_other_settings(root, state["args"], args, keys=tuple(state["args"]))
    if optimizer and state["optimizer"] is None:
        raise CheckpointMismatchError(
            f"--load {root}: the checkpoint was saved with --no-save-optim and holds no "
            "optimizer state; pass --no-load-optim (or --finetune)")
    if optimizer and state["snake"]["offload"] != args.snake_offload:
        raise CheckpointMismatchError(
            f"--load {root}: the optimizer state was saved "
            f"{'with' if state['snake']['offload'] else 'without'} --snake-offload; load it "
            "the same way, or pass --no-load-optim to take only the weights")
    if optimizer and state["snake"]["offload"]:
        _refuse_other_precision(root, state["snake"].get("precision"), args)
    for key in state["units"]:  # all there before anything is loaded (each verified later)
        unit_path = _unit_path(root, os.path.dirname(path), key)
        if not os.path.isfile(unit_path):
            raise CheckpointCorruptError(
                f"--load {root}: {unit_path} is missing ({os.path.basename(path)} lists it); "
                "restore it from a copy or load an earlier iteration "
                f"({describe_saved(root)})")
        _read_checksum_file(root, unit_path)
    return state


def optimizer_precision(args) -> dict:
    """{state: dtype name} of the offloaded optimizer's stored states (fp32 without
    --use-precision-aware-optimizer), as the state file records them."""
    from megatron_snake.optim.precision import Precision

    precision = Precision.from_args(args)
    return {name: str(precision.dtype(name)).removeprefix("torch.")
            for name in ("master", "exp_avg", "exp_avg_sq", "grad")}


def _refuse_other_precision(root: str, saved, args) -> None:
    """The torch format loads optimizer state into the precision it was saved with (a
    state file without the entry is fp32's): another is refused, naming the flags;
    torch_dist converts between them."""
    saved = saved if isinstance(saved, dict) else {
        name: "float32" for name in ("master", "exp_avg", "exp_avg_sq", "grad")}
    here = optimizer_precision(args)
    differ = [name for name in ("master", "exp_avg", "exp_avg_sq") if saved.get(name) !=
              here[name]]
    if differ:
        shown = ", ".join(f"{n} saved {saved.get(n)} now {here[n]}" for n in differ)
        raise CheckpointMismatchError(
            f"--load {root}: the optimizer state was saved with other precision-aware "
            f"optimizer settings ({shown}: --use-precision-aware-optimizer, "
            "--main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype); load it with the "
            "flags it was saved with, or save it with --ckpt-format torch_dist, whose load "
            "converts between them")


def refuse_other_settings(root: str, saved: dict, args, *, keys=MUST_MATCH) -> None:
    """Refuse a checkpoint whose ``keys`` flags in ``saved`` differ from this run's, naming
    each (both formats check their saved flags with this)."""
    here = vars(args)
    differ = [f"--{k.replace('_', '-')} saved {_setting(saved, k)!r} now {_setting(here, k)!r}"
              for k in keys if _setting(saved, k) != _setting(here, k)]
    if differ:
        raise CheckpointMismatchError(f"--load {root}: the checkpoint was saved with other "
                                      "settings: " + ", ".join(differ))


def _setting(flags: dict, key: str):
    """A flag's value as the model uses it: without --group-query-attention every head is
    its own group, whatever --num-query-groups says (Megatron-LM sets it to the head count
    only when it first counts FLOPs, so its saved and fresh flags differ there)."""
    if key == "num_query_groups" and flags.get("group_query_attention") is False:
        return flags.get("num_attention_heads")
    return flags.get(key)


def load_units(root: str, state: dict, apply: Callable[[object, dict], None], *,
               args) -> None:
    """``apply(key, entry)`` for each unit file of the checkpoint ``state`` (from
    ``load_checkpoint``), in the order they were written, one at a time: each file is read
    into one buffer while its SHA-256 is computed, checked against its checksum file, and
    only then parsed; ``entry`` holds what the save wrote (tensors, views of that buffer,
    and the plain values) and is dropped before the next file is read."""
    rank_dir = _rank_path(root, state["iteration"], args)
    for key in state["units"]:
        path = _unit_path(root, rank_dir, key)
        entry = _read_unit(root, path, key)
        try:
            apply(key, entry)
        except SavedUnitMismatch as exc:
            raise CheckpointMismatchError(
                f"--load {root}: {path} does not fit this run: {exc}; is it a checkpoint of "
                "this model, saved with these flags?") from None
        del entry


def full_model_state(root: str, state: dict, *, args) -> dict:
    """The whole ``state_dict()`` of the checkpointed model, for a run that holds its model
    in memory (without --snake-offload, after --no-load-optim): the state file's model
    entries and, when the layouts have their own files, each parameter's weights from
    them."""
    model = dict(state["model"])

    def add(key, entry):
        if "weights" not in entry:   # the shared layout's weights are in the state file
            return
        if entry.get("shard") != [0, entry.get("numel")]:
            raise CheckpointMismatchError(
                f"--load {root}: unit {key} holds elements {entry.get('shard')} of "
                f"{entry.get('numel')} (a data-parallel shard); load it with --snake-offload "
                "and the same data-parallel size")
        weights = entry["weights"]
        segments = entry.get("segments")
        if not (weights.dim() == 1 and weights.numel() == entry["numel"] and
                isinstance(segments, list) and all(_is_segment(s, entry["numel"])
                                                   for s in segments)):
            raise SavedUnitMismatch(f"unit {key}'s weights ({list(weights.shape)}) and "
                                    f"parameters are not those of a unit of {entry['numel']} "
                                    "elements")
        weights = weights.clone()   # not a view of the whole file
        for name, shape, offset, numel in segments:
            model[name] = weights[offset:offset + numel].view(shape)

    load_units(root, state, add, args=args)
    return model


def _is_segment(segment, numel: int) -> bool:
    """[name, shape, offset, numel] of one parameter inside a layout of ``numel`` elements."""
    if not (isinstance(segment, list) and len(segment) == 4):
        return False
    name, shape, offset, count = segment
    return (isinstance(name, str) and isinstance(shape, list) and
            all(type(n) is int and n >= 0 for n in [*shape, offset, count]) and
            math.prod(shape) == count and offset + count <= numel)


def _saved_layout_differs(folder: str, args) -> str:
    """Which parallel setting the rank directories under ``folder`` say the checkpoint was
    saved with, where it differs from this run's (or "" when they agree)."""
    saved = {"tensor-model-parallel-size": set(), "pipeline-model-parallel-size": set(),
             "data-parallel shards": set()}
    try:
        names = os.listdir(folder)
    except OSError:
        return ""
    for name in names:
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_dp(\d{3}))?", name)
        if m:
            for key, index in zip(saved, m.groups()):
                saved[key].add(int(index or 0))
    if not saved["tensor-model-parallel-size"]:
        return ""
    sharded = args.snake_offload and args.data_parallel_size > 1
    here = {"tensor-model-parallel-size": args.tensor_model_parallel_size,
            "pipeline-model-parallel-size": args.pipeline_model_parallel_size,
            "data-parallel shards": args.data_parallel_size if sharded else 1}
    differ = [f"{key} {max(ranks) + 1} there, {here[key]} here" for key, ranks in saved.items()
              if max(ranks) + 1 != here[key]]
    if not differ:
        return ""
    return (f". The checkpoint was saved with another parallel layout: {'; '.join(differ)} "
            "(data-parallel shards: an offloaded run with DP > 1 saves its optimizer state "
            "sharded). Load it with the layout it was saved with")


def _rank_path(root: str, iteration: int, args) -> str:
    return os.path.join(iter_dir(root, iteration), _rank_dir_name(args.snake_offload))


def _unit_path(root: str, rank_dir: str, key) -> str:
    try:
        _check_unit_key(key)
    except ValueError as exc:
        raise CheckpointCorruptError(f"--load {root}: {exc}") from None
    return os.path.join(rank_dir, UNIT_FILE.format(key))


def _read_unit(root: str, path: str, key) -> dict:
    """A unit file, verified, then parsed (``_write_unit``'s layout)."""
    if not os.path.isfile(path):
        raise CheckpointCorruptError(
            f"--load {root}: {path} is missing; restore it from a copy or load an earlier "
            f"iteration ({describe_saved(root)})")
    manifest = _read_checksum_file(root, path)
    with _open_saved(root, path) as f:
        size = os.fstat(f.fileno()).st_size
        _check_size(root, path, size, manifest["bytes"])
        buffer = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        digest, done = hashlib.sha256(), 0
        while done < size:
            n = f.readinto(view[done:done + _READ_CHUNK])
            if not n:
                break
            digest.update(view[done:done + n])
            done += n
    if done != size or digest.hexdigest() != manifest["sha256"]:
        raise _corrupt(root, path, "checksum mismatch: its SHA-256 is not the one written "
                       "with it")
    try:
        return _parse_unit(buffer, key)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError,
            OverflowError) as exc:
        raise CheckpointCorruptError(
            f"--load {root}: {path} matches its checksum but is not a unit file of "
            f"megatron_snake ({exc}); restore it from a copy or load an earlier iteration "
            f"({describe_saved(root)})") from None


def _parse_unit(buffer: torch.Tensor, key) -> dict:
    head = len(UNIT_MAGIC) + 8
    if buffer.numel() < head or bytes(buffer[:len(UNIT_MAGIC)].numpy()) != UNIT_MAGIC:
        raise ValueError("no unit file header")
    length = int.from_bytes(bytes(buffer[len(UNIT_MAGIC):head].numpy()), "little")
    if length > buffer.numel() - head:
        raise ValueError(f"a header of {length} bytes")
    header = json.loads(bytes(buffer[head:head + length].numpy()))
    if not (isinstance(header, dict) and isinstance(header.get("meta"), dict) and
            isinstance(header.get("tensors"), list)):
        raise ValueError("its header is not a unit file's")
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format version {header.get('format_version')}, not "
                         f"{FORMAT_VERSION}")
    if header.get("layout") != key:
        raise ValueError(f"it holds unit {header.get('layout')!r}, not {key!r}")
    if header.get("byteorder") != sys.byteorder:
        raise ValueError(f"written on a {header.get('byteorder')}-endian machine")
    entry = dict(header["meta"])
    data = head + length
    for item in header["tensors"]:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and
                re.fullmatch(r"[A-Za-z0-9_]{1,64}", item["name"]) and
                item["name"] not in entry and item.get("dtype") in _UNIT_DTYPES):
            raise ValueError(f"an entry {str(item)[:80]!r} is not a named tensor record")
        dtype = _UNIT_DTYPES[item["dtype"]]
        shape, offset, nbytes = item["shape"], item["offset"], item["bytes"]
        if not (all(type(n) is int and n >= 0 for n in [*shape, offset, nbytes]) and
                math.prod(shape) * dtype.itemsize == nbytes and (data + offset) % _ALIGN == 0 and
                data + offset + nbytes <= buffer.numel()):
            raise ValueError(f"entry {item.get('name')!r} does not fit the file")
        raw = buffer[data + offset:data + offset + nbytes]
        entry[item["name"]] = raw.view(dtype).view(shape)
    return entry


def _read_checksum_file(root: str, path: str) -> dict:
    checksum = path + CHECKSUM_SUFFIX
    if not os.path.isfile(checksum):
        raise CheckpointCorruptError(
            f"--load {root}: {path} has no checksum file {os.path.basename(checksum)} beside "
            f"it: checkpoints of format version {FORMAT_VERSION} carry one (format version 1, "
            "of an earlier megatron_snake, did not), or it was lost in a copy; restore it "
            f"from a copy or load an earlier iteration ({describe_saved(root)})")
    try:
        with _open_saved(root, checksum) as f:
            manifest = json.loads(f.read(1 << 16))
        ok = (isinstance(manifest, dict) and isinstance(manifest.get("bytes"), int)
              and re.fullmatch(r"[0-9a-f]{64}", str(manifest.get("sha256"))) is not None)
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise CheckpointCorruptError(
            f"--load {root}: checksum file {checksum} is corrupt (not the JSON a save "
            f"writes); restore it from a copy or load an earlier iteration "
            f"({describe_saved(root)})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"--load {path}: format version {manifest.get('format_version')} is not "
            f"{FORMAT_VERSION}")
    return manifest


def _open_saved(root: str, path: str):
    """``path`` opened for reading as the regular file a save made: never through a link,
    never a FIFO or device (which could block the run or feed it without end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                     getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _corrupt(root, path, "a symbolic link, not followed" if exc.errno == errno.ELOOP
                       else f"cannot be opened: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _corrupt(root, path, "not a regular file")
    return os.fdopen(fd, "rb")


def _verify(root: str, path: str, f, manifest: dict) -> None:
    _check_size(root, path, os.fstat(f.fileno()).st_size, manifest["bytes"])
    if _sha256(f) != manifest["sha256"]:
        raise _corrupt(root, path, "checksum mismatch: its SHA-256 is not the one written "
                       "with it")


def _check_size(root: str, path: str, size: int, expected: int) -> None:
    if size != expected:
        raise _corrupt(root, path, f"truncated: {size} of {expected} bytes" if size < expected
                       else f"{size} bytes, {expected} were written")


def _corrupt(root: str, path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"--load {root}: {path} is corrupt ({what}); restore it from a copy or load an "
        f"earlier iteration ({describe_saved(root)})")


def _sha256(f) -> str:
    digest, buffer = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        digest.update(view[:n])
    return digest.hexdigest()


def refused_object(exc: pickle.UnpicklingError) -> str:
    """What torch's weights_only unpickler refused, from its error (whose text also
    suggests weights_only=False, which must never reach a user as advice)."""
    text = str(exc)
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text)
    if found:
        return f"a reference to {found.group(1)}"
    # the line that names the problem, never torch's first line of advice
    lines = [line.strip() for line in text.split("WeightsUnpickler error: ")[-1].splitlines()
             if line.strip() and "weights_only" not in line]
    return (lines[0] if lines else "an object torch's safe loader does not allow")[:200]


@contextlib.contextmanager
def only_safe_globals(allowed):
    """torch.load(weights_only=True) allows torch's own types and exactly ``allowed``
    meanwhile: what other libraries add process-wide (megatron.core adds some thirty
    classes) is set aside and put back after."""
    others = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with torch.serialization.safe_globals(list(allowed)):
            yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(others)


def _unpickle(root: str, path: str, f):
    """torch.load with weights_only=True and exactly ``_SAFE_GLOBALS`` beyond torch's own
    allowlist."""
    try:
        with only_safe_globals(_SAFE_GLOBALS):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = refused_object(exc)
        raise UnsafeCheckpointError(
            f"--load {root}: refused {path}: it holds objects other than tensors and plain "
            f"values ({detail}), which a checkpoint of megatron_snake never does; nothing in "
            "it was run. Load only checkpoints you trust, from their own --save") from None
    except Exception as exc:  # noqa: BLE001 - any failure to parse a verified file
        raise CheckpointCorruptError(
            f"--load {root}: {path} matches its checksum but torch cannot read it ({exc}); "
            f"restore it from a copy or load an earlier iteration ({describe_saved(root)})"
        ) from exc


def _barrier():
    if dist.is_initialized():
        dist.barrier()
