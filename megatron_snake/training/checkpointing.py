"""--save / --load: the whole training state, written atomically, checksummed, and read
without running anything stored in it.

Layout (Megatron-LM's names): ``<save>/iter_0000005/mp_rank_00/model_optim_rng.pt``, its
checksum file ``model_optim_rng.pt.sha256.json`` beside it, and
``<save>/latest_checkpointed_iteration.txt``. An iteration directory is written under a
temporary name and renamed only when every file in it is complete (each file fsynced, each
rename made durable by an fsync of its directory), and the tracker file is replaced
atomically after that, so a crash or a full disk during a save leaves the previous checkpoint
valid; a failed save removes what it wrote.

What a save creates inside ``--save`` (iteration, rank and temporary directories, files,
the tracker) is made 0700 / 0600 without following symbolic links (``safe_files``); the
``--save`` directory itself is the user's choice and may be a link.

``--load`` checks each file's size and SHA-256 against its checksum file before parsing it,
then unpickles it with ``torch.load(weights_only=True)`` allowing nothing but tensors, plain
Python values and ``_SAFE_GLOBALS``: a checkpoint that holds any other object is refused, and
nothing in it is run. The writer holds the state to the same rule before it writes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import stat
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_snake.storage.errors import UnsafePathError
from megatron_snake.storage.safe_files import (create_file, fsync_dir, private_dir,
                                               write_file_atomically)

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "model_optim_rng.pt"
CHECKSUM_SUFFIX = ".sha256.json"   # <file>.sha256.json: {"bytes", "sha256", ...} of <file>
# 2: checksum files; the numpy RNG state stored as plain values (no numpy objects), so
# the file loads with weights_only=True and torch's own allowlist.
FORMAT_VERSION = 2
# Settings that must match between the run that saved and the run that loads.
MUST_MATCH = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "seq_length", "position_embedding_type",
              "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
              "bf16", "fp16")
# What the unpickler may construct beyond torch's own weights_only allowlist (tensors,
# storages, dtypes, torch.Size, torch.device, OrderedDict) and plain values (dict, list,
# tuple, str, bytes, int, float, bool, None). io.BytesIO: Transformer Engine layers
# (--transformer-impl transformer_engine) may keep their ``_extra_state`` in one; making a
# BytesIO runs nothing.
_SAFE_GLOBALS = (io.BytesIO,)
_PLAIN = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype,
          torch.device, torch.Size, torch.Tensor, torch.nn.Parameter, *_SAFE_GLOBALS)
_CONTAINERS = (dict, OrderedDict, list, tuple, set)
_WRITE_BUFFER = 1 << 20      # small writes of torch.save are gathered up to this size
_WRITE_CHUNK = 64 << 20      # one os.write at most


class CheckpointCorruptError(ValueError):
    """A checkpoint file is not the one that was saved (checksum or size mismatch, missing
    or unreadable checksum file). Names the file and what to do."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds objects other than tensors and plain values: refused
    without unpickling them."""


class CheckpointWriteError(OSError):
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


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


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
                    optimizer_state: dict, scheduler_state: dict, args) -> str:
    """Write the training state of this rank; returns the iteration directory."""
    final = _iter_dir(root, iteration)
    tmp = final + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharded = args.snake_offload  # each data-parallel rank holds its own optimizer shard
    writer = sharded or parallel_state.get_data_parallel_rank() == 0
    if rank == 0:
        with _failed_save(root, tmp, cleanup=tmp):
            if not os.path.isdir(root):
                os.makedirs(root, mode=0o700, exist_ok=True)
            _remove(tmp)  # a crashed earlier save of this iteration
            private_dir(tmp, what="checkpoint directory")
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
        rank_dir = os.path.join(tmp, _rank_dir_name(sharded))
        path = os.path.join(rank_dir, STATE_FILE)
        with _failed_save(root, path, cleanup=tmp if rank == 0 else rank_dir):
            _check_plain(state, "state")  # what --load would refuse is never written
            private_dir(rank_dir, what="checkpoint directory")
            _write_state(path, state)
    _barrier()
    if rank == 0:
        with _failed_save(root, final, cleanup=tmp):
            fsync_dir(tmp)        # the rank directories' entries
            _remove(final)        # an earlier save of this same iteration
            os.replace(tmp, final)
            fsync_dir(root)
        tracker = os.path.join(root, TRACKER)
        with _failed_save(root, tracker, cleanup=None):
            write_file_atomically(tracker, str(iteration).encode(), what="checkpoint tracker")
    _barrier()
    return final


def _write_state(path: str, state: dict) -> None:
    """``state`` to ``path`` (through ``path.part``, 0600, never through a link, fsynced)
    and its checksum file beside it; both renames made durable."""
    part = path + ".part"
    out = _ChecksummedWriter(create_file(part, what="checkpoint file"), part)
    try:
        torch.save(state, out)
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
def load_checkpoint(root: str, *, args) -> dict:
    """Read this rank's state from the latest checkpoint under ``root``, checked against
    the flags of this run. The caller applies its "model", "optimizer",
    "opt_param_scheduler" and "rng_state" entries."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(
            f"--load {root}: no {TRACKER} in it; is this a --save directory of megatron_snake?")
    with open(tracker, "rb") as f:
        text = f.read(64).decode("ascii", "replace").strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise ValueError(f"--load {root}: {tracker} holds {text!r}, not an iteration number "
                         f"(iterations {_iterations_here(root)})")
    iteration = int(text)
    path = os.path.join(_iter_dir(root, iteration), _rank_dir_name(args.snake_offload),
                        STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load {root}: checkpoint file {path} is missing")
    manifest = _read_checksum_file(root, path)
    with open(path, "rb") as f:
        _verify(root, path, f, manifest)
        f.seek(0)
        state = _unpickle(root, path, f)
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        version = state.get("format_version") if isinstance(state, dict) else None
        raise ValueError(f"--load {path}: format version {version} is not {FORMAT_VERSION}")
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


def _read_checksum_file(root: str, path: str) -> dict:
    checksum = path + CHECKSUM_SUFFIX
    if not os.path.isfile(checksum):
        raise CheckpointCorruptError(
            f"--load {root}: {path} has no checksum file {os.path.basename(checksum)} beside "
            f"it: checkpoints of format version {FORMAT_VERSION} carry one (format version 1, "
            "of an earlier megatron_snake, did not), or it was lost in a copy; restore it "
            f"from a copy or load an earlier iteration (iterations {_iterations_here(root)})")
    try:
        with open(checksum, "rb") as f:
            manifest = json.loads(f.read(1 << 16))
        ok = (isinstance(manifest, dict) and isinstance(manifest.get("bytes"), int)
              and re.fullmatch(r"[0-9a-f]{64}", str(manifest.get("sha256"))) is not None)
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise CheckpointCorruptError(
            f"--load {root}: checksum file {checksum} is corrupt (not the JSON a save "
            f"writes); restore it from a copy or load an earlier iteration "
            f"(iterations {_iterations_here(root)})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"--load {path}: format version {manifest.get('format_version')} is "
                         f"not {FORMAT_VERSION}")
    return manifest


def _verify(root: str, path: str, f, manifest: dict) -> None:
    size, expected = os.fstat(f.fileno()).st_size, manifest["bytes"]
    if size != expected:
        what = (f"truncated: {size} of {expected} bytes" if size < expected else
                f"{size} bytes, {expected} were written")
    elif _sha256(f) != manifest["sha256"]:
        what = "checksum mismatch: its SHA-256 is not the one written with it"
    else:
        return
    raise CheckpointCorruptError(
        f"--load {root}: {path} is corrupt ({what}); restore it from a copy or load an "
        f"earlier iteration (iterations {_iterations_here(root)})")


def _sha256(f) -> str:
    digest, buffer = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        digest.update(view[:n])
    return digest.hexdigest()


def _unpickle(root: str, path: str, f):
    """torch.load with weights_only=True and exactly ``_SAFE_GLOBALS`` beyond torch's own
    allowlist (the ones other libraries add process-wide are set aside meanwhile)."""
    others = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with torch.serialization.safe_globals(list(_SAFE_GLOBALS)):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        detail = (f"a reference to {found.group(1)}" if found else
                  text.split("WeightsUnpickler error: ")[-1].split("\n")[0][:200])
        raise UnsafeCheckpointError(
            f"--load {root}: refused {path}: it holds objects other than tensors and plain "
            f"values ({detail}), which a checkpoint of megatron_snake never does; nothing in "
            "it was run. Load only checkpoints you trust, from their own --save") from None
    except Exception as exc:  # noqa: BLE001 - any failure to parse a verified file
        raise CheckpointCorruptError(
            f"--load {root}: {path} matches its checksum but torch cannot read it ({exc}); "
            f"restore it from a copy or load an earlier iteration (iterations "
            f"{_iterations_here(root)})") from exc
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(others)


def _iterations_here(root: str) -> str:
    try:
        found = sorted(int(n[5:]) for n in os.listdir(root)
                       if re.fullmatch(r"iter_[0-9]{7}", n))
    except OSError:
        found = []
    if not found:
        return f"no iteration directory in {root}"
    return (f"saved in {root}: {', '.join(map(str, found))}; put the number of the one to "
            f"load in {TRACKER}")


def _barrier():
    if dist.is_initialized():
        dist.barrier()
