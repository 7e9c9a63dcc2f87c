"""One rank's drive tier striped over several directories (``--snake-offload-dir a,b``):
records round-trip bit-exact with their segments on every directory, each directory is a
full rank directory (its own lock, its own files), and a directory that fails or fills is
the one named, with the records on the others still readable. Plain temporary
directories: these run everywhere (tests/test_striped_drives_throttled.py runs two
throttled loop devices where the machine allows it)."""

import errno
import os

import pytest
import torch

from megatron_snake.storage import TensorStore
from megatron_snake.storage.engine import native_available
from megatron_snake.storage.errors import CapacityError, OffloadDirError, OffloadIOError
from megatron_snake.storage.swap_file import REC_MAGIC

ENGINES = ["python"] + (["uring", "threads"] if native_available() else [])
BUF = 64 << 10        # host buffers of 64 KiB: a 1 MiB record is 17 segments


@pytest.fixture
def dirs(tmp_path):
    made = [tmp_path / "a", tmp_path / "b"]
    for d in made:
        d.mkdir()
    return made


def _values(gen):
    """A record of many segments, one of a single segment, one not a multiple of anything."""
    return {"big": torch.randn(1 << 18, generator=gen),                 # 1 MiB
            "small": torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=gen),
            "odd": torch.randn(3, 7919, generator=gen).to(torch.bfloat16)}


def _used(store, d):
    """Bytes the records hold in directory ``d``'s swap files."""
    drive, = (x for x in store._drive.drives if x.dir.root == str(d))
    return sum(f.used for f in drive.files.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_records_round_trip_over_both_directories(dirs, engine):
    gen = torch.Generator().manual_seed(0)
    values = _values(gen)
    with TensorStore(dirs, engine=engine, host_memory_limit=32 * BUF, buffer_bytes=BUF) as s:
        assert [d.root for d in s.dirs] == [str(d) for d in dirs]
        s.put("big", values["big"], tier="nvme").wait()   # alone: its placement is its own
        for key, v in values.items():
            if key != "big":
                s.put(key, v, tier="nvme")
        for key, v in values.items():
            got = s.get(key).wait()
            assert torch.equal(got.view(torch.uint8), v.view(torch.uint8)), key
        # the large record's consecutive segments alternate between the drives
        paths = [os.path.dirname(p) for p, _, _ in s.location("big")]
        assert len(paths) == 17 and set(paths) == {str(d / "rank0") for d in dirs}
        assert all(a != b for a, b in zip(paths, paths[1:])), paths
        # each extent is a record of ours where location says it is
        for path, off, length in s.location("big"):
            with open(path, "rb") as f:
                f.seek(off)
                assert f.read(len(REC_MAGIC)) == REC_MAGIC
        a, b = (_used(s, d) for d in dirs)
        assert a > 0 and b > 0 and abs(a - b) <= BUF + 4096, (a, b)
        # through the host tier (read into host buffers, lent in place, given back)
        s.prefetch("big", tier="host").wait()
        lent = s.borrow("big").wait()
        for seg in lent:
            seg.mul_(2)
        s.give_back("big", tier="nvme").wait()
        assert torch.equal(s.get("big").wait(), values["big"] * 2)
        assert "over 2 drives" in s.summary()
        s.delete("big").wait()
        s.delete("small").wait()
        s.delete("odd").wait()
        assert _used(s, dirs[0]) == _used(s, dirs[1]) == 0
    assert not any((d / "rank0").exists() for d in dirs)     # both removed at close


@pytest.mark.parametrize("sizes", [
    [3 * BUF // 2] * 20,                 # as many segments as drives, the last one short
    [BUF - 4096, 4096] * 20,             # one-segment records, large and small in turn
])
def test_the_drives_hold_the_same_bytes_within_a_segment(dirs, sizes):
    """Whatever the records' sizes, each drive ends up within one segment of the others:
    the equal shares the space checks reserve hold."""
    with TensorStore(dirs, host_memory_limit=32 * BUF, buffer_bytes=BUF) as s:
        for i, n in enumerate(sizes):
            s.put(("r", i), torch.zeros(n, dtype=torch.uint8), tier="nvme").wait()
        a, b = (_used(s, d) for d in dirs)
        assert abs(a - b) <= BUF, (a, b)


def test_one_directory_in_a_list_is_the_single_directory(tmp_path):
    with TensorStore([tmp_path], host_memory_limit=8 * BUF, buffer_bytes=BUF) as s:
        s.put("x", torch.arange(40000), tier="nvme")
        assert {os.path.dirname(p) for p, _, _ in s.location("x")} == {str(tmp_path / "rank0")}
        assert "drives" not in s.summary()


def test_each_directory_is_locked_for_the_run(dirs):
    with TensorStore(dirs, host_memory_limit=8 * BUF, buffer_bytes=BUF):
        assert all((d / "rank0" / "LOCK").is_file() for d in dirs)
        with pytest.raises(OffloadDirError, match=f"{dirs[1] / 'rank0'} is in use by another job"):
            TensorStore([dirs[1]], host_memory_limit=8 * BUF, buffer_bytes=BUF)


def test_a_missing_directory_is_named_and_the_others_are_released(dirs, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(OffloadDirError, match=f"--snake-offload-dir {missing} does not exist"):
        TensorStore(dirs + [missing], host_memory_limit=8 * BUF, buffer_bytes=BUF)
    assert not any((d / "rank0").exists() for d in dirs)      # locks released, dirs removed


@pytest.mark.parametrize("other", ["dot", "trailing slash", "dot-dot", "relative", "link"])
def test_a_directory_given_twice_is_refused(dirs, other, monkeypatch):
    """The same directory as ``/.``, with a trailing ``/``, through ``..``, as a relative
    path or through a symbolic link."""
    monkeypatch.chdir(dirs[0].parent)
    if other == "link":
        os.symlink(dirs[0], dirs[0].parent / "link")
    again = {"dot": f"{dirs[0]}/.", "trailing slash": f"{dirs[0]}/",
             "dot-dot": f"{dirs[1]}/../{dirs[0].name}", "relative": dirs[0].name,
             "link": str(dirs[0].parent / "link")}[other]
    with pytest.raises(OffloadDirError, match="names one directory more than once"):
        TensorStore([dirs[0], dirs[1], again], host_memory_limit=8 * BUF, buffer_bytes=BUF)
    assert not any((d / "rank0").exists() for d in dirs)


def test_the_same_directory_through_a_bind_mount_is_named_twice(dirs, tmp_path):
    """A bind mount of a directory has another real path but the same device and inode:
    refused as named twice, before any lock (it was "in use by another job", naming this
    run's own pid); and were a lock taken twice, it says so too."""
    import subprocess

    from megatron_snake.storage.directory import RankDir
    from megatron_snake.training.offloaded_state import offload_dirs_for_rank

    bound = tmp_path / "bound"
    bound.mkdir()
    if subprocess.run(["mount", "--bind", str(dirs[0]), str(bound)],
                      capture_output=True).returncode:
        pytest.skip("mount --bind not permitted here")
    try:
        with pytest.raises(OffloadDirError, match=f"more than once .*{bound}: named twice"):
            TensorStore([dirs[0], bound], host_memory_limit=8 * BUF, buffer_bytes=BUF)
        assert not (dirs[0] / "rank0").exists()
        with pytest.raises(ValueError, match="named twice"):
            offload_dirs_for_rank(f"{dirs[0]},{bound}", 0)
        first = RankDir(dirs[0], 0, b"r" * 16)
        try:
            with pytest.raises(OffloadDirError, match="locked by this run itself.*named "
                               "twice") as caught:
                RankDir(bound, 0, b"r" * 16)
            assert "another job" not in str(caught.value)
        finally:
            first.close()
    finally:
        subprocess.run(["umount", "-l", str(bound)], capture_output=True)


@pytest.fixture
def two_drives(monkeypatch):
    """The temporary directories as if each were on a drive of its own (they share this
    machine's one file system, whose free space the checks would otherwise split)."""
    from megatron_snake.storage import directory

    monkeypatch.setattr(directory, "file_system_groups",
                        lambda paths: [[i] for i in range(len(paths))])


def test_the_capacity_check_names_the_directory_without_room(dirs, two_drives):
    free = {str(dirs[0] / "rank0"): 1 << 40, str(dirs[1] / "rank0"): 500 << 20}
    with TensorStore(dirs, host_memory_limit=8 * BUF, buffer_bytes=BUF,
                     free_space_probe=free.__getitem__) as s:
        s.check_capacity(200 << 20)           # 100 MiB each (+ margin): both have room
        with pytest.raises(CapacityError) as exc:
            s.check_capacity(2 << 30)         # 1 GiB each: only the first has room
        assert str(exc.value).startswith(f"--snake-offload-dir {dirs[1]} (rank 0)")
        assert s._drive.capacity() == 2 * (500 << 20)   # equal shares: the smaller bounds


def test_directories_on_one_file_system_are_checked_together(dirs):
    """Two directories of one drive share its free space: shares that each fit it alone
    but not together are refused, and the tier's capacity is that space once."""
    with TensorStore(dirs, host_memory_limit=8 * BUF, buffer_bytes=BUF,
                     free_space_probe=lambda path: 1 << 30) as s:
        # the margin: 5% + 256 MiB of what a file system takes
        s.check_capacity(600 << 20)           # 300 MiB each: together 886 MiB fit
        with pytest.raises(CapacityError):
            s.check_capacity(1200 << 20)      # 600 MiB each: 886 MiB alone, 1516 together
        assert s._drive.capacity() == 1 << 30


def _failing_in(monkeypatch, directory, fn_name, err):
    """Make ``os.<fn_name>(fd, ...)`` fail with ``err`` for files under ``directory``."""
    real = getattr(os, fn_name)

    def fn(fd, *args):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory) + os.sep):
            raise OSError(err, os.strerror(err))
        return real(fd, *args)

    monkeypatch.setattr(os, fn_name, fn)


def test_a_full_drive_is_named_and_the_other_records_stay(dirs, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    values = _values(gen)
    with TensorStore(dirs, host_memory_limit=32 * BUF, buffer_bytes=BUF) as s:
        for key, v in values.items():
            s.put(key, v, tier="nvme").wait()
        _failing_in(monkeypatch, dirs[1], "posix_fallocate", errno.ENOSPC)
        # larger than the files' first growth step: the file on the second drive must grow
        with pytest.raises(CapacityError) as exc:
            s.put("huge", torch.zeros(136 << 20, dtype=torch.uint8), tier="nvme").wait()
        assert str(exc.value).startswith(f"{dirs[1] / 'rank0' / 'misc.swap'}: no space left")
        monkeypatch.undo()
        for key, v in values.items():
            assert torch.equal(s.get(key).wait().view(torch.uint8), v.view(torch.uint8))


def test_a_failing_drive_is_named_and_the_other_records_stay(dirs, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    values = _values(gen)
    # the pure-Python engine writes with os.pwritev, where the fault is injected
    with TensorStore(dirs, engine="python", host_memory_limit=32 * BUF, buffer_bytes=BUF) as s:
        for key, v in values.items():
            s.put(key, v, tier="nvme").wait()
        _failing_in(monkeypatch, dirs[0], "pwritev", errno.EIO)
        with pytest.raises(OffloadIOError) as exc:
            s.put("more", torch.randn(1 << 18, generator=gen), tier="nvme").wait()
        assert f"of {dirs[0] / 'rank0' / 'misc.swap'} failed: Input/output error" \
            in str(exc.value)
        monkeypatch.undo()
        for key, v in values.items():
            assert torch.equal(s.get(key).wait().view(torch.uint8), v.view(torch.uint8))
        before = _used(s, dirs[0]) + _used(s, dirs[1])
        s.delete("more").wait()       # the failed write's extents were freed, on both drives
        assert _used(s, dirs[0]) + _used(s, dirs[1]) == before


# ---------------------------------------------------------------- the flag

def _parse(*flags):
    from megatron_snake.training.arguments import parse_args

    return parse_args(["--snake-offload", *flags])


def test_the_flag_takes_a_comma_separated_list_of_templates(monkeypatch):
    from megatron_snake.training.offloaded_state import offload_dirs_for_rank

    monkeypatch.setenv("LOCAL_RANK", "1")
    args = _parse("--snake-offload-dir", "/nvme0/off/{local_rank},/nvme1/off/r{rank}")
    assert offload_dirs_for_rank(args.snake_offload_dir, 5) == ["/nvme0/off/1", "/nvme1/off/r5"]


@pytest.mark.parametrize("value, why", [
    ("/nvme0/a,,/nvme1/a", "has an empty entry"),
    ("/nvme0/a,", "has an empty entry"),
    ("/nvme0/a,/nvme1/a,/nvme0/a/", "names one directory more than once (/nvme0/a, /nvme0/a/)"),
])
def test_the_flag_refuses_an_empty_or_repeated_entry_in_one_line(value, why, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("--snake-offload-dir", value)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.startswith(f"pretrain_gpt.py: error: --snake-offload-dir {value!r} {why}"), err
    assert err.count("\n") == 1, err


def test_a_directory_repeated_once_filled_in_is_refused_naming_the_flag(monkeypatch):
    from megatron_snake.errors import FlagError
    from megatron_snake.training.offloaded_state import offload_dirs_for_rank

    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(FlagError, match=r"^--snake-offload-dir '/n/\{local_rank\},/n/0': rank 0 "
                       r"gets one directory more than once \(/n/0, /n/0: named twice"):
        offload_dirs_for_rank("/n/{local_rank},/n/0", 0)


def test_the_preflight_has_a_line_and_a_check_for_each_directory(dirs, two_drives):
    from megatron_snake.training import preflight
    from megatron_snake.storage.sizes import size

    args = _parse("--snake-offload-dir", ",".join(map(str, dirs)))
    pf = preflight.estimate(args, 384)
    assert pf.offload_paths == tuple(map(str, dirs))
    share = -(-pf.drive_striped // 2) + pf.buffer_bytes
    assert [pf.drive_planned_in(i) for i in range(2)] == [share, share]
    lines = pf.summary([1 << 40, 1 << 20]).splitlines()
    drive = [x for x in lines if x.startswith("> pre-flight drive")]
    assert [x.split(":")[0] for x in drive] == [
        f"> pre-flight drive {i + 1} of 2, --snake-offload-dir {d}" for i, d in enumerate(dirs)]
    assert all(f"{size(share)} planned (a 1/2 share of the striped" in x for x in drive)
    with pytest.raises(CapacityError) as exc:
        preflight.check(pf, args, [1 << 40, 1 << 20])     # the second has 1 MiB free
    assert str(exc.value).startswith(f"--snake-offload-dir {dirs[1]}: the run needs "
                                     f"{size(pf.drive_needed_in(1))} of drive space there")
    preflight.check(pf, args, [1 << 40, 1 << 40])


def test_the_preflight_checks_directories_on_one_file_system_together(dirs):
    from megatron_snake.training import preflight

    args = _parse("--snake-offload-dir", ",".join(map(str, dirs)))
    pf = preflight.estimate(args, 384)
    each, both = pf.drive_needed_in(0), pf.drive_needed_in(0) + pf.drive_needed_in(1)
    free = (each + both) // 2          # room for either share, not for both
    with pytest.raises(CapacityError) as exc:
        preflight.check(pf, args, [free, free])
    assert str(exc.value).count("--snake-offload-dir") == 2, str(exc.value)   # one error
    assert f"on its file system, with {dirs[1]}'s" in str(exc.value)
    preflight.check(pf, args, [both, both])


def test_the_save_checkpoints_count_on_their_own_file_system_alone(dirs, two_drives):
    """What ``also`` adds (the --save checkpoints) lands on one directory's file system:
    checked there, not spread over the drives."""
    free = {str(dirs[0] / "rank0"): 1 << 30, str(dirs[1] / "rank0"): 1 << 30}
    with TensorStore(dirs, host_memory_limit=8 * BUF, buffer_bytes=BUF,
                     free_space_probe=free.__getitem__) as s:
        # 600 MiB of checkpoints: spread, 300 MiB each would fit beside 200 MiB each
        s.check_capacity(400 << 20)
        with pytest.raises(CapacityError) as exc:
            s.check_capacity(400 << 20, {str(dirs[1] / "rank0"): 600 << 20})
        assert str(exc.value).startswith(f"--snake-offload-dir {dirs[1]} (rank 0)")
        s.check_capacity(400 << 20, {str(dirs[1] / "rank0"): 400 << 20})
