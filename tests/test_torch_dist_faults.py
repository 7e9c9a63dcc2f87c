"""--ckpt-format torch_dist --load of a broken or hostile checkpoint: every file the checkpoint
names is a regular file of its own iteration directory, opened without following a link,
and holds every byte range ``.metadata`` names, checked before anything is read (a FIFO
would block --load forever, /dev/zero would be read for gigabytes); a truncated, empty or
garbage file is one line naming it and what to do; an iteration directory copied from
another iteration is refused; the save writes no file through a link planted in its way."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from conftest import checkpoint_flags
from megatron_snake.training import torch_dist
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.checkpoint_dir import CheckpointChoiceError
from megatron_snake.training.checkpointing import CheckpointCorruptError, UnsafeCheckpointError
from megatron_snake.training.loop import pretrain

FLAGS = checkpoint_flags("torch_dist")
ITER = "iter_0000002"
DATA = "__0_0.distcp"
ADVICE = "restore it from a copy or load an earlier iteration"


@pytest.fixture(scope="module")
def saved_format():
    """The format of ``saved`` (conftest): a real checkpoint of iteration 2 of FLAGS."""
    return "torch_dist"


def _copy(saved, tmp_path):
    """A copy of the saved checkpoint to break: (root, its iteration directory)."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return str(root), root / ITER


def _load(root: str):
    return pretrain(parse_args([*FLAGS, "--load", root]))


def _refused(root: str, error, *named) -> str:
    """--load ``root`` fails with one ``error`` whose message is one line naming each of
    ``named``; returns the message."""
    with pytest.raises(error) as caught:
        _load(root)
    message = str(caught.value)
    assert "\n" not in message, message
    for name in named:
        assert str(name) in message, message
    return message


def _edit_metadata(folder, change) -> None:
    """``change(metadata)`` on the ``.metadata`` in ``folder`` (the test's own file)."""
    path = folder / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _object_entry(metadata):
    """The storage entry of the RNG state: a ShardedObject, read whole, as bytes (the
    layers' empty _extra_state objects are not read)."""
    return next(info for index, info in metadata.storage_data.items()
                if index.fqn.startswith(torch_dist.RNG_KEY))


# --- what .metadata names ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["../" + DATA, "sub/" + DATA, "absolute", "common.pt",
                                  "/dev/zero"])
def test_a_data_file_outside_the_iteration_directory_is_refused(saved, tmp_path, name):
    """A copy of the real data file at each of those places: it would load, but a
    checkpoint's data is only in its own directory's .distcp files."""
    root, folder = _copy(saved, tmp_path)
    if name == "absolute":
        name = str(tmp_path / DATA)
    if not name.startswith("/dev/") and name != "common.pt":
        os.makedirs(os.path.dirname(folder / name), exist_ok=True)
        shutil.copy(folder / DATA, folder / name)

    def point_elsewhere(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = name

    _edit_metadata(folder, point_elsewhere)
    message = _refused(root, UnsafeCheckpointError, folder / ".metadata", repr(name))
    assert "nothing was read" in message


def test_dev_zero_with_a_3_gib_length_is_refused_before_a_byte_is_read(saved, tmp_path):
    """Read, it would take 3 GiB of memory before anything failed; the peak RSS of the
    refused --load stays within 200 MB of a good load's (measured in a process of its
    own)."""
    root, folder = _copy(saved, tmp_path)

    def dev_zero(metadata):
        info = _object_entry(metadata)
        info.relative_path, info.offset, info.length = "/dev/zero", 0, 3 << 30

    _edit_metadata(folder, dev_zero)
    code = """
import resource, sys, warnings
warnings.filterwarnings("ignore")
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain
good, broken, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
pretrain(parse_args([*flags, "--load", good]))   # the peak of a whole load and two steps
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    pretrain(parse_args([*flags, "--load", broken]))
except Exception as exc:
    print("refused:", type(exc).__name__, exc)
print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code, str(saved), root, *FLAGS],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = int(proc.stdout.rsplit("grew_kib", 1)[1])
    assert grew < 200 << 10, f"peak RSS grew by {grew >> 10} MiB"
    assert "refused: UnsafeCheckpointError" in proc.stdout, proc.stdout[-3000:]
    assert "'/dev/zero'" in proc.stdout, proc.stdout[-3000:]


def _load_in_a_thread(root: str, fifo, seconds: float = 60):
    """--load ``root`` in a thread, given ``seconds``; if it is still waiting on ``fifo``
    then, the FIFO gets a writer (so the reader sees its end) and the test fails rather
    than hangs. Returns the error --load raised."""
    outcome = {}

    def load():
        try:
            _load(root)
        except Exception as exc:   # noqa: BLE001 - the test looks at it
            outcome["error"] = exc

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    for _ in range(120):
        if not thread.is_alive():
            break
        with contextlib.suppress(OSError):   # ENXIO: nobody is reading it right now
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(1)
    assert not hung, f"--load still waited on the FIFO {fifo} after {seconds} s"
    return outcome.get("error")


@pytest.mark.parametrize("name", [".metadata", "common.pt", DATA])
def test_a_fifo_in_the_checkpoint_is_refused_at_once(saved, tmp_path, name):
    root, folder = _copy(saved, tmp_path)
    os.unlink(folder / name)
    os.mkfifo(folder / name)
    error = _load_in_a_thread(root, folder / name)
    assert isinstance(error, UnsafeCheckpointError), repr(error)
    assert f"{folder / name} is not a regular file" in str(error)
    assert "\n" not in str(error)


@pytest.mark.parametrize("name", [".metadata", "common.pt", DATA])
def test_a_link_in_the_checkpoint_is_not_followed(saved, tmp_path, name):
    """A link to a copy of the very file: it would load, but the run reads a checkpoint's
    files only as they are, never through a link."""
    root, folder = _copy(saved, tmp_path)
    shutil.move(folder / name, tmp_path / name)
    os.symlink(tmp_path / name, folder / name)
    _refused(root, UnsafeCheckpointError, f"{folder / name} is a symbolic link")


@pytest.mark.parametrize("offset", ["past the end", -1])
def test_a_byte_range_outside_its_file_is_refused(saved, tmp_path, offset):
    root, folder = _copy(saved, tmp_path)
    size = os.path.getsize(folder / DATA)

    def move(metadata):
        info = _object_entry(metadata)
        info.offset = size if offset == "past the end" else offset

    _edit_metadata(folder, move)
    _refused(root, CheckpointCorruptError, folder / DATA if offset == "past the end"
             else folder / ".metadata", ADVICE)


# --- truncated, empty, garbage ------------------------------------------------------------
def _write(data: bytes):
    def write(path):
        with open(path, "wb") as f:
            f.write(data)
    return write


def _torch_save(obj):
    return lambda path: torch.save(obj, path)


DAMAGE = {
    "truncated": lambda path: os.truncate(path, os.path.getsize(path) // 2),
    "empty": _write(b""),
    "garbage": _write(random.Random(0).randbytes(4096)),
    "missing": os.unlink,
    "a pickled list": _write(pickle.dumps([1, 2, 3])),
    # lists nested 100000 deep (the unpickler builds them without recursing; a repr of
    # them, or a walk over them, would not)
    "a deep pickle": _write(b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b"."),
    "not JSON": _write(b"not JSON"),
    "a JSON list": _write(b'["torch_dist"]'),
    "not UTF-8": _write(b'{"sharded_backend": "torch_dist\xff"}'),
    "a saved list": _torch_save([1, 2, 3]),
}


@pytest.mark.parametrize("name, damage", [
    *((".metadata", d) for d in ("truncated", "empty", "garbage", "a pickled list",
                                 "a deep pickle")),
    *(("metadata.json", d) for d in ("truncated", "not JSON", "a JSON list", "not UTF-8")),
    *(("common.pt", d) for d in ("truncated", "empty", "garbage", "a saved list")),
    *((DATA, d) for d in ("missing", "empty", "truncated")),
])
def test_a_damaged_file_is_named_with_what_to_do(saved, tmp_path, name, damage):
    root, folder = _copy(saved, tmp_path)
    DAMAGE[damage](folder / name)
    _refused(root, CheckpointCorruptError, folder / name, ADVICE)


@pytest.mark.parametrize("what", ["object", "tensor"])
def test_garbage_inside_a_data_file_names_the_file(saved, tmp_path, what):
    """The file's size is right, the bytes of one entry are not (torch_dist has no
    checksums: this is what --load can still name)."""
    root, folder = _copy(saved, tmp_path)
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    info = _object_entry(metadata) if what == "object" else next(
        info for index, info in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata))
    with open(folder / DATA, "r+b") as f:
        f.seek(info.offset)
        f.write(random.Random(1).randbytes(info.length))
    _refused(root, CheckpointCorruptError, folder / DATA, ADVICE)


def test_a_failure_without_a_message_is_named_by_its_type():
    """What DCP gathers from a rank may have an empty str() (an AssertionError of torch's
    reader): the refusal says what it was instead of ending at the colon."""
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(ValueError) as caught:
        with torch_dist._refusals("/ckpt", f"/ckpt/{ITER}"):
            raise CheckpointException("load", {0: AssertionError()})
    assert str(caught.value) == (f"--load /ckpt: /ckpt/{ITER} does not fit this run: "
                                 "AssertionError: raised without a message while Megatron's "
                                 "loader read it")


# --- the iteration it holds -----------------------------------------------------------------
def test_an_iteration_directory_copied_from_another_is_refused(saved, tmp_path):
    root, folder = _copy(saved, tmp_path)
    shutil.copytree(folder, folder.parent / "iter_0000003")
    (folder.parent / "latest_checkpointed_iteration.txt").write_text("3")
    _refused(root, CheckpointCorruptError, folder.parent / "iter_0000003",
             "holds iteration 2")


@pytest.mark.parametrize("iteration", ["2", 2.0, True, -2])
def test_the_stored_iteration_must_be_the_directorys_int(saved, tmp_path, iteration):
    root, folder = _copy(saved, tmp_path)
    common = torch.load(folder / "common.pt", weights_only=False)   # the test's own file
    common["iteration"] = iteration
    torch.save(common, folder / "common.pt")
    _refused(root, CheckpointCorruptError, folder, f"holds iteration {iteration!r}")


# --- the save -------------------------------------------------------------------------------
def test_links_planted_in_the_iteration_directory_are_not_written_through(
        megatron_world, tmp_path, monkeypatch):
    """A link at the name of each file the save writes (and .metadata's temporary), planted
    as the iteration directory is made: each is replaced by a new 0600 file; the file they
    point at is unchanged."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    begin = torch_dist.ckpt.begin_iteration_dir

    def begin_and_plant(root, iteration):
        folder = begin(root, iteration)
        for name in (DATA, ".metadata", ".metadata.tmp", "common.pt", "metadata.json"):
            os.symlink(victim, os.path.join(folder, name))
        return folder

    monkeypatch.setattr(torch_dist.ckpt, "begin_iteration_dir", begin_and_plant)
    root = tmp_path / "ckpt"
    pretrain(parse_args([*FLAGS, "--exit-interval", "2", "--save", str(root)]))
    monkeypatch.undo()
    assert victim.read_bytes() == b"precious"
    for name in (DATA, ".metadata", "common.pt", "metadata.json"):
        assert not os.path.islink(root / ITER / name)
        assert os.stat(root / ITER / name).st_mode & 0o777 == 0o600
    assert not os.path.lexists(root / ITER / ".metadata.tmp")
    assert len(_load(str(root))) == 2


@pytest.mark.parametrize("how", ["no metadata.json", "a file", "a link loop"])
def test_an_iteration_directory_that_is_no_checkpoint_is_named_as_such(saved, tmp_path, how):
    """Not reported as the other format's missing model_optim_rng.pt."""
    root, folder = _copy(saved, tmp_path)
    if how == "no metadata.json":
        os.unlink(folder / "metadata.json")
        says = "is not a complete checkpoint"
    else:
        shutil.rmtree(folder)
        if how == "a file":
            folder.write_text("2")
            says = "is not a directory"
        else:
            os.symlink(folder, folder)
            says = "is a symbolic link"
    message = _refused(root, CheckpointChoiceError, folder, says)
    assert "model_optim_rng.pt is missing" not in message


# --- what each entry holds against .metadata and this run -------------------------------

REMAINDERS = [*FLAGS, "--bf16", "--use-precision-aware-optimizer"]
FC1 = "decoder.layers.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def remainders_saved(megatron_world, tmp_path_factory):
    """Iteration 2 of an offloaded bf16 run with master-weight remainders: ``fp32_param``
    holds int16."""
    root = tmp_path_factory.mktemp("remainders") / "ckpt"
    pretrain(parse_args([*REMAINDERS, "--exit-interval", "2", "--save", str(root)]))
    return root


def _rewrite_chunk(folder, fqn: str, change) -> str:
    """The first chunk of ``fqn`` replaced by ``change(tensor)``, torch.saved at the end of
    its data file, its storage entry pointed there (as a tool rewriting the chunk would);
    returns the data file's name."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    path = folder / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        chunk = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    buffer = io.BytesIO()
    torch.save(change(chunk), buffer)
    with open(path, "ab") as f:
        info.offset = f.tell()
        f.write(buffer.getvalue())
    info.length = len(buffer.getvalue())
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return info.relative_path


@pytest.mark.parametrize("what", ["float16 remainders", "a moment in bfloat16",
                                  "a weight of another shape"])
def test_an_entry_other_than_metadata_says_is_refused(remainders_saved, tmp_path, what):
    """An int16 remainder chunk rewritten as float16 of the same length (a moment as bf16, a
    weight's chunk twice as wide) while ``.metadata`` still records int16 (fp32, the
    shape): refused naming the file, the entry and both, before the state is used (it was
    cast, or narrowed, and loaded without a word)."""
    root = tmp_path / "ckpt"
    shutil.copytree(remainders_saved, root)
    fqn, change, says = {
        "float16 remainders": (f"optimizer.state.fp32_param.{FC1}",
                               lambda t: t.view(torch.float16), "torch.float16"),
        "a moment in bfloat16": (f"optimizer.state.exp_avg.{FC1}",
                                 lambda t: t.to(torch.bfloat16), "torch.bfloat16"),
        # twice as wide, its first half zeros: the reader narrowed it to the zeros
        "a weight of another shape": (FC1, lambda t: torch.cat([torch.zeros_like(t), t], -1),
                                      "shape")}[what]
    data = _rewrite_chunk(root / ITER, fqn, change)
    with pytest.raises(CheckpointCorruptError) as caught:
        pretrain(parse_args([*REMAINDERS, "--load", str(root)]))
    message = str(caught.value)
    assert "\n" not in message, message
    for named in (root / ITER / data, repr(fqn), says, ".metadata"):
        assert str(named) in message, message


def test_an_entry_recorded_in_another_dtype_than_this_run_reads_is_refused(remainders_saved,
                                                                          tmp_path):
    """``.metadata`` and its chunk agree, on bf16 for a moment this run reads in fp32 (as a
    checkpoint is written: unscaled): refused naming the entry, both dtypes and the file,
    before a byte of it is read (it was cast on load)."""
    from megatron_snake.training.checkpointing import CheckpointMismatchError

    root = tmp_path / "ckpt"
    shutil.copytree(remainders_saved, root)
    fqn = f"optimizer.state.exp_avg.{FC1}"
    _rewrite_chunk(root / ITER, fqn, lambda t: t.to(torch.bfloat16))
    _edit_metadata(root / ITER, lambda m: setattr(m.state_dict_metadata[fqn].properties,
                                                  "dtype", torch.bfloat16))
    with pytest.raises(CheckpointMismatchError) as caught:
        pretrain(parse_args([*REMAINDERS, "--load", str(root)]))
    message = str(caught.value)
    for named in (root / ITER / ".metadata", repr(fqn), "as torch.bfloat16",
                  "reads torch.float32"):
        assert str(named) in message, message
