"""The I/O engines (native io_uring, native thread pool, pure-Python fallback): data lands
where it should, errors carry path/offset/length/errno, short reads are reported, the
fallback is chosen automatically with a log line, and the checksum is the standard one."""

import ctypes
import errno
import logging
import mmap
import os
import zlib

import pytest

from megatron_snake.storage import engine as engine_mod
from megatron_snake.storage.engine import make_engine, native_available
from megatron_snake.storage.errors import OffloadIOError
from megatron_snake.storage.swap_file import Checksum, open_direct

KINDS = ["python"] + (["uring", "threads"] if native_available() else [])


def buffer(n, fill=None):
    m = mmap.mmap(-1, n)                       # page aligned, as O_DIRECT wants
    if fill is not None:
        m.write(fill)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


@pytest.mark.parametrize("kind", KINDS)
def test_write_read_at_offsets(kind, tmp_path):
    eng = make_engine(kind, queue_depth=4, threads=2, chunk_bytes=64 << 10)
    path = str(tmp_path / "f")
    fd, direct = open_direct(path)
    try:
        n = 3 << 20
        data = os.urandom(n)
        src, saddr = buffer(n, data)
        reqs = [eng.write(fd, path, saddr + i * (1 << 20), 1 << 20, 4096 + i * (1 << 20)) for i in range(3)]
        for r in reqs:
            r.wait()
            assert r.done()
        dst, daddr = buffer(n)
        eng.read(fd, path, daddr, n, 4096).wait()
        assert dst[:] == data
    finally:
        os.close(fd)
        eng.close()


@pytest.mark.parametrize("kind", KINDS)
def test_errors_name_path_offset_length_errno(kind, tmp_path):
    eng = make_engine(kind, queue_depth=4, threads=2)
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        _, addr = buffer(8192)
        with pytest.raises(OffloadIOError) as ei:
            eng.write(fd, path, addr, 8192, 12288).wait()   # fd opened read-only
        err = ei.value
        assert err.errno == errno.EBADF and err.path == path
        assert err.offset == 12288 and err.length == 8192
        msg = str(err)
        assert path in msg and "12288" in msg and "8192" in msg and "errno 9" in msg
        with pytest.raises(OffloadIOError) as ei:            # empty file: end of file
            eng.read(fd, path, addr, 4096, 0).wait()
        assert ei.value.short and "truncated" in str(ei.value)
    finally:
        os.close(fd)
        eng.close()


def test_python_fallback_is_automatic_and_logged(monkeypatch, caplog):
    monkeypatch.setattr(engine_mod, "_native", None)
    monkeypatch.setattr(engine_mod, "_NATIVE_IMPORT_ERROR", ImportError("not built"))
    with caplog.at_level(logging.INFO, logger="megatron_snake.storage"):
        eng = make_engine("auto")
    assert eng.name == "python"
    assert "pure-Python fallback" in caplog.text
    eng.close()
    with pytest.raises(RuntimeError, match="liburing-dev"):
        make_engine("native")


@pytest.mark.skipif(not native_available(), reason="native engine not built")
def test_native_engine_is_picked_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_snake.storage"):
        eng = make_engine("auto")
    assert eng.name.startswith("native-") and "native" in caplog.text
    eng.close()


def test_checksums_are_the_standard_ones():
    data = b"123456789"
    _, addr = buffer(4096, data)
    assert Checksum("crc32")(addr, 9) == zlib.crc32(data) == 0xCBF43926
    if native_available():
        assert Checksum("crc32c")(addr, 9) == 0xE3069283   # the crc32c check value
        assert Checksum().name == "crc32c"


def test_gds_without_gpu_falls_back_with_a_log_line(tmp_path, caplog):
    import torch

    from megatron_snake.storage import TensorStore

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU fallback")
    with caplog.at_level(logging.INFO, logger="megatron_snake.storage"):
        with TensorStore(tmp_path, host_memory_limit=16 << 20, buffer_bytes=1 << 20,
                         engine="gds") as s:
            assert s.gds is None
            t = torch.arange(1000)
            s.put("a", t, tier="nvme").wait()
            assert torch.equal(s.get("a").wait(), t)
    assert "gds" in caplog.text and "no GPU" in caplog.text
