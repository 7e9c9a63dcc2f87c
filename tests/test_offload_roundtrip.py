"""Byte-exact round trips of every storable torch dtype and of 0-d, empty, non-contiguous
and odd-sized tensors, through every tier path, with every engine (native io_uring, native
thread pool, pure-Python fallback). CPU only: the `gpu` tier is the compute device (CPU)."""

import os
import threading
import warnings

import pytest
import torch

from megatron_snake.storage import TensorStore
from megatron_snake.storage.engine import native_available

ENGINES = ["python"] + (["uring", "threads"] if native_available() else [])
BUF = 64 << 10  # small host buffers: a 200 KiB tensor spans several records


def storable_dtypes():
    """Every dtype torch can hold as a plain strided tensor: all but the quantized ones
    (the store copies bits through a same-size integer view, so even dtypes without a copy
    kernel of their own, float4_e2m1fn_x2, bits*, int1..int7, round-trip)."""
    out = []
    warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
    for dt in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        if "qint" in str(dt) or "quint" in str(dt):
            continue
        try:
            torch.empty(3, dtype=dt).view(torch.uint8)
            out.append(dt)
        except Exception:  # noqa: BLE001
            pass
    return out


DTYPES = storable_dtypes()


def random_tensor(shape, dtype, gen):
    t = torch.empty(shape, dtype=dtype)
    raw = t.reshape(-1).view(torch.uint8)
    hi = 2 if dtype == torch.bool else 256
    raw.copy_(torch.randint(0, hi, (raw.numel(),), dtype=torch.uint8, generator=gen))
    return t


def cases(dtype, gen):
    """(name, tensor): 0-d, empty, odd-sized, multi-record, and non-contiguous tensors."""
    big = random_tensor((97, 61 * 8), dtype, gen)     # 47 KiB x itemsize: several records
    yield "0d", random_tensor((), dtype, gen)
    yield "empty", random_tensor((0, 3), dtype, gen)
    yield "odd", random_tensor((7, 13), dtype, gen)
    yield "multi", random_tensor((25013,), dtype, gen)
    yield "transposed", big.t()
    yield "strided", big[1::3, ::5]


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """Same-size integer view: copies of it are bit copies for every dtype (float4 has no
    copy kernel of its own)."""
    it = _INT.get(t.element_size())
    return t if it is None else t.view(it)


def as_bytes(t):
    return bits(t).contiguous().reshape(-1).view(torch.uint8)


def clone(t):
    return bits(t).clone().view(t.dtype)


def assert_same(got, want, what):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    assert torch.equal(as_bytes(got), as_bytes(want)), f"{what}: bytes differ"


# tier paths: how the value travels before it is read back
PATHS = {
    "gpu": lambda s, k: None,
    "host": lambda s, k: None,
    "nvme": lambda s, k: None,
    "nvme>prefetch host": lambda s, k: s.prefetch(k, "host").wait(),
    "nvme>prefetch gpu": lambda s, k: s.prefetch(k, "gpu").wait(),
    "host>evict nvme": lambda s, k: s.evict(k, "nvme").wait(),
    "gpu>evict host>evict nvme": lambda s, k: (s.evict(k, "host").wait(), s.evict(k, "nvme").wait()),
    "host>evict nvme>prefetch host": lambda s, k: (s.evict(k, "nvme").wait(), s.prefetch(k, "host").wait()),
}


@pytest.fixture(params=ENGINES)
def store(request, tmp_path):
    with TensorStore(tmp_path, rank=0, host_memory_limit=64 * BUF, buffer_bytes=BUF,
                     engine=request.param, workers=2) as s:
        yield s


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("path", list(PATHS))
def test_round_trip_every_dtype(store, path):
    gen = torch.Generator().manual_seed(0)
    first_tier = path.split(">")[0]
    for dtype in DTYPES:
        for name, t in cases(dtype, gen):
            key = (str(dtype), name)
            keep = clone(t)
            store.put(key, t, tier=first_tier).wait()
            PATHS[path](store, key)
            got = store.get(key).wait()
            assert_same(got, keep, f"{dtype} {name} via {path}")
            assert_same(t, keep, "put must not modify its source")
            store.delete(key).wait()
    assert store.keys() == []


def test_dtypes_cover_the_usual_ones():
    assert len(DTYPES) >= 20
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool,
               torch.complex64, torch.int64, torch.uint8, torch.uint64):
        assert dt in DTYPES


def test_get_into_out_dtype_device(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        t = torch.randn(300, 200)
        s.put("w", t, tier="nvme").wait()
        out = torch.empty(200, 300).t()                   # non-contiguous destination
        assert s.get("w", out=out).wait() is out
        assert torch.equal(out, t)
        half = s.get("w", dtype=torch.bfloat16).wait()
        assert half.dtype == torch.bfloat16 and torch.equal(half, t.to(torch.bfloat16))
        with pytest.raises(ValueError, match="shape"):
            s.get("w", out=torch.empty(3)).wait()


def test_tiers_move_and_replace(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        a, b = torch.arange(50000, dtype=torch.int32), torch.ones(10)
        s.put("k", a, tier="gpu")
        assert s.tiers("k") == ["gpu"]
        s.evict("k", "host").wait()
        assert s.tiers("k") == ["host"]
        s.prefetch("k", "nvme").wait()
        assert s.tiers("k") == ["host", "nvme"]
        s.evict("k", "nvme").wait()
        assert s.tiers("k") == ["nvme"]
        assert s.pool.resident == 0
        s.put("k", b, tier="host").wait()                 # replaces: nvme extents freed
        assert s.tiers("k") == ["host"] and torch.equal(s.get("k").wait(), b)
        assert sum(f.used for d in s._drive.drives for f in d.files.values()) == 0
        s.delete("k").wait()
        assert "k" not in s and s.pool.resident == 0
        with pytest.raises(KeyError, match="no key"):
            s.get("k")


def test_forwarding_serves_a_pending_put_from_memory(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF, workers=1) as s:
        gate = threading.Event()
        s._writers.submit(gate.wait)       # the only writer is busy: the put cannot start
        t = torch.randn(1000)
        h_put = s.put("x", t, tier="nvme")
        h_get = s.get("x")
        assert not h_put.done() and h_get.done()
        assert torch.equal(h_get.wait(), t)
        gate.set()
        h_put.wait()
        assert s.tiers("x") == ["nvme"] and torch.equal(s.get("x").wait(), t)


def test_synchronize_waits_for_deletes(tmp_path):
    """A delete's entry leaves the key table at once; synchronize() still waits until its
    host buffers and swap space are free."""
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF, workers=1) as s:
        s.put("h", torch.randn(50000), tier="host").wait()
        s.put("n", torch.randn(50000), tier="nvme").wait()
        gate = threading.Event()
        s._writers.submit(gate.wait)           # the only writer is busy: the deletes queue
        s.delete("h")
        s.delete("n")
        threading.Timer(0.2, gate.set).start()
        s.synchronize()
        assert s.pool.resident == 0 and s.pool.in_use == 0
        assert sum(f.used for d in s._drive.drives for f in d.files.values()) == 0


def test_a_read_result_is_freed_when_the_caller_drops_it(tmp_path):
    """The store keeps no reference to what get() returned (on a GPU that is device
    memory), even while the key stays."""
    import gc
    import weakref

    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        s.put("x", torch.randn(50000), tier="nvme").wait()
        got = s.get("x").wait()
        alive = weakref.ref(got)
        del got
        gc.collect()
        assert alive() is None
        assert "x" in s


def test_counters_and_summary(tmp_path, caplog):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        t = torch.randn(100000)                           # 400 KB
        s.put("a", t, tier="nvme").wait()
        s.get("a").wait()
        s.put("b", t, tier="host").wait()
        s.get("b").wait()
        c = s.counters
        assert c.written["nvme"] == c.read["nvme"] == 400000
        assert c.written["host"] == c.read["host"] == 400000
        assert c.requests >= 2 * (400000 // BUF) and c.max_queue_depth >= 1 and c.queue_depth == 0
        line = s.summary()
        assert "nvme r" in line and "blocked" in line and "qd" in line and "\n" not in line


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_and_sparse_are_refused(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
        with pytest.raises(TypeError, match="dense strided"):
            s.put("q", q)
        with pytest.raises(TypeError, match="dense strided"):
            s.put("sp", torch.eye(3).to_sparse())
        with pytest.raises(ValueError, match="unknown tier"):
            s.put("x", torch.ones(1), tier="ssd")


def test_a_read_issued_after_a_large_write_completes_before_it(tmp_path):
    """Reads have their own workers: the next unit's weights are never queued behind a
    background write of hundreds of MB (one worker each way, so a shared queue would run
    the write first)."""
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF, workers=1) as s:
        small = torch.randn(BUF // 8)
        s.put("next unit", small, tier="nvme").wait()
        # the write stays on the drive until the read is back (or 30 s, should the read
        # wait behind it): the order no longer depends on how fast 4 MiB is written
        written, write = threading.Event(), s._drive.write_bytes

        def held_write(e, *args, **kwargs):
            if e.key == "gradient":
                written.wait(timeout=30)
            return write(e, *args, **kwargs)

        s._drive.write_bytes = held_write
        done = []
        big = s.put("gradient", torch.randn(64 * BUF // 4), tier="nvme")   # 64 buffers
        big._future.add_done_callback(lambda _: done.append("write"))
        read = s.get("next unit")
        assert torch.equal(read.wait(), small)
        done.append("read")
        written.set()
        big.wait()
        assert done == ["read", "write"]



def test_a_write_into_memory_does_not_queue_behind_drive_writes(tmp_path):
    """A gradient leaving the device for host memory (the backward sweep waits for the
    previous one) has workers of its own: it never waits behind the updated optimizer
    state on its way to the drive (the drive writers are all busy here)."""
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF, workers=1) as s:
        released, write = threading.Event(), s._drive.write_bytes

        def held_write(e, *args, **kwargs):
            released.wait(timeout=30)
            return write(e, *args, **kwargs)

        s._drive.write_bytes = held_write
        state = s.put("updated state", torch.randn(BUF // 4), tier="nvme")
        gradient = torch.randn(BUF // 8)
        s.put("gradient", gradient, tier="host").wait()   # before the drive write is let go
        assert not state.done()
        released.set()
        state.wait()
        assert torch.equal(s.get("gradient").wait(), gradient)

# --- borrow: a value changed in place (the CPU optimizer's update) -----------------------
def _host_addresses(s, key):
    return [(buf.addr, buf.addr + buf.nbytes) for buf in s._entries[key].host]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_value_borrowed_from_host_is_changed_in_place_and_given_back_to_the_drive(
        tmp_path, engine):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF,
                     engine=engine) as s:
        t = torch.randn(40000)                       # 160 KB: three host buffers
        s.put("m", t, tier="nvme").wait()
        s.prefetch("m", "host").wait()               # read ahead: host and drive copies
        spans = _host_addresses(s, "m")
        pieces = s.borrow("m").wait()
        assert len(pieces) == 3 and sum(p.numel() for p in pieces) == t.numel()
        for p in pieces:                             # the host tier's own bytes: no copy
            assert any(a <= p.data_ptr() < b for a, b in spans)
        for p in pieces:
            p.mul_(2)
        with pytest.raises(RuntimeError, match="lent"):
            s.get("m")
        with pytest.raises(RuntimeError, match="lent"):
            s.put("m", t)
        s.give_back("m", tier="nvme").wait()
        assert s.tiers("m") == ["nvme"] and s.pool.resident == 0
        assert torch.equal(s.get("m").wait(), t * 2)   # read back from the drive, verified
        with pytest.raises(RuntimeError, match="not lent"):
            s.give_back("m")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_value_on_the_drive_is_read_into_host_buffers_and_lent_there(tmp_path, engine,
                                                                       monkeypatch):
    """With room in the pool, a borrow of a record on the drive reads it into host buffers
    as a prefetch would, lends their own bytes and writes them back: no copy either way."""
    import megatron_snake.storage.copies as copies_module

    copies = []
    real_copy = copies_module.copy_pairs     # every copy the store's tiers make
    monkeypatch.setattr(copies_module, "copy_pairs",
                        lambda stream, pairs: (copies.append(pairs), real_copy(stream, pairs)))
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF,
                     engine=engine) as s:
        t = torch.randn(40000)
        s.put("m", t, tier="nvme").wait()
        copies.clear()
        pieces = s.borrow("m").wait()
        spans = _host_addresses(s, "m")
        assert len(pieces) == 3
        for p in pieces:
            assert any(a <= p.data_ptr() < b for a, b in spans)
            p.mul_(3)
        s.give_back("m", tier="nvme").wait()
        assert copies == [] and s.pool.resident == 0 and s.tiers("m") == ["nvme"]
        assert torch.equal(s.get("m").wait(), t * 3)   # the new value, verified


def test_a_value_not_on_host_is_lent_as_a_copy_when_the_pool_has_no_room(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        t = torch.randn(40000)                       # three buffers
        s.put("m", t, tier="nvme").wait()
        s.put("h", t, tier="host").wait()
        s.put("fill", torch.randn(9 * 16000), tier="host").wait()   # 12 of 16 taken
        taken = s.pool.resident
        on_drive, on_host = s.borrow("m").wait(), s.borrow("h").wait()
        assert s.pool.resident == taken              # not read into host buffers: a copy
        # the same cut, so two records of one size pair up element by element
        assert [p.numel() for p in on_drive] == [p.numel() for p in on_host]
        for p in on_drive:
            p.add_(1)
        for p in on_host:
            p.sub_(1)
        s.delete("fill").wait()
        s.give_back("m", tier="host").wait()
        s.give_back("h", tier="host").wait()         # kept in place
        assert s.tiers("m") == ["host"] and s.tiers("h") == ["host"]
        assert torch.equal(s.get("m").wait(), t + 1)
        assert torch.equal(s.get("h").wait(), t - 1)
        s.evict("h", "nvme").wait()                  # sealed again: the checksum is the new
        assert torch.equal(s.get("h").wait(), t - 1)  # value's


def test_a_value_on_the_device_is_lent_on_the_host_as_a_copy_with_on_host(tmp_path):
    """``on_host`` (the CPU changes it): a device record is lent as a host copy, which
    ``give_back`` copies onto the device again (and ``lent_in_buffers`` tells apart from
    host buffers); without it the device tensor itself is lent."""
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        t = torch.randn(40000)
        s.put("d", t, tier="gpu").wait()
        device_tensor = s._entries["d"].gpu
        pieces = s.borrow("d", on_host=True).wait()
        assert not s.lent_in_buffers("d")
        assert all(p.data_ptr() != device_tensor.data_ptr() for p in pieces)
        for p in pieces:
            p.mul_(2)
        assert torch.equal(device_tensor, t), "the device's copy is not changed while lent"
        s.give_back("d", tier="gpu").wait()
        assert s.tiers("d") == ["gpu"] and s.pool.resident == 0
        assert torch.equal(s.get("d").wait(), t * 2)
        (lent,) = s.borrow("d").wait()
        assert lent.data_ptr() == s._entries["d"].gpu.data_ptr()
        s.end_loan("d")


def test_deleting_a_borrowed_value_ends_the_loan(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        s.put("g", torch.randn(40000), tier="host").wait()
        s.borrow("g").wait()
        s.delete("g").wait()
        assert "g" not in s and s.pool.resident == 0
        s.synchronize()


# --- a value written out of place: borrow_new, end_loan, rename -------------------------
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_new_value_is_written_into_lent_buffers_and_renamed_over_the_old(tmp_path, tier):
    """An update out of place (the speculative optimizer's): the old value is lent and given
    back unchanged (``end_loan``: its copies stay), the new one is written into lent host
    buffers (``borrow_new``: the pool's, no copy) and stored; ``rename`` makes it the key's
    value (read back verified from the drive, where its records keep their identity) and
    frees the old one's buffers."""
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        old = torch.randn(40000)                       # three host buffers
        s.put("m", old, tier=tier).wait()
        lent = s.borrow("m").wait()
        before = s.pool.resident
        new = s.borrow_new("m.next", (40000,), torch.float32, tier=tier)
        assert [p.numel() for p in new] == [p.numel() for p in lent]   # cut alike
        assert s.pool.resident == before + 3, "the pool's buffers, no tensor of its own"
        for dst, src in zip(new, lent):
            torch.mul(src, 2, out=dst)
        with pytest.raises(RuntimeError, match="lent"):
            s.get("m.next")
        s.end_loan("m")
        s.give_back("m.next", tier=tier).wait()
        assert torch.equal(s.get("m").wait(), old), "the old value as it was"
        # its copies as they were, and the host copy the loan read from the drive
        assert s.tiers("m") == (["host"] if tier == "host" else ["host", "nvme"])
        s.rename("m.next", "m")
        s.synchronize()
        assert "m.next" not in s and s.tiers("m") == [tier]
        assert torch.equal(s.get("m").wait(), old * 2)
        if tier == "nvme":
            assert s.pool.resident == 0, "the old value's host copy went with it"
        with pytest.raises(RuntimeError, match="not lent"):
            s.end_loan("m")


def test_a_new_value_without_room_in_the_pool_is_lent_as_a_tensor(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=8 * BUF, buffer_bytes=BUF) as s:
        s.put("fill", torch.randn(5 * 16000), tier="host").wait()   # 6 of 8 buffers
        new = s.borrow_new("n", (40000,), torch.float32, tier="nvme")
        assert sum(p.numel() for p in new) == 40000
        for p in new:
            p.fill_(7.0)
        s.give_back("n", tier="nvme").wait()
        assert s.tiers("n") == ["nvme"] and torch.equal(s.get("n").wait(),
                                                          torch.full((40000,), 7.0))


def test_rename_refuses_a_lent_value_and_deletes_what_it_replaces(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        s.put("a", torch.ones(10), tier="nvme").wait()
        s.put("b", torch.zeros(10), tier="host").wait()
        s.borrow("a").wait()
        with pytest.raises(RuntimeError, match="lent"):
            s.rename("a", "b")
        s.end_loan("a")
        s.rename("a", "b")
        s.synchronize()
        # b's buffer is freed; a's host copy (read for the loan) stays with it
        assert s.keys() == ["b"] and s.pool.resident == 1 and s.tiers("b") == ["host", "nvme"]
        assert torch.equal(s.get("b").wait(), torch.ones(10))
        with pytest.raises(KeyError):
            s.rename("a", "c")


def test_a_host_buffer_is_resident_when_it_is_made():
    """Its pages are faulted in once, when it is made (pinned memory is resident from the
    start), not by whichever copy or update first writes it."""
    import ctypes

    from megatron_snake.storage.host_pool import HostBufferPool

    libc = ctypes.CDLL(None, use_errno=True)
    pool = HostBufferPool(256 << 20, buffer_bytes=64 << 20, pin=False)
    bufs = pool.acquire(2)
    page = os.sysconf("SC_PAGE_SIZE")
    for buf in bufs:    # mincore: one byte a page, bit 0 set where the page is in memory
        pages = (ctypes.c_ubyte * (buf.nbytes // page))()
        assert libc.mincore(ctypes.c_void_p(buf.addr), ctypes.c_size_t(buf.nbytes),
                            pages) == 0, os.strerror(ctypes.get_errno())
        assert all(p & 1 for p in pages)
    pool.release(bufs)
    pool.close()


def test_a_new_value_given_back_to_the_device_crosses_once_from_its_buffers(tmp_path):
    """The new working weights an update writes into lent host buffers, stored on the
    device tier: copied there from those buffers (one crossing of its bytes, counted on the
    host side), not first copied out of them into a tensor of their own (a copy within
    host memory: read and written)."""
    with TensorStore(tmp_path, host_memory_limit=16 * BUF, buffer_bytes=BUF) as s:
        new = s.borrow_new("w", (40000,), torch.bfloat16, tier="gpu")
        assert s.pool.resident == 2, "the pool's buffers"
        value = torch.randn(40000).to(torch.bfloat16)
        at = 0
        for piece in new:
            piece.copy_(value[at:at + piece.numel()])
            at += piece.numel()
        before = s.copies.traffic.snapshot()
        s.give_back("w", tier="gpu").wait()
        after = s.copies.traffic.snapshot()
        moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        assert moved == {"crossing": 80000}, moved
        assert s.tiers("w") == ["gpu"] and s.pool.resident == 0
        assert torch.equal(s.get("w").wait(), value)


def test_host_traffic_counts_the_host_side_of_each_copy():
    """A copy within host memory reads one side and writes the other; a crossing touches
    host memory once; a copy between two device tensors touches none."""
    from megatron_snake.storage.copies import HostTraffic, describe_per_parameter
    t = HostTraffic()
    a, b = torch.empty(100), torch.empty(100, dtype=torch.bfloat16)
    t.pairs([(a, b)])
    t.pairs([(a, b)], device_dst=True)
    t.pairs([(b, a)], device_src=True)
    t.pairs([(a, a)], device_dst=True, device_src=True)
    assert t.snapshot() == {"update": 0, "copy": 600, "crossing": 400, "drive": 0,
                            "checksum": 0}
    assert describe_per_parameter(t.per_parameter_step(
        dict.fromkeys(HostTraffic.PASSES, 0), 100, 2)) == \
        "5.0 B per parameter per step (copy 3.0, crossing 2.0)"
