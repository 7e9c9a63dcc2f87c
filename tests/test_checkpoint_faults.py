"""--save / --load under faults and attacks: a checkpoint that carries a pickled payload is
refused and the payload never runs; a flipped byte or a truncated file is refused naming
the file; a full disk during a save names the path and ENOSPC, leaves no partial files and
the previous checkpoint resumes exactly; files 0600 in 0700 directories; planted symbolic
links are never followed; every rename is made durable by an fsync of its directory."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

from conftest import checkpoint_flags
from megatron_snake.training import checkpointing
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.checkpoint_dir import CheckpointChoiceError, find_checkpoint
from megatron_snake.training.checkpointing import CheckpointCorruptError, CheckpointMismatchError
from megatron_snake.training.loop import pretrain

# the torch format's own files (torch_dist's are Megatron's, tested in their own modules)
FLAGS = checkpoint_flags("torch")
STATE = "model_optim_rng.pt"
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def full_run(megatron_world):
    """The uninterrupted run's four losses."""
    return pretrain(parse_args(FLAGS))


@pytest.fixture(scope="module")
def saved_format():
    """The format of ``saved`` (conftest): a real checkpoint of iteration 2 of FLAGS."""
    return "torch"


def _copy(saved, tmp_path) -> tuple[str, str]:
    """A copy of the saved checkpoint to change: (root, its state file)."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return str(root), str(root / "iter_0000002" / "mp_rank_00" / STATE)


def _resign(path: str) -> None:
    """What an attacker who can write the state file can do too: write its checksum file
    to match (a no-op where there is none)."""
    sidecar = path + ".sha256.json"
    if os.path.exists(sidecar):
        data = pathlib.Path(path).read_bytes()
        manifest = json.loads(pathlib.Path(sidecar).read_text())
        manifest.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        pathlib.Path(sidecar).write_text(json.dumps(manifest))


def _leftovers(root) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        found += [os.path.join(dirpath, n) for n in dirnames + filenames
                  if n.endswith((".tmp", ".part"))]
    return found


# --- malicious checkpoints ---------------------------------------------------------------
class _TouchPayload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


class _OpenPayload(_TouchPayload):
    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("payload", [_TouchPayload, _OpenPayload])
def test_a_pickled_payload_is_refused_and_never_runs(saved, tmp_path, payload):
    root, path = _copy(saved, tmp_path)
    marker = tmp_path / "payload_ran"
    state = torch.load(path, weights_only=False)  # the test's own file
    state["rng_state"]["evil"] = payload(str(marker))
    torch.save(state, path)
    _resign(path)  # the refusal must not rest on the checksum
    with pytest.raises(ValueError) as caught:
        pretrain(parse_args([*FLAGS, "--load", root]))
    message = str(caught.value)
    assert message.startswith(f"--load {root}: refused {path}: it holds objects other than "
                              "tensors and plain values"), message
    assert "nothing in it was run" in message
    assert not marker.exists(), "the payload ran"


def test_the_format_needs_only_torchs_allowlist_and_bytesio(saved, tmp_path):
    """What a save writes loads with weights_only=True and no extra safe globals (the ones
    Megatron-Core registers at import set aside), and --load leaves those as they were. The
    one extra global --load allows, io.BytesIO (where Transformer Engine layers keep their
    _extra_state), round-trips."""
    import io

    path = saved / "iter_0000002" / "mp_rank_00" / STATE
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        state = torch.load(path, weights_only=True)
    finally:
        torch.serialization.add_safe_globals(registered)
    assert state["iteration"] == 2
    checkpointing.load_checkpoint(find_checkpoint(str(saved)),
                                  args=parse_args([*FLAGS, "--load", str(saved)]))
    assert set(map(id, torch.serialization.get_safe_globals())) == set(map(id, registered))

    root = tmp_path / "ckpt"
    _save(root, 3, model_state={"w": torch.arange(4.0), "_extra_state": io.BytesIO(b"fp8")})
    state = _load(root)
    assert state["model"]["_extra_state"].getvalue() == b"fp8"
    assert torch.equal(state["model"]["w"], torch.arange(4.0))


def test_a_state_the_loader_would_refuse_is_not_written(megatron_world, tmp_path):
    """numpy.float64 is a float subclass: pickled as a numpy object, so the save refuses
    it naming the entry, before writing, and leaves nothing behind."""
    import numpy as np

    root = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=r"checkpoint entry state\['optimizer'\]\['lr'\] is a "
                                        r"numpy.float64; a checkpoint holds only tensors"):
        _save(root, 3, optimizer_state={"lr": np.float64(0.1)})
    assert os.listdir(root) == []


# --- integrity -----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_flipped_byte_is_refused_naming_the_file(saved, tmp_path, where):
    root, path = _copy(saved, tmp_path)
    size = os.path.getsize(path)
    offset = size // 2 if where == "middle" else size - 30   # tensor data / zip directory
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ValueError) as caught:
        pretrain(parse_args([*FLAGS, "--load", root]))
    assert str(caught.value).startswith(
        f"--load {root}: {path} is corrupt (checksum mismatch"), str(caught.value)
    assert "restore it from a copy or load an earlier iteration" in str(caught.value)


def test_a_truncated_file_is_refused_naming_the_file(saved, tmp_path):
    root, path = _copy(saved, tmp_path)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    with pytest.raises(ValueError) as caught:
        pretrain(parse_args([*FLAGS, "--load", root]))
    assert str(caught.value).startswith(
        f"--load {root}: {path} is corrupt (truncated: {size // 2} of {size} bytes); "
        "restore it from a copy or load an earlier iteration"), str(caught.value)


def test_a_missing_checksum_file_is_refused_naming_it(saved, tmp_path):
    root, path = _copy(saved, tmp_path)
    os.unlink(path + ".sha256.json")
    with pytest.raises(ValueError, match=re.escape(
            f"--load {root}: {path} has no checksum file {STATE}.sha256.json beside it")):
        pretrain(parse_args([*FLAGS, "--load", root]))


# --- a full disk during --save -------------------------------------------------------------
def _expect_disk_full_then_resume(root: str, full_run, patch=None) -> None:
    """From the iteration-2 checkpoint in ``root``, train to 4 and save there: the save
    fails with one error naming the path and ENOSPC; nothing partial is left, the tracker
    still says 2, and resuming from it gives the uninterrupted run's losses."""
    with pytest.raises(OSError) as caught:
        if patch:
            with patch():
                pretrain(parse_args([*FLAGS, "--load", root, "--save", root]))
        else:
            pretrain(parse_args([*FLAGS, "--load", root, "--save", root]))
    message = str(caught.value)
    part = os.path.join(root, "iter_0000004.tmp", "mp_rank_00", STATE + ".part")
    assert message.startswith(f"--save {root}: writing the checkpoint failed at {part}: no "
                              "space left on device (ENOSPC)."), message
    assert f"the previous checkpoint and {TRACKER} are unchanged" in message
    assert caught.value.errno == errno.ENOSPC
    assert _leftovers(root) == []
    assert sorted(n for n in os.listdir(root) if n != "filler") == ["iter_0000002", TRACKER]
    assert pathlib.Path(root, TRACKER).read_text() == "2"
    resumed = pretrain(parse_args([*FLAGS, "--load", root]))
    assert resumed == full_run[2:], (resumed, full_run[2:])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real, small file system (tmpfs, mounted here: needs root / CAP_SYS_ADMIN)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=60)
        why = proc.stderr.strip() or f"mount exited with {proc.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        proc, why = None, str(exc)
    if proc is None or proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({why}); "
                    "test_disk_full_injected_at_the_system_call covers the same path")
    yield mnt
    if subprocess.run(["umount", str(mnt)]).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)])


def test_disk_full_on_a_real_small_file_system(saved, full_run, small_tmpfs):
    root = str(small_tmpfs / "ckpt")
    shutil.copytree(saved, root)
    size = os.path.getsize(os.path.join(root, "iter_0000002", "mp_rank_00", STATE))
    st = os.statvfs(small_tmpfs)
    free = st.f_bavail * st.f_frsize
    assert free > size, "the tmpfs must hold at least one more checkpoint to fill it"
    with open(small_tmpfs / "filler", "wb") as f:  # room left: half a checkpoint
        f.write(b"\0" * (free - size // 2))
    _expect_disk_full_then_resume(root, full_run)


def test_disk_full_on_a_real_small_file_system_in_megatrons_format(full_run, small_tmpfs):
    """--ckpt-format torch_dist: the file system fills up half-way through the offloaded
    state's pieces; one error naming ENOSPC (not DCP's wrapper), nothing partial left, the
    previous checkpoint resumes exactly."""
    flags = [*FLAGS, "--ckpt-format", "torch_dist"]
    root = str(small_tmpfs / "ckpt")
    pretrain(parse_args([*flags, "--exit-interval", "2", "--save", root]))
    folder = os.path.join(root, "iter_0000002")
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    st = os.statvfs(small_tmpfs)
    free = st.f_bavail * st.f_frsize
    assert free > size, "the tmpfs must hold at least one more checkpoint to fill it"
    with open(small_tmpfs / "filler", "wb") as f:  # room left: half a checkpoint
        f.write(b"\0" * (free - size // 2))
    with pytest.raises(OSError) as caught:
        pretrain(parse_args([*flags, "--load", root, "--save", root]))
    message = str(caught.value)
    assert message.startswith(f"--save {root}: writing the checkpoint failed at "), message
    assert "no space left on device (ENOSPC)" in message, message
    assert f"the previous checkpoint and {TRACKER} are unchanged" in message
    assert caught.value.errno == errno.ENOSPC
    assert sorted(n for n in os.listdir(root)) == ["iter_0000002", TRACKER]
    assert pathlib.Path(root, TRACKER).read_text() == "2"
    assert pretrain(parse_args([*flags, "--load", root])) == full_run[2:]


@pytest.mark.parametrize("fail_at", ["write", "fsync"])
def test_disk_full_injected_at_the_system_call(saved, full_run, tmp_path, monkeypatch,
                                               fail_at):
    """os.write / os.fsync of files under --save fail with ENOSPC once half a checkpoint
    is written (what a full disk does; an NFS server may report it only at fsync)."""
    import contextlib

    root, _ = _copy(saved, tmp_path)
    budget = [os.path.getsize(os.path.join(root, "iter_0000002", "mp_rank_00", STATE)) // 2]
    real_write, real_fsync = os.write, os.fsync

    def under_root(fd):
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(os.path.realpath(root) + "/")
        except OSError:
            return False

    def full_write(fd, data):
        if not under_root(fd):
            return real_write(fd, data)
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, memoryview(data)[:budget[0]])   # a short write, then ENOSPC
        budget[0] -= n
        return n

    def full_fsync(fd):
        if under_root(fd) and os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    @contextlib.contextmanager
    def patch():
        with monkeypatch.context() as m:
            if fail_at == "write":
                m.setattr(os, "write", full_write)
            else:
                m.setattr(os, "fsync", full_fsync)
            yield

    _expect_disk_full_then_resume(root, full_run, patch)


# --- permissions, links, durability --------------------------------------------------------
def _save(root, iteration, optimizer_state=None, model_state=None):
    """checkpointing.save_checkpoint of a small state, as Trainer.save calls it."""
    args = parse_args([*FLAGS, "--save", str(root)])
    return checkpointing.save_checkpoint(
        str(root), iteration=iteration, consumed_samples=6 * iteration, args=args,
        model_state=model_state if model_state is not None else {"w": torch.arange(4.0)},
        optimizer_state=optimizer_state if optimizer_state is not None else {"step": 1},
        scheduler_state={"num_steps": iteration})


def _load(root) -> dict:
    return checkpointing.load_checkpoint(find_checkpoint(str(root)),
                                         args=parse_args([*FLAGS, "--load", str(root)]))


def _mode(path) -> int:
    return os.lstat(path).st_mode & 0o777


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_files_are_0600_in_0700_directories(megatron_world, tmp_path, ckpt_format):
    root = tmp_path / "new" / "ckpt"   # missing: made 0700
    flags = checkpoint_flags(ckpt_format)
    old = os.umask(0)                 # whatever the umask
    try:
        if ckpt_format == "torch":
            _save(root, 3)
        else:   # Megatron's files (its and torch's own writers make them 0644)
            pretrain(parse_args([*flags, "--exit-interval", "3", "--save", str(root)]))
    finally:
        os.umask(old)
    modes = {}
    for folder, _, names in os.walk(root):
        modes[folder] = oct(_mode(folder))
        modes.update((os.path.join(folder, n), oct(_mode(os.path.join(folder, n))))
                     for n in names)
    assert modes == {p: "0o700" if os.path.isdir(p) else "0o600" for p in modes}
    written = {os.path.relpath(p, root) for p in modes}
    files = ([f"mp_rank_00/{STATE}", f"mp_rank_00/{STATE}.sha256.json"] if ckpt_format ==
             "torch" else [".metadata", "__0_0.distcp", "common.pt", "metadata.json"])
    assert {TRACKER, *(f"iter_0000003/{n}" for n in files)} <= written, written
    if ckpt_format == "torch":
        assert _load(root)["iteration"] == 3
    else:
        assert len(pretrain(parse_args([*flags, "--load", str(root)]))) == 1


@pytest.fixture
def victims(tmp_path):
    """A file and a directory a planted link points at; returns them and a check that
    neither changed."""
    victim_file = tmp_path / "victim.txt"
    victim_file.write_bytes(b"precious")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "keep").write_bytes(b"keep")
    os.chmod(victim_file, 0o644)
    os.chmod(victim_dir, 0o755)

    def unchanged():
        assert victim_file.read_bytes() == b"precious"
        assert _mode(victim_file) == 0o644
        assert os.listdir(victim_dir) == ["keep"]
        assert (victim_dir / "keep").read_bytes() == b"keep"
        assert _mode(victim_dir) == 0o755
    return victim_file, victim_dir, unchanged


def test_links_planted_in_the_save_directory_are_not_followed(megatron_world, tmp_path,
                                                              victims):
    """Links at the temporary iteration directory, the tracker and the tracker's temporary
    names: the save replaces them (never writes through them). A link at the final
    iteration directory's name is an entry the run did not write: the save is refused and
    the link stays as it was."""
    victim_file, victim_dir, unchanged = victims
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(victim_dir, root / "iter_0000003.tmp")
    for name in (TRACKER + ".tmp", TRACKER + ".part", TRACKER):
        os.symlink(victim_file, root / name)
    _save(root, 3)
    unchanged()
    for name in ("iter_0000003", TRACKER):
        assert not os.path.islink(root / name)
    assert _load(root)["iteration"] == 3
    os.symlink(victim_dir, root / "iter_0000005")
    with pytest.raises(CheckpointChoiceError, match="iter_0000005 appeared .* not replaced"):
        _save(root, 5)
    unchanged()
    assert os.readlink(root / "iter_0000005") == str(victim_dir)
    # the --save directory itself may be a link: the user's choice
    os.symlink(root, tmp_path / "via_link")
    _save(tmp_path / "via_link", 4)
    assert _load(tmp_path / "via_link")["iteration"] == 4


def test_links_planted_during_the_save_are_not_followed(megatron_world, tmp_path, victims,
                                                        monkeypatch):
    """After the iteration directory is made and before the rank writes (a race with
    someone who can write in --save): a link at the .part path is removed, not followed."""
    victim_file, _, unchanged = victims
    root = tmp_path / "ckpt"
    real_barrier = checkpointing._barrier

    def planting_barrier():
        rank_dir = root / "iter_0000003.tmp" / "mp_rank_00"
        if (root / "iter_0000003.tmp").is_dir() and not rank_dir.exists():
            rank_dir.mkdir()
            os.symlink(victim_file, rank_dir / (STATE + ".part"))
        real_barrier()

    monkeypatch.setattr(checkpointing, "_barrier", planting_barrier)
    _save(root, 3)
    unchanged()
    assert _load(root)["iteration"] == 3


def test_a_link_at_the_rank_directory_is_refused_naming_it(megatron_world, tmp_path, victims,
                                                           monkeypatch):
    from megatron_snake.storage.errors import UnsafePathError

    _, victim_dir, unchanged = victims
    root = tmp_path / "ckpt"
    real_barrier = checkpointing._barrier
    rank_dir = root / "iter_0000003.tmp" / "mp_rank_00"

    def planting_barrier():
        if (root / "iter_0000003.tmp").is_dir() and not os.path.lexists(rank_dir):
            os.symlink(victim_dir, rank_dir)
        real_barrier()

    monkeypatch.setattr(checkpointing, "_barrier", planting_barrier)
    with pytest.raises(UnsafePathError, match=re.escape(
            f"checkpoint directory {rank_dir} is a symbolic link")):
        _save(root, 3)
    unchanged()
    assert os.listdir(root) == [], "the partial iteration directory is removed"


def test_every_rename_is_made_durable(megatron_world, tmp_path, monkeypatch):
    """fsync of each file before its rename and of its directory after it: the rank
    directory (state and checksum files), --save (iteration directory, tracker)."""
    root = tmp_path / "ckpt"
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _save(root, 3)
    monkeypatch.undo()
    tmp, final = str(root / "iter_0000003.tmp"), str(root / "iter_0000003")
    rank_dir = os.path.join(tmp, "mp_rank_00")
    state = os.path.join(rank_dir, STATE)
    checksum = state + ".sha256.json"
    tracker = str(root / TRACKER)

    def after(event, then):
        i = events.index(event)
        assert then in events[i + 1:], f"{then} after {event}: {events}"

    def before(event, first):
        assert first in events[:events.index(event)], f"{first} before {event}: {events}"

    before(("replace", state + ".part", state), ("fsync", state + ".part"))
    before(("replace", checksum + ".part", checksum), ("fsync", checksum + ".part"))
    after(("replace", checksum + ".part", checksum), ("fsync", rank_dir))
    after(("replace", state + ".part", state), ("fsync", rank_dir))
    before(("replace", tmp, final), ("fsync", tmp))
    # --save is fsynced after the iteration directory's rename, before the tracker names it
    renamed = events.index(("replace", tmp, final))
    assert ("fsync", str(root)) in events[renamed:events.index(("fsync", tracker + ".part"))]
    before(("replace", tracker + ".part", tracker), ("fsync", tracker + ".part"))
    after(("replace", tracker + ".part", tracker), ("fsync", str(root)))


KILLED_MID_SAVE = {"torch": """
import os, signal, sys, warnings
warnings.filterwarnings("ignore")
from megatron_snake.training import checkpointing
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain

real_write, saves = checkpointing._write_state, []

def write_then_die(path, state):
    saves.append(path)
    if len(saves) == 2:                      # the second save, half written: SIGKILL
        with open(path, "wb") as f:
            f.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    real_write(path, state)

checkpointing._write_state = write_then_die
pretrain(parse_args(sys.argv[1:]))
""", "torch_dist": """
import os, signal, sys, warnings
warnings.filterwarnings("ignore")
from megatron_snake.training import torch_dist_offloaded
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain

real_save, saves = torch_dist_offloaded.stream_save, []

def save_then_die(sharded, common, directory, *args, **kwargs):
    saves.append(directory)
    if len(saves) == 2:                      # the second save, half written: SIGKILL
        with open(os.path.join(directory, "__0_0.distcp"), "wb") as f:
            f.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(sharded, common, directory, *args, **kwargs)

torch_dist_offloaded.stream_save = save_then_die
pretrain(parse_args(sys.argv[1:]))
"""}


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_sigkill_mid_save_keeps_the_previous_checkpoint_and_resumes_exactly(tmp_path,
                                                                             ckpt_format):
    """A process killed while it writes a checkpoint: the tracker still names the previous
    one, which loads and resumes to the uninterrupted run's losses; the next save clears
    what the killed one left."""
    import signal
    import sys

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--deterministic-mode",
             "--device", "cpu", "--snake-offload", "--train-iters", "6", "--log-interval", "1",
             "--ckpt-format", ckpt_format]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def run(*extra, code=None):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        argv = ["-c", code, *flags, *extra] if code else \
            [os.path.join(repo, "examples", "pretrain_gpt.py"), *flags, *extra]
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              env=env, timeout=600)

    def losses(out):
        return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]

    full = losses(run().stdout)
    ckpt = tmp_path / "ckpt"
    killed = run("--save", str(ckpt), "--save-interval", "2", code=KILLED_MID_SAVE[ckpt_format])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "iter_0000004.tmp").exists(), "the kill came mid-save"
    resumed = run("--load", str(ckpt), "--save", str(ckpt), "--save-interval", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(resumed.stdout) == full[2:]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000002", "iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt"]


# --- which checkpoint --load takes, and what --save may replace ------------------------------
def _tree(root) -> dict:
    """Every file under ``root`` and its bytes' hash, and every link and its target: what
    must stay as it was when a run is refused."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                found[path] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                found[path] = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    return found


def _refused(flags, error=CheckpointChoiceError) -> str:
    """The one-line message ``pretrain`` refuses ``flags`` with."""
    with pytest.raises(error) as caught:
        pretrain(parse_args(flags))
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def _break_tracker(tracker: pathlib.Path, how: str, elsewhere: pathlib.Path) -> None:
    tracker.unlink()
    if how == "fifo":
        os.mkfifo(tracker)
    elif how == "directory":
        tracker.mkdir()
    elif how == "dangling link":
        os.symlink(elsewhere / "gone", tracker)
    elif how == "link to another file":
        secret = elsewhere / "secret"
        secret.write_text("4 root:secret-hash\n")
        os.symlink(secret, tracker)
    elif how == "not a number":
        tracker.write_text("four")


@pytest.mark.parametrize("how", ["missing", "fifo", "directory", "dangling link",
                                 "link to another file", "not a number"])
def test_iterations_without_a_readable_tracker_are_never_trained_over(saved, full_run,
                                                                      tmp_path, how):
    """Megatron-LM trains from scratch here and replaces iter_0000002 at iteration 2:
    refused, naming the iteration there and --ckpt-step, nothing changed (no FIFO opened,
    no link followed or echoed); --ckpt-step 2 then resumes it exactly."""
    root, _ = _copy(saved, tmp_path)
    _break_tracker(pathlib.Path(root, TRACKER), how, tmp_path)
    before = _tree(root)
    message = _refused([*FLAGS, "--load", root, "--save", root])
    assert message.startswith(f"--load {root}: ") and "--ckpt-step 2" in message, message
    assert "secret" not in message
    assert _tree(root) == before
    assert pretrain(parse_args([*FLAGS, "--load", root, "--ckpt-step", "2"])) == full_run[2:]


def test_a_save_never_replaces_an_iteration_the_run_did_not_write(saved, tmp_path):
    """A run from scratch into a --save directory that holds iteration 2, and a run
    resumed from iteration 2 into one that holds iteration 4 of another run: both refused
    at start, before anything is built, and nothing in --save changes."""
    root, _ = _copy(saved, tmp_path)
    before = _tree(root)
    message = _refused([*FLAGS, "--save", root])
    assert "already holds iteration 2, which this run (from iteration 0 to 4) would write " \
           "over" in message, message
    shutil.copytree(os.path.join(root, "iter_0000002"), os.path.join(root, "iter_0000004"))
    before = _tree(root)
    message = _refused([*FLAGS, "--load", root, "--save", root])
    assert "already holds iteration 4" in message and "--ckpt-step 4" in message, message
    assert _tree(root) == before


def _rewrite_state(path: str, **changes) -> None:
    """The state file with ``changes`` made (None: the entry dropped), signed again."""
    state = torch.load(path, weights_only=False)
    for key, value in changes.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    torch.save(state, path)
    _resign(path)


@pytest.mark.parametrize("stored", [-5, 3])
def test_the_stored_iteration_must_be_the_trackers_and_the_directorys(saved, tmp_path,
                                                                     stored):
    root, path = _copy(saved, tmp_path)
    _rewrite_state(path, iteration=stored)
    message = _refused([*FLAGS, "--load", root], CheckpointCorruptError)
    assert f"iter_0000002 holds iteration {stored!r}, but {TRACKER} and the directory's " \
           "name say 2" in message, message


def test_an_iteration_directory_that_is_a_link_or_beyond_train_iters_is_refused(saved,
                                                                              tmp_path):
    """A link from another run's directory (which holds iteration 2) where the tracker
    names 4 is not followed; a checkpoint at iteration 10**12 is beyond --train-iters 4
    (not a silent exit with nothing trained)."""
    root, _ = _copy(saved, tmp_path)
    os.symlink(saved / "iter_0000002", os.path.join(root, "iter_0000004"))
    pathlib.Path(root, TRACKER).write_text("4")
    message = _refused([*FLAGS, "--load", root])
    assert "iter_0000004 is a symbolic link" in message, message
    os.unlink(os.path.join(root, "iter_0000004"))
    big = 10 ** 12
    os.rename(os.path.join(root, "iter_0000002"), os.path.join(root, f"iter_{big}"))
    _rewrite_state(os.path.join(root, f"iter_{big}", "mp_rank_00", STATE), iteration=big)
    pathlib.Path(root, TRACKER).write_text(str(big))
    message = _refused([*FLAGS, "--load", root])
    assert f"at iteration {big}, beyond --train-iters 4: nothing to train" in message, message


def _rewrite_unit(path: str, change) -> None:
    """The unit file with ``change(entry)`` applied, written (and signed) as a save does."""
    root = str(pathlib.Path(path).parents[2])
    entry = {k: v.clone() if torch.is_tensor(v) else v
             for k, v in checkpointing._read_unit(root, path, 0).items()}
    change(entry)
    os.unlink(path)
    checkpointing._write_unit(path, 0, entry)


@pytest.mark.parametrize("change, says", [
    (lambda e: e.update(weights=e["weights"].view(torch.uint8)),
     "record 'weights' is uint8 [54912], where this run's is float32 [13728]"),
    (lambda e: e.update(weights=e["weights"][:100]),
     "record 'weights' is float32 [100], where this run's is float32 [13728]"),
    (lambda e: e.update(exp_avg=e["exp_avg"].half()),
     "record 'exp_avg' is float16 [13728], where this run's is float32 [13728]"),
    (lambda e: e.update({"../../weights": e.pop("weights")}),
     "is not a named tensor record"),
    (lambda e: e.pop("weights"), "lacks the record(s) ['weights']"),
    (lambda e: e.update(segments=5), "unit 0 does not match this model"),
])
def test_a_unit_record_other_than_the_layout_is_refused(saved, tmp_path, change, says):
    """Each record of a unit file is checked against this run's layout (shape and dtype),
    even when its checksum was written to match: none is converted and trained on."""
    root, _ = _copy(saved, tmp_path)
    unit = os.path.join(root, "iter_0000002", "mp_rank_00", "unit_0.bin")
    _rewrite_unit(unit, change)
    with pytest.raises((CheckpointCorruptError, CheckpointMismatchError)) as caught:
        pretrain(parse_args([*FLAGS, "--load", root]))
    message = str(caught.value)
    assert message.startswith(f"--load {root}: {unit}") and says in message, message
    assert "\n" not in message


@pytest.mark.parametrize("entry", ["snake", "units", "model"])
def test_a_state_file_without_an_entry_is_refused_naming_it(saved, tmp_path, entry):
    root, path = _copy(saved, tmp_path)
    _rewrite_state(path, **{entry: None})
    message = _refused([*FLAGS, "--load", root], CheckpointCorruptError)
    assert message.startswith(f"--load {root}: {path} is corrupt (its entry {entry!r} is "
                              "NoneType"), message
