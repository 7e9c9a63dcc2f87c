"""TensorStore on the GPU: bit-exact round trips over tiers x dtypes x layouts between the
device and the CPU, the caller's stream respected by put (waits for the producer) and by
get (waits for readers of `out`, and not for the caller's work into a new buffer), forwarding from a CUDA source while its write is in
flight, nothing left behind after many cycles, and the default device in a process that
runs Megatron on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import hold_nvme_writes
from gpu_helpers import DEVICE, requires_cuda, requires_device, sync

from megatron_snake.storage.store import TensorStore

pytestmark = requires_device

CPU = torch.device("cpu")
TIERS = ("gpu", "host", "nvme")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool,
          torch.float64)
# name: (shape of a base tensor, the view of it that is stored)
LAYOUTS = {
    "contiguous": ((37, 129), lambda b: b),
    "multi-record": ((3, 100_003), lambda b: b),   # spans 1 MiB host buffers (itemsize >= 4)
    "transposed": ((129, 37), lambda b: b.t()),
    "sliced": ((64, 96), lambda b: b[3::2, 1::5]),
    "0-d": ((), lambda b: b),
    "empty": ((0, 5), lambda b: b),
}
# where the stored tensor comes from and where it is read back to
DIRECTIONS = {"dev>dev": (DEVICE, DEVICE), "dev>cpu": (DEVICE, CPU), "cpu>dev": (CPU, DEVICE)}
# GPU clock cycles for torch.cuda._sleep: tens of ms, far longer than any copy the store
# would race ahead with if it ignored the caller's stream
SLEEP = 100_000_000
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """Same-size integer view: NaN payloads and -0.0 compare as the bits they are."""
    return t.view(_INT[t.element_size()])


def clone(t):
    return bits(t).clone().view(t.dtype)


def assert_bits(got, want, what=""):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(bits(got).cpu(), bits(want).cpu()), f"{what}: bits differ"


def make(layout, dtype, gen, device=DEVICE):
    """`layout`'s view of a base tensor of random bits (bools 0/1), built on `device` so the
    view keeps its strides there."""
    shape, view = LAYOUTS[layout]
    base = torch.empty(shape, dtype=dtype)
    raw = base.reshape(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 2 if dtype == torch.bool else 256, (raw.numel(),),
                            dtype=torch.uint8, generator=gen))
    return view(base.to(device))


@pytest.fixture
def store(tmp_path):
    with TensorStore(tmp_path, rank=0, host_memory_limit=64 << 20, device=DEVICE) as s:
        yield s


@pytest.fixture
def gated(store, monkeypatch):
    """(store, gate): nvme writes wait for gate.set(), so a put stays in flight."""
    gate = hold_nvme_writes(store, monkeypatch)
    yield store, gate
    gate.set()          # before the store closes (it waits for the write)


def caller_stream(name):
    """The stream the caller works on: the current one, or a side stream of its own."""
    return torch.cuda.Stream(DEVICE) if name == "side" else torch.cuda.current_stream(DEVICE)


# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("tier", TIERS)
def test_round_trip_bit_exact(tmp_path, tier, direction):
    src_dev, dst_dev = DIRECTIONS[direction]
    gen = torch.Generator().manual_seed(0)
    with TensorStore(tmp_path, rank=0, host_memory_limit=64 << 20, device=DEVICE,
                     buffer_bytes=1 << 20) as store:
        for dtype in DTYPES:
            for layout in LAYOUTS:
                what = f"{dtype} {layout} {direction} via {tier}"
                src = make(layout, dtype, gen, src_dev)
                keep = clone(src)
                store.put(what, src, tier=tier).wait()
                got = store.get(what, device=dst_dev).wait()
                assert got.device == dst_dev and got.is_contiguous(), what
                assert_bits(got, keep, what)
                out = make(layout, dtype, gen, dst_dev)     # same layout, other random bits
                assert store.get(what, out=out).wait() is out, what
                assert_bits(out, keep, f"{what} into out")
                assert_bits(src, keep, f"{what}: put must not modify its source")
                store.delete(what).wait()
        assert store.keys() == [] and store.pool.in_use == 0


# ------------------------------------------------------------------ stream order
#
# Each probe runs twice on one store and one caller stream: unhurried, then behind a long
# kernel. The first pass fills the allocator's caches for every copy the second one makes:
# a cudaMalloc there could synchronize the device and hide a missing stream wait.

@requires_cuda
@pytest.mark.parametrize("stream", ["current", "side"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("tier", TIERS)
def test_put_waits_for_the_producer(store, tier, layout, stream):
    gen = torch.Generator().manual_seed(1)
    caller = caller_stream(stream)

    def probe(late):
        x = make(layout, torch.float32, gen)            # old contents
        new = make(layout, torch.float32, gen)
        want = clone(new)
        sync()
        with torch.cuda.stream(caller):
            if late:
                torch.cuda._sleep(SLEEP)                # the producer runs late ...
            x.copy_(new)                                # ... and only then writes x
            store.put("x", x, tier=tier).wait()
        sync()
        assert_bits(store.get("x").wait(), want, f"late={late}: stored x from before its producer")

    probe(late=False)
    probe(late=True)


@requires_cuda
@pytest.mark.parametrize("stream", ["current", "side"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("tier", TIERS)
def test_get_waits_for_readers_of_out(store, tier, layout, stream):
    gen = torch.Generator().manual_seed(2)
    caller = caller_stream(stream)

    def probe(late):
        value, dst = make(layout, torch.float32, gen), make(layout, torch.float32, gen)
        old = clone(dst)
        snapshot = torch.empty_like(dst)
        store.put("x", value, tier=tier).wait()
        sync()
        with torch.cuda.stream(caller):
            if late:
                torch.cuda._sleep(SLEEP)                # a late kernel still reads dst ...
            snapshot.copy_(dst)
            assert store.get("x", out=dst).wait() is dst    # ... when the store fills it
            seen = dst.clone()                          # what the caller's stream reads next
        sync()
        assert_bits(snapshot, old, f"late={late}: the store overwrote out before its reader ran")
        assert_bits(dst, value, f"late={late}: out")
        assert_bits(seen, value, f"late={late}: out was not filled when wait() returned")

    probe(late=False)
    probe(late=True)


@requires_cuda
@pytest.mark.parametrize("tier", ("host", "nvme"))
def test_a_new_buffer_is_filled_while_the_callers_stream_still_computes(store, tier):
    """get(out=part of new_buffer(), new_out=True) does not wait for the caller's queued
    work (the next unit's weights are read while the device computes this one), and its
    memory is not reused while the caller's stream still reads it."""
    value = torch.randn(1 << 20)
    store.put("x", value, tier=tier).wait()
    sync()
    caller = torch.cuda.current_stream(DEVICE)
    busy = torch.cuda.Event()
    torch.cuda._sleep(SLEEP)                            # the unit the device computes now
    busy.record(caller)
    buf = store.new_buffer(value.numel(), value.dtype, DEVICE)
    store.get("x", out=buf, new_out=True).wait()
    assert not busy.query(), "the read waited for the caller's queued work"
    assert_bits(buf, value.to(DEVICE), "new buffer")
    reader = torch.empty_like(buf)
    torch.cuda._sleep(SLEEP)                            # a late kernel still reads buf ...
    reader.copy_(buf)
    del buf                                             # ... when the caller drops it
    again = store.new_buffer(value.numel(), value.dtype, DEVICE)
    store.put("y", torch.zeros_like(value), tier=tier).wait()
    store.get("y", out=again, new_out=True).wait()
    sync()
    assert_bits(reader, value.to(DEVICE), "the buffer's memory was reused under its reader")


@requires_cuda
@pytest.mark.parametrize("result", ["out contiguous", "out transposed", "dtype"])
def test_get_result_is_complete_for_a_side_stream_caller(store, result):
    """The caller works on its own stream while the device's default stream is busy (another
    thread's work): what get returns must be complete when wait() returns, whichever step
    made it (a copy into a strided `out`, a dtype conversion)."""
    gen = torch.Generator().manual_seed(8)
    layout = "transposed" if result == "out transposed" else "contiguous"
    caller = caller_stream("side")

    def probe(late):
        value, dst = make(layout, torch.float32, gen), make(layout, torch.float32, gen)
        want = value.double() if result == "dtype" else clone(value)
        store.put("x", value, tier="host").wait()
        sync()
        if late:
            torch.cuda._sleep(SLEEP)                    # the default stream is busy
        with torch.cuda.stream(caller):
            got = store.get("x", dtype=torch.float64).wait() if result == "dtype" \
                else store.get("x", out=dst).wait()
            seen = got.clone()
        sync()
        assert_bits(seen, want, f"late={late}: {result} not complete when wait() returned")

    probe(late=False)
    probe(late=True)


@requires_cuda
def test_forwarded_get_waits_for_the_producer(gated):
    store, gate = gated
    gen = torch.Generator().manual_seed(4)

    def probe(late):
        x, new = make("contiguous", torch.float32, gen), make("contiguous", torch.float32, gen)
        want = clone(new)
        sync()
        gate.clear()                                    # the nvme write stays in flight
        if late:
            torch.cuda._sleep(SLEEP)
        x.copy_(new)                                    # written late, after put is called
        h_put = store.put("x", x, tier="nvme")
        got = store.get("x").wait()
        assert not h_put.done(), "the get waited for the drive"
        gate.set()
        assert_bits(got, want, f"late={late}: forwarded x from before its producer ran")
        h_put.wait()
        assert_bits(store.get("x").wait(), want, f"late={late}: from the drive")

    probe(late=False)
    probe(late=True)


# ------------------------------------------------------------------ forwarding

@pytest.mark.parametrize("dst", ["dev", "cpu"])
def test_get_while_the_put_is_writing_is_forwarded(gated, dst):
    store, gate = gated
    x = make("contiguous", torch.float32, torch.Generator().manual_seed(3))
    keep = clone(x)
    h_put = store.put("x", x, tier="nvme")
    got = store.get("x", device=DEVICE if dst == "dev" else CPU).wait()
    assert not h_put.done(), "the get waited for the drive"
    gate.set()
    h_put.wait()
    assert_bits(got, keep, "forwarded")
    assert store.tiers("x") == ["nvme"] and store.counters.read["nvme"] == 0
    assert_bits(store.get("x").wait(), keep, "from the drive")
    assert store.counters.read["nvme"] == x.numel() * x.element_size()


# ------------------------------------------------------------------ nothing left behind

def _cycles(store, tier, x, n=100):
    for i in range(n):
        store.put(i, x, tier=tier).wait()
        got = store.get(i).wait()
        assert torch.equal(got, x), i
        del got
        store.delete(i).wait()


@pytest.mark.parametrize("tier", TIERS)
def test_cycles_release_host_buffers_and_file_space(store, tier):
    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    _cycles(store, tier, x)
    assert store.keys() == []
    assert store.pool.in_use == 0 and store.pool.resident == 0
    assert sum(f.used for d in store._drive.drives for f in d.files.values()) == 0


@requires_cuda
@pytest.mark.parametrize("tier", TIERS)
def test_cycles_return_device_memory_to_baseline(store, tier):
    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    sync()
    before = torch.cuda.memory_allocated(DEVICE)
    _cycles(store, tier, x)
    sync()
    assert torch.cuda.memory_allocated(DEVICE) == before
    assert store.pool.in_use == 0


# ------------------------------------------------------------------ default device

# Megatron-on-CPU patches torch.cuda.current_device (to return "cpu") for the whole process,
# and its torch-function mode maps device="cuda" to the CPU in the patching thread, so the
# CUDA tensors are made before the patches.
_DEFAULT_DEVICE = textwrap.dedent("""
    import sys, tempfile, torch
    dev = torch.device(sys.argv[1])
    src = torch.randn(300, 200, generator=torch.Generator().manual_seed(7)).to(dev)
    out = torch.empty_like(src)
    from megatron_snake.compat import megatron_on_cpu
    from megatron_snake.storage.store import TensorStore
    assert megatron_on_cpu.apply("cpu")
    with tempfile.TemporaryDirectory() as d, \\
            TensorStore(d, rank=0, host_memory_limit=64 << 20) as store:
        assert store.device.type == dev.type, store.device
        for tier in ("gpu", "host", "nvme"):
            store.put(tier, src, tier=tier).wait()
            assert store.get(tier, out=out).wait() is out and torch.equal(out, src), tier
            assert torch.equal(store.get(tier, device="cpu").wait(), src.cpu()), tier
            assert torch.equal(store.get(tier).wait().cpu(), src.cpu()), tier
    print("default-device ok")
""")


@requires_cuda
def test_default_device_after_megatron_on_cpu_patches():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _DEFAULT_DEVICE, str(DEVICE)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "default-device ok" in proc.stdout, proc.stderr[-3000:]
