"""The offload directory: bad paths, free space, a second job, a killed job.

Where a real condition can be built here it is: a small tmpfs and a read-only bind mount
need root and a kernel that allows mounts (true in this project's CI container); without
them those two cases use the injected probes (free_space_probe / write_probe) and say so.
"""

import contextlib
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megatron_snake.storage import CapacityError, OffloadDirError, TensorStore

BUF = 64 << 10
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_store(path, rank=0, **kw):
    return TensorStore(path, rank=rank, host_memory_limit=16 * BUF, buffer_bytes=BUF, **kw)


@contextlib.contextmanager
def mounted(*mount_args, target):
    """Mount (root only); yields False when mounting is not permitted here."""
    os.makedirs(target, exist_ok=True)
    ok = subprocess.run(["mount", *mount_args, target], capture_output=True).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", target], capture_output=True)


# ------------------------------------------------------------------ bad paths

def test_missing_dir(tmp_path):
    with pytest.raises(OffloadDirError, match="--snake-offload-dir .*does not exist"):
        small_store(tmp_path / "nope")


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OffloadDirError, match="is not a directory"):
        small_store(f)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "rank0").write_text("x")        # rank dir path taken by a file
    with pytest.raises(OffloadDirError, match="rank0 exists and is not a directory"):
        small_store(tmp_path / "d")


def test_read_only_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "rank0").mkdir()
    ro = tmp_path / "ro"
    with mounted("--bind", str(src), target=str(ro)) as ok:
        if ok and subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)],
                                 capture_output=True).returncode == 0:
            # real: a read-only bind mount (chmod 0500 would not stop root)
            with pytest.raises(OffloadDirError, match="not writable"):
                small_store(ro)
            with pytest.raises(OffloadDirError, match="writable"):
                small_store(ro, rank=1)                # rank1 cannot even be created
            return

    # simulated: mounts not permitted; the write probe reports EROFS as the kernel would
    def read_only(path):
        raise OSError(30, "Read-only file system")

    with pytest.raises(OffloadDirError, match="not writable"):
        small_store(src, write_probe=read_only)


def permission_checked_prefix():
    """A command prefix whose process is held to file modes: none for a normal user; for
    root (whom chmod 0500 does not stop) setpriv without the capabilities that bypass them
    (an unprivileged user such as nobody cannot reach this Python under /root here)."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    try:
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    except FileNotFoundError:
        pass
    pytest.skip("root, and setpriv cannot drop CAP_DAC_OVERRIDE here: chmod would not stop "
                "this process; test_files_left_at_close_* injects the failure instead")


CHMOD_BEFORE_CLOSE = textwrap.dedent("""
    import os, runpy, sys
    sys.path.insert(0, {repo!r})
    from megatron_snake.storage.store import TensorStore
    close = TensorStore.close

    def chmod_then_close(self, *args, **kwargs):
        os.chmod(self.dir.path, 0o500)   # the user's chmod, after the last step
        return close(self, *args, **kwargs)

    TensorStore.close = chmod_then_close
    sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
    runpy.run_path(os.path.join({repo!r}, "examples", "pretrain_gpt.py"), run_name="__main__")
""")


def test_rank_dir_made_read_only_during_the_run_fails_at_close_naming_the_files(tmp_path):
    """chmod 0500 on rank0 while training: the run finishes its steps, then its end says
    which files it could not remove and why, and exits non-zero (it raised a bare
    PermissionError from the first swap file and left the lock and the pool open)."""
    prefix = permission_checked_prefix()
    code = CHMOD_BEFORE_CLOSE.format(repo=REPO)
    rank0 = tmp_path / "rank0"
    p = subprocess.run([*prefix, sys.executable, "-c", code, "--snake-offload",
                        "--snake-offload-dir", str(tmp_path), "--train-iters", "2",
                        "--num-layers", "2", "--hidden-size", "32", "--log-interval", "1"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert p.returncode != 0
        assert "iteration        2/       2" in p.stdout, p.stdout[-2000:]
        left = sorted(os.listdir(rank0))
        assert "LOCK" in left and len(left) > 1, left
        error = [line for line in p.stderr.splitlines() if "error:" in line]
        assert len(error) == 1 and error[0].startswith("pretrain_gpt.py: error: "), \
            p.stderr[-3000:]
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        assert f"{rank0}: {len(left)} file(s) of this run" in error[0], error[0]
        assert "(permission denied)" in error[0] and "chmod 0700" in error[0], error[0]
        assert all(f" {name} (" in error[0] for name in left), (left, error[0])
        assert "PermissionError" not in p.stderr, p.stderr[-3000:]
    finally:
        os.chmod(rank0, 0o700)


def test_files_left_at_close_do_not_hide_the_error_that_ended_the_run(tmp_path, monkeypatch,
                                                                     caplog):
    """Removal refused (injected at unlink): after a clean run one OffloadDirError names
    the files; after a failing one, the run's own error is raised and the files are logged."""
    from megatron_snake.storage import swap_file

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    def run(path, then=lambda store: None):
        path.mkdir()
        with small_store(path) as s:
            s.put("a", torch.ones(10), tier="nvme").wait()
            monkeypatch.setattr(swap_file.os, "unlink", denied)   # os.unlink, everywhere
            then(s)

    with pytest.raises(OffloadDirError, match=r"2 file\(s\) of this run.*\(permission "
                       r"denied\): misc.swap \(64.0 MiB\), LOCK \(\d+ bytes\)"):
        run(tmp_path / "clean")
    monkeypatch.undo()
    with caplog.at_level(logging.ERROR, logger="megatron_snake.storage"):
        with pytest.raises(KeyError, match="no key 'missing'"):
            run(tmp_path / "failing", then=lambda store: store.get("missing"))
    assert "could not be removed" in caplog.text and "misc.swap" in caplog.text


def test_rank_dir_mode_and_cleanup(tmp_path):
    with small_store(tmp_path) as s:
        rank_dir = tmp_path / "rank0"
        assert stat.S_IMODE(os.stat(rank_dir).st_mode) == 0o700
        s.put("a", torch.ones(100000), tier="nvme").wait()
        s.put("b", torch.ones(10), tier="nvme", kind="grad").wait()
        assert sorted(os.listdir(rank_dir)) == ["LOCK", "grad.swap", "misc.swap"]
    assert not rank_dir.exists()                     # clean exit: everything removed


# ------------------------------------------------------------------ capacity

def test_capacity_check_injected_probe(tmp_path):
    free = 10 << 30
    with small_store(tmp_path, free_space_probe=lambda p: free) as s:
        s.check_capacity(8 << 30)
        with pytest.raises(CapacityError) as ei:
            s.check_capacity(12 << 30)
        msg = str(ei.value)
        assert "--snake-offload-dir" in msg and "12.00 GiB" in msg and "10.00 GiB is free" in msg
        assert "needs 12.85 GiB" in msg                     # 12 GiB + 5% + 256 MiB


def test_capacity_real_small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    with mounted("-t", "tmpfs", "-o", "size=4m", "tmpfs", target=str(mnt)) as ok:
        if not ok:
            pytest.skip("mount not permitted here; covered by the injected-probe test")
        with small_store(mnt) as s:
            with pytest.raises(CapacityError, match="free on that file system"):
                s.check_capacity(64 << 20)
            # the plan was wrong and the drive fills up anyway: a clear error, not ENOSPC
            with pytest.raises(CapacityError, match="no space left"):
                s.put("big", torch.zeros(2 << 20), tier="nvme").wait()   # 8 MiB > 4 MiB
            s.put("small", torch.arange(1000.0), tier="nvme").wait()
            assert torch.equal(s.get("small").wait(), torch.arange(1000.0))


@pytest.mark.parametrize("inodes, doing", [
    (1, "making {mnt}/rank0"), (2, "creating a file in {mnt}/rank0"),
    (3, r"creating {mnt}/rank0/misc\.swap"), (4, r"creating {mnt}/rank0/grad\.swap")])
def test_a_drive_out_of_inodes_at_start_is_one_error_naming_it(tmp_path, inodes, doing):
    """Every entry the store makes at start on a tmpfs without inodes to spare: the rank
    directory, the write probe, a swap file (the first: the root, rank0 and LOCK take the
    three inodes; the second with four). One CapacityError names the directory and what
    ran out, and nothing of the run is left (raw ENOSPC tracebacks before)."""
    mnt = tmp_path / "tmpfs"
    with mounted("-t", "tmpfs", "-o", f"size=4m,nr_inodes={inodes}", "tmpfs",
                 target=str(mnt)) as ok:
        if not ok:
            pytest.skip("mount not permitted here")
        with pytest.raises(CapacityError, match=rf"^--snake-offload-dir {mnt} \(rank 0\): the "
                           rf"drive is full \(out of inodes\) {doing.format(mnt=mnt)}; free "
                           "space on it, or point --snake-offload-dir at another drive$"):
            with small_store(mnt) as s:
                s.put("a", torch.ones(10), tier="nvme").wait()
                s.put("b", torch.ones(10), tier="nvme", kind="grad").wait()
        assert os.listdir(mnt) == []


def test_a_drive_full_before_the_lock_is_written_leaves_no_lock(tmp_path):
    """Blocks gone, inodes left: the lock file is made but cannot be written; one error
    names it, and neither the empty LOCK nor rank0 stays behind."""
    mnt = tmp_path / "tmpfs"
    with mounted("-t", "tmpfs", "-o", "size=64k", "tmpfs", target=str(mnt)) as ok:
        if not ok:
            pytest.skip("mount not permitted here")
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError):
            while True:
                os.write(fd, b"x" * 4096)
        os.close(fd)
        with pytest.raises(CapacityError, match=rf"^--snake-offload-dir {mnt} \(rank 0\): the "
                           rf"drive is full \(no space left\) writing {mnt}/rank0/LOCK; "):
            small_store(mnt)
        assert os.listdir(mnt) == ["filler"]


def test_a_full_drive_at_the_start_of_a_run_is_one_line(megatron_world, tmp_path):
    """pretrain on a drive with room for the bytes but not the files: a CapacityError (one
    line, no traceback at the entry point) naming the directory, before the first step."""
    from conftest import tiny_args
    from megatron_snake.errors import UserError
    from megatron_snake.training.loop import pretrain

    mnt = tmp_path / "tmpfs"
    with mounted("-t", "tmpfs", "-o", "size=300m,nr_inodes=4", "tmpfs", target=str(mnt)) as ok:
        if not ok:
            pytest.skip("mount not permitted here")
        with pytest.raises(CapacityError) as caught:
            pretrain(tiny_args("--snake-offload", "--snake-offload-dir", str(mnt),
                               "--train-iters", "1"))
        assert isinstance(caught.value, UserError)
        assert f"--snake-offload-dir {mnt} (rank 0): the drive is full (out of inodes)" \
            in str(caught.value)
        assert os.listdir(mnt) == []


def test_a_directory_mounted_over_the_offload_dir_changes_nothing(tmp_path):
    """A read-only directory mounted over --snake-offload-dir while the store runs: the run
    goes on in its own directory (a new swap file included) and removes its files at the
    end (a new file raised FileNotFoundError, and the files were left hidden under the
    mount without a word)."""
    root, empty = tmp_path / "off", tmp_path / "empty"
    root.mkdir()
    empty.mkdir()
    with small_store(root) as s:
        s.put("a", torch.arange(1000.0), tier="nvme").wait()
        with mounted("--bind", "-o", "ro", str(empty), target=str(root)) as ok:
            if not ok:
                pytest.skip("mount not permitted here")
            s.put("b", torch.ones(10), tier="nvme", kind="grad").wait()
            assert torch.equal(s.get("a").wait(), torch.arange(1000.0))
            s.close()
            assert os.listdir(root) == []     # the mount's
    assert os.listdir(root) == []              # ours: rank0 removed under the mount


def test_rank_dir_removed_during_the_run(tmp_path):
    """``rm -rf rank0`` while the store runs: the records it wrote still read back (the
    run holds its files open), the end says nothing of files it could not remove (they
    are gone), and a swap file it would make there now is one error naming the directory
    (a raw FileNotFoundError before)."""
    import shutil

    with small_store(tmp_path) as s:
        s.put("a", torch.arange(1000.0), tier="nvme").wait()
        shutil.rmtree(tmp_path / "rank0")
        assert torch.equal(s.get("a").wait(), torch.arange(1000.0))
        s.put("b", torch.ones(10), tier="nvme").wait()            # its swap file: still open
        with pytest.raises(OffloadDirError, match=f"{tmp_path / 'rank0'} was removed during "
                           "the run, so its grad swap file cannot be made"):
            s.put("c", torch.ones(10), tier="nvme", kind="grad").wait()
    assert os.listdir(tmp_path) == []


def test_a_file_moved_away_during_the_run_is_named_at_the_end(tmp_path):
    """A swap file renamed away: its name is gone but the file is not; the end names it
    (the missing name was taken for a removed file, silently)."""
    with pytest.raises(OffloadDirError, match=r"could not be removed at its end \(moved away "
                       r"from its name during the run.*\): misc\.swap"):
        with small_store(tmp_path) as s:
            s.put("a", torch.ones(10), tier="nvme").wait()
            os.rename(tmp_path / "rank0" / "misc.swap", tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere").exists()


# ------------------------------------------------------------------ other jobs

HOLDER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {repo!r})
    from megatron_snake.storage import TensorStore
    s = TensorStore({path!r}, rank=0, host_memory_limit=16 * {buf}, buffer_bytes={buf})
    s.put("first", torch.ones(1000), tier="nvme").wait()
    print("ready", flush=True)
    i = 0
    while {write_forever}:
        s.put(("k", i % 50), torch.full(({buf} // 2,), float(i)), tier="nvme")
        i += 1
    sys.stdin.read()
    s.close()
""")


def spawn(path, write_forever):
    code = HOLDER.format(repo=REPO, path=str(path), buf=BUF, write_forever=write_forever)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_second_job_on_the_same_dir_fails_at_once(tmp_path):
    p = spawn(tmp_path, write_forever=False)
    try:
        t0 = time.perf_counter()
        with pytest.raises(OffloadDirError) as ei:
            small_store(tmp_path)
        assert time.perf_counter() - t0 < 2
        msg = str(ei.value)
        assert "in use by another job" in msg and f'"pid": {p.pid}' in msg
        assert small_store(tmp_path, rank=1).close() is None     # other ranks are free
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    assert p.returncode == 0
    assert not (tmp_path / "rank0").exists()          # the holder exited cleanly


def test_sigkill_mid_write_then_new_run(tmp_path, caplog):
    p = spawn(tmp_path, write_forever=True)
    time.sleep(0.5)                                    # writes in flight
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    rank_dir = tmp_path / "rank0"
    assert (rank_dir / "misc.swap").exists() and (rank_dir / "LOCK").exists()
    with caplog.at_level(logging.WARNING, logger="megatron_snake.storage"):
        s = small_store(tmp_path)
    with s:
        stale = [os.path.basename(path) for path, _, _ in s.dir.stale]
        assert "misc.swap" in stale and "LOCK" in stale
        assert "stale files" in caplog.text and "misc.swap" in caplog.text
        assert f"pid {p.pid}" in caplog.text           # the killed run is named
        assert s.keys() == []                           # nothing of the old run is visible
        with pytest.raises(KeyError):
            s.get("first")
        t = torch.randn(BUF)
        s.put("first", t, tier="nvme").wait()           # the directory works again
        assert torch.equal(s.get("first").wait(), t)
    assert not rank_dir.exists()


def test_no_o_direct_falls_back_to_buffered_with_a_log_line(tmp_path, monkeypatch, caplog):
    """tmpfs before Linux 6.6 (and some network file systems) reject O_DIRECT with EINVAL;
    simulated here because this kernel's tmpfs accepts it."""
    from megatron_snake.storage import swap_file

    real_open = os.open

    def no_direct(path, flags, mode=0o777, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(swap_file.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="megatron_snake.storage"):
        with small_store(tmp_path) as s:
            t = torch.randn(50000)
            s.put("a", t, tier="nvme").wait()
            assert torch.equal(s.get("a").wait(), t)
            assert "buffered" in s.summary()
    assert "does not support O_DIRECT" in caplog.text
