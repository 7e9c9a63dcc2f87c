"""Corruption on disk is detected and named, never returned: a flipped bit in a payload or
a record header, a truncated swap file, a record overwritten by another key's record."""

import os

import pytest
import torch

from megatron_snake.storage import IntegrityError, TensorStore
from megatron_snake.storage.engine import native_available
from megatron_snake.storage.swap_file import FILE_MAGIC, FORMAT_VERSION, read_file_header

BUF = 64 << 10
ENGINES = ["python"] + (["uring"] if native_available() else [])


def flip_bit(path, offset, bit=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture(params=ENGINES)
def store(request, tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF,
                     engine=request.param) as s:
        yield s


@pytest.mark.parametrize("where", ["payload start", "payload end", "header length", "header seq"])
def test_flipped_bit_is_an_integrity_error(store, where):
    key = ("layer", 7, "w")
    t = torch.randn(3 * BUF // 4)                     # 3+ records
    store.put(key, t, tier="nvme").wait()
    recs = store.location(key)
    path, off, _ = recs[1]
    pos = {"payload start": off + 64, "payload end": off + 64 + BUF - 64 - 1,
           "header length": off + 48, "header seq": off + 32}[where]
    flip_bit(path, pos, bit=3)
    with pytest.raises(IntegrityError) as ei:
        store.get(key).wait()
    msg = str(ei.value)
    assert repr(key) in msg and path in msg and "NOT returned" in msg
    # the other keys are still fine
    store.put("other", t, tier="nvme").wait()
    assert torch.equal(store.get("other").wait(), t)


def test_truncated_file_is_an_integrity_error(store):
    t = torch.randn(3 * BUF // 4)
    store.put("a", t, tier="nvme").wait()
    path, off, _ = store.location("a")[-1]
    os.truncate(path, off + 100)
    with pytest.raises(IntegrityError) as ei:
        store.get("a").wait()
    msg = str(ei.value)
    assert "'a'" in msg and path in msg and "truncated" in msg


def test_prefetch_to_host_verifies_too(store):
    t = torch.randn(BUF // 8)
    store.put("p", t, tier="nvme").wait()
    path, off, _ = store.location("p")[0]
    flip_bit(path, off + 200)
    with pytest.raises(IntegrityError, match="'p'"):
        store.prefetch("p", "host").wait()
    assert store.pool.resident == 0                    # buffers of the failed prefetch returned


def test_record_of_another_key_is_not_accepted(store):
    a, b = torch.full((1000,), 1.0), torch.full((1000,), 2.0)
    store.put("a", a, tier="nvme").wait()
    store.put("b", b, tier="nvme").wait()
    (pa, oa, la), = store.location("a")
    (pb, ob, lb), = store.location("b")
    with open(pa, "r+b") as f:                         # b's record copied over a's
        f.seek(ob)
        rec = f.read(lb)
        f.seek(oa)
        f.write(rec)
    with pytest.raises(IntegrityError, match="another key"):
        store.get("a").wait()


def test_swap_file_header_has_format_version(store):
    store.put("x", torch.ones(10), tier="nvme", kind="optim").wait()
    path = store.location("x")[0][0]
    assert path.endswith("optim.swap")
    with open(path, "rb") as f:
        assert f.read(8) == FILE_MAGIC
    hdr = read_file_header(path)
    assert hdr["version"] == FORMAT_VERSION and hdr["kind"] == "optim" and hdr["pid"] == os.getpid()
    assert hdr["block_size"] % 4096 == 0 and hdr["checksum"] in ("crc32c", "crc32")
