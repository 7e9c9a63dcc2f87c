"""Links and foreign files planted where the run creates its files are refused or replaced,
never followed: the offload directory's rank directory, its LOCK, stale swap files, the
activation plan JSON, and the safe_files helpers they are built on.

Each case plants an entry pointing at a "victim" (a directory or file the run must never
touch) and checks the victim afterwards: same mode, same files, same bytes, its content in
no error message or log line. The foreign-owner cases need root (os.chown to another uid).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import numpy
import pytest
import torch

from megatron_snake.offload.activation_plan import ActivationPlanner
from megatron_snake.storage import OffloadDirError, TensorStore
from megatron_snake.storage.errors import UnsafePathError
from megatron_snake.storage.safe_files import (create_file, open_owned_file, private_dir,
                                               private_dirs, write_file_atomically)
from megatron_snake.storage.swap_file import (FILE_HEADER, FILE_MAGIC, FORMAT_VERSION,
                                              open_direct, read_file_header)

BUF = 64 << 10
SECRET = b"root:SECRET-CONTENT-of-the-victim:0:0\n"
OTHER_UID = 12345
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="chown to another uid needs root; as a normal user "
                                       "another user's entry cannot be made here")


def small_store(path, rank=0, **kw):
    return TensorStore(path, rank=rank, host_memory_limit=16 * BUF, buffer_bytes=BUF, **kw)


def snapshot(path):
    """Mode, owner and every file's bytes of a victim directory (or a file)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        files = {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}
    else:
        files = open(path, "rb").read()
    return stat.S_IMODE(st.st_mode), st.st_uid, files


@pytest.fixture
def victim_dir(tmp_path):
    d = tmp_path / "victim"
    d.mkdir()
    (d / "important.swap").write_bytes(SECRET)       # a name the stale-file sweep matches
    (d / "notes.txt").write_bytes(SECRET)
    os.chmod(d, 0o755)
    return d


@pytest.fixture
def victim_file(tmp_path):
    f = tmp_path / "victim.txt"
    f.write_bytes(SECRET)
    os.chmod(f, 0o644)
    return f


@pytest.fixture
def offload_dir(tmp_path):
    d = tmp_path / "offload"
    d.mkdir()
    os.chmod(d, 0o1777)                               # a world-writable, sticky parent
    return d


def assert_names(exc, *parts):
    msg = str(exc)
    for part in parts:
        assert part in msg, msg
    assert "SECRET" not in msg, msg
    return msg


# ------------------------------------------------------------------ (a) rank0 -> a directory

def test_rank_dir_symlink_is_refused(offload_dir, victim_dir):
    before = snapshot(victim_dir)
    rank0 = offload_dir / "rank0"
    os.symlink(victim_dir, rank0)
    with pytest.raises(OffloadDirError) as ei:
        small_store(offload_dir)
    assert isinstance(ei.value, UnsafePathError)
    assert_names(ei.value, str(rank0), "symbolic link", "--snake-offload-dir")
    assert snapshot(victim_dir) == before            # not chmodded, nothing deleted or added
    assert os.path.islink(rank0)                      # the link is the user's to remove


# ------------------------------------------------------------------ (b) rank0/LOCK -> a file

def test_lock_symlink_is_refused_and_the_target_never_read(offload_dir, victim_file, caplog):
    before = snapshot(victim_file)
    (offload_dir / "rank0").mkdir(mode=0o700)
    lock = offload_dir / "rank0" / "LOCK"
    os.symlink(victim_file, lock)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(OffloadDirError) as ei:
            small_store(offload_dir)
    assert_names(ei.value, str(lock), "symbolic link", "--snake-offload-dir")
    assert snapshot(victim_file) == before            # not truncated, not overwritten
    assert "SECRET" not in caplog.text                # and its content is in no log line


def test_lock_hard_link_is_refused(offload_dir, tmp_path):
    """A LOCK with another name (a hard link to some file) is not truncated either."""
    target = offload_dir / "elsewhere"                # same file system as the rank dir
    target.write_bytes(SECRET)
    (offload_dir / "rank0").mkdir(mode=0o700)
    os.link(target, offload_dir / "rank0" / "LOCK")
    with pytest.raises(OffloadDirError) as ei:
        small_store(offload_dir)
    assert_names(ei.value, "LOCK", "hard links")
    assert target.read_bytes() == SECRET


# ------------------------------------------------------------------ (c) stale x.swap -> a file

def swap_header(kind=b"secretkind"):
    return FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 4096, b"crc32", b"\x11" * 16, 4242,
                            time.time(), kind).ljust(4096, b"\0")


def test_stale_swap_symlink_is_removed_without_reading_the_target(offload_dir, tmp_path,
                                                                  caplog):
    victim = tmp_path / "victim.swap"
    victim.write_bytes(swap_header() + SECRET)        # readable as one of our swap files
    before = snapshot(victim)
    rank0 = offload_dir / "rank0"
    rank0.mkdir(mode=0o700)
    os.symlink(victim, rank0 / "misc.swap")
    with caplog.at_level(logging.WARNING, logger="megatron_snake.storage"):
        s = small_store(offload_dir)
    with s:
        (path, hdr, size), = s.dir.stale
        assert path == str(rank0 / "misc.swap")
        assert hdr == {"not_read": "a symbolic link"} and size == 0   # the header not read
        assert not os.path.lexists(rank0 / "misc.swap")                  # the link removed
        s.put("a", torch.ones(10), tier="nvme").wait()                   # a new misc.swap
        assert not os.path.islink(rank0 / "misc.swap")
    assert snapshot(victim) == before                 # the target not deleted nor changed
    assert "misc.swap (a symbolic link" in caplog.text
    assert "secretkind" not in caplog.text and "pid 4242" not in caplog.text


def test_read_file_header_and_open_direct_do_not_follow_links(tmp_path):
    victim = tmp_path / "victim.swap"
    victim.write_bytes(swap_header())
    assert read_file_header(victim)["kind"] == "secretkind"
    link = tmp_path / "link.swap"
    os.symlink(victim, link)
    assert read_file_header(link) is None
    with pytest.raises(OSError):
        open_direct(str(link), create=False)
    with pytest.raises(FileExistsError):
        open_direct(str(link))                        # O_EXCL: never a new file through it
    assert read_file_header(victim)["kind"] == "secretkind"    # the target left as it was


@needs_root
def test_stale_swap_of_another_user_is_removed_unread(offload_dir, caplog):
    rank0 = offload_dir / "rank0"
    rank0.mkdir(mode=0o700)
    foreign = rank0 / "grad.swap"
    foreign.write_bytes(swap_header())
    os.chown(foreign, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="megatron_snake.storage"):
        s = small_store(offload_dir)
    with s:
        (path, hdr, _), = s.dir.stale
        assert hdr == {"not_read": f"owned by uid {OTHER_UID}, not by this user"}
    assert "secretkind" not in caplog.text


# ------------------------------------------------------------------ (d) rank0 of another user

@needs_root
def test_rank_dir_of_another_user_is_refused(offload_dir):
    rank0 = offload_dir / "rank0"
    rank0.mkdir(mode=0o755)
    (rank0 / "theirs.swap").write_bytes(SECRET)
    os.chown(rank0, OTHER_UID, OTHER_UID)
    before = snapshot(rank0)
    with pytest.raises(OffloadDirError) as ei:
        small_store(offload_dir)
    assert_names(ei.value, str(rank0), f"owned by uid {OTHER_UID}", "--snake-offload-dir")
    assert snapshot(rank0) == before                  # mode, owner and files as they were


# ------------------------------------------------------------------ existing behaviour kept

def test_clean_rank_dir_still_works_and_is_private(offload_dir):
    with small_store(offload_dir) as s:
        rank0 = offload_dir / "rank0"
        assert stat.S_IMODE(os.lstat(rank0).st_mode) == 0o700
        lock = json.loads((rank0 / "LOCK").read_text())
        assert lock["pid"] == os.getpid() and stat.S_IMODE(os.lstat(rank0 / "LOCK").st_mode) == 0o600
        s.put("a", torch.ones(10), tier="nvme").wait()
        assert stat.S_IMODE(os.lstat(rank0 / "misc.swap").st_mode) == 0o600
    assert not rank0.exists()


# ------------------------------------------------------------------ (e) the plan JSON

def test_plan_json_symlink_is_replaced_not_followed(megatron_world, tmp_path, victim_file):
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    before = snapshot(victim_file)
    path = tmp_path / "plan.json"
    os.symlink(victim_file, path)
    pretrain(parse_args(["--train-iters", "2", "--snake-offload", "--snake-activation-tier",
                         "auto", "--snake-plan-json", str(path), "--snake-profile-iters", "1"]))
    assert snapshot(victim_file) == before
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert json.loads(path.read_text())["placements"]
    assert not os.path.lexists(str(path) + ".part")


def test_a_directory_planted_at_the_default_plan_path_is_refused_before_any_work(
        megatron_world, offload_dir, monkeypatch):
    """Another user makes a directory named like this rank's plan in the shared
    --snake-offload-dir. The run never gave --snake-plan-json: it is refused before the
    model is built, naming the default path, the directory it comes from and the way out."""
    from megatron_snake.offload.activation_plan import PlanPathError
    from megatron_snake.training import build
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    planted = offload_dir / "activation_plan_rank0.json"
    planted.mkdir()
    if os.geteuid() == 0:
        os.chown(planted, OTHER_UID, OTHER_UID)      # as the other user made it

    def built_first(*args, **kwargs):
        raise AssertionError("the model was built before the plan path was checked")

    monkeypatch.setattr(build, "build_gpt_model", built_first)
    with pytest.raises(PlanPathError) as ei:
        pretrain(parse_args(["--train-iters", "2", "--snake-offload",
                             "--snake-offload-dir", str(offload_dir)]))
    msg = assert_names(ei.value, f"default path {planted}", f"--snake-offload-dir {offload_dir}",
                       "is a directory this run did not make", "remove it",
                       "give --snake-plan-json")
    assert not msg.startswith("--snake-plan-json"), msg
    assert planted.is_dir() and not (offload_dir / "rank0").exists()   # nothing left


def test_an_offload_dir_others_may_write_without_the_sticky_bit_is_warned_about(tmp_path,
                                                                                caplog):
    """Anyone who may write to such a directory may rename or remove what the run makes
    there and put their own entry in its place (the checks cannot close that race)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode, warned in ((0o777, True), (0o775, True), (0o1777, False), (0o755, False)):
        os.chmod(shared, mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_snake.storage"):
            small_store(shared).close()
        lines = [r.getMessage() for r in caplog.records if "sticky" in r.getMessage()]
        assert len(lines) == warned, (oct(mode), lines)
        if warned:
            assert f"--snake-offload-dir {shared} is writable by other users" in lines[0]
            assert "another user could replace" in lines[0] and "like /tmp" in lines[0]


def test_plan_json_in_a_missing_directory_is_refused_at_the_start(tmp_path):
    path = tmp_path / "no" / "plan.json"
    with pytest.raises(ValueError, match="--snake-plan-json .*does not exist"):
        ActivationPlanner(None, None, profile_iters=1, gpu_budget_bytes=None,
                          host_budget_bytes=0, plan_path=str(path), log=lambda *a: None)
    with pytest.raises(ValueError, match="is a directory"):
        ActivationPlanner(None, None, profile_iters=1, gpu_budget_bytes=None,
                          host_budget_bytes=0, plan_path=str(tmp_path), log=lambda *a: None)


# ------------------------------------------------------------------ (f) safe_files

def test_private_dir(tmp_path, victim_dir):
    d = tmp_path / "new"
    private_dir(str(d))
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    private_dir(str(d))                               # ours: taken, mode set again
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700

    before = snapshot(victim_dir)
    link = tmp_path / "link"
    os.symlink(victim_dir, link)
    with pytest.raises(UnsafePathError, match="link is a symbolic link"):
        private_dir(str(link), what="link")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        private_dir(str(dangling))
    assert not (tmp_path / "nowhere").exists()
    f = tmp_path / "file"
    f.write_bytes(SECRET)
    with pytest.raises(UnsafePathError, match="exists and is not a directory"):
        private_dir(str(f))
    assert snapshot(victim_dir) == before and f.read_bytes() == SECRET

    assert private_dirs(str(tmp_path), "a/b/c") == str(tmp_path / "a" / "b" / "c")
    assert (tmp_path / "a" / "b" / "c").is_dir()
    with pytest.raises(UnsafePathError):
        private_dirs(str(tmp_path), "link/sub")       # a link in the middle is refused too
    assert snapshot(victim_dir) == before


@needs_root
def test_private_dir_and_open_owned_file_refuse_another_users_entry(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}"):
        private_dir(str(d))
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o755
    f = tmp_path / "theirs.txt"
    f.write_bytes(SECRET)
    os.chown(f, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}"):
        open_owned_file(str(f))
    assert f.read_bytes() == SECRET


def test_create_file_replaces_a_planted_link(tmp_path, victim_file):
    before = snapshot(victim_file)
    path = tmp_path / "out"
    os.symlink(victim_file, path)
    fd = create_file(str(path))
    with os.fdopen(fd, "wb") as f:
        f.write(b"mine")
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert path.read_bytes() == b"mine" and snapshot(victim_file) == before
    (tmp_path / "dir").mkdir()
    with pytest.raises(UnsafePathError, match="is a directory"):
        create_file(str(tmp_path / "dir"))


def test_open_owned_file_refuses_links_and_non_regular_files(tmp_path, victim_file):
    before = snapshot(victim_file)
    link = tmp_path / "LOCK"
    os.symlink(victim_file, link)
    with pytest.raises(UnsafePathError, match="symbolic link") as ei:
        open_owned_file(str(link))
    assert "SECRET" not in str(ei.value) and snapshot(victim_file) == before
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        open_owned_file(str(fifo))
    fd = open_owned_file(str(tmp_path / "new"))       # created 0600 when missing
    os.close(fd)
    assert stat.S_IMODE(os.lstat(tmp_path / "new").st_mode) == 0o600


def test_write_file_atomically(tmp_path, victim_file):
    before = snapshot(victim_file)
    path = tmp_path / "plan.json"
    os.symlink(victim_file, path)
    os.symlink(victim_file, str(path) + ".part")     # a planted temporary name, too
    write_file_atomically(str(path), b'{"a": 1}')
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert path.read_bytes() == b'{"a": 1}' and snapshot(victim_file) == before
    assert not os.path.lexists(str(path) + ".part")
    write_file_atomically(str(path), b"again")        # replaces the file of the last write
    assert path.read_bytes() == b"again"


def test_data_cache_entry_is_private_and_never_a_planted_link(tmp_path):
    """Megatron reads its dataset index caches back with numpy's pickle-enabled loader, so
    the cache directory a run uses is a real 0700 directory of this user's: a link planted
    where it would go (in a shared --data-cache-path) is refused, naming it."""
    from megatron_snake.storage.errors import UnsafePathError
    from megatron_snake.training.data import _data_fingerprint, build_gpt_datasets
    from megatron_snake.training.tokenizer import ByteTokenizer

    prefix = tmp_path / "data" / "text"
    prefix.parent.mkdir()
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=numpy.int32)
    for doc in range(40):
        builder.add_document(torch.arange(doc % 7 + 20, dtype=torch.int32), [doc % 7 + 20])
    builder.finalize(str(prefix) + ".idx")
    shared = tmp_path / "shared_cache"
    shared.mkdir()
    kwargs = dict(mock=False, data_path=[str(prefix)], split="80,10,10", seq_length=8,
                  seed=1, tokenizer=ByteTokenizer(), num_samples=(8, 2, 2),
                  data_cache_path=str(shared))
    victim = tmp_path / "victim"
    victim.mkdir()
    entry = shared / _data_fingerprint([str(prefix)])
    entry.symlink_to(victim)
    with pytest.raises(UnsafePathError, match="--data-cache-path entry .* symbolic link"):
        build_gpt_datasets(**kwargs)
    assert list(victim.iterdir()) == []
    entry.unlink()
    build_gpt_datasets(**kwargs)
    assert entry.is_dir() and not entry.is_symlink()
    assert stat.S_IMODE(entry.stat().st_mode) == 0o700


@pytest.mark.parametrize("planner", ["activation", "saved-tensor"])
def test_a_directory_made_at_the_plan_path_during_the_run_is_one_warning(
        megatron_world, offload_dir, monkeypatch, caplog, planner):
    """A directory made at the default plan path after the start's check, while the run
    profiles: the plan cannot be written, which is one warning naming the path, and the
    run trains on with the plan in memory (IsADirectoryError ended it, losing the work
    since the last save)."""
    from megatron_snake.offload.adaptive import AdaptiveOffloader
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    cls = ActivationPlanner if planner == "activation" else AdaptiveOffloader
    made = cls.__init__

    def made_then_planted(self, *args, **kwargs):
        made(self, *args, **kwargs)
        os.mkdir(self.plan_path)

    monkeypatch.setattr(cls, "__init__", made_then_planted)
    mode = ["--snake-offload"] if planner == "activation" else ["--snake-activation-offload"]
    with caplog.at_level(logging.WARNING, logger="megatron_snake.offload"):
        losses = pretrain(parse_args([*mode, "--train-iters", "3", "--snake-profile-iters",
                                      "1", "--snake-offload-dir", str(offload_dir)]))
    assert len(losses) == 3
    warned = [r.getMessage() for r in caplog.records if "was not written" in r.getMessage()]
    name = "activation_plan_rank0.json" if planner == "activation" else \
        "saved_tensor_plan_rank0.json"
    assert len(warned) == 1 and f"was not written to {offload_dir / name}" in warned[0] \
        and "training goes on with the plan in memory" in warned[0], warned
    assert (offload_dir / name).is_dir()
