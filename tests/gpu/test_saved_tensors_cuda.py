"""SavedTensorOffloader on the GPU: a small MLP whose saved tensors go to host or nvme and
back gives bit-identical results, a read racing its write is served from device memory, and
the per-tier accounting returns to zero. (Dedup and views are device-independent logic:
tests/test_saved_tensor_offload.py.)"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from conftest import hold_nvme_writes
from gpu_helpers import DEVICE, requires_device, sync

from megatron_snake.offload.saved_tensors import SavedTensorOffloader
from megatron_snake.storage.store import TensorStore

pytestmark = requires_device

MIN_BYTES = 4096
SLEEP = 50_000_000          # GPU clock cycles for torch.cuda._sleep (tens of ms)


@pytest.fixture
def store(tmp_path):
    with TensorStore(tmp_path, rank=0, host_memory_limit=64 << 20, device=DEVICE) as s:
        yield s


def randn(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return t.to(DEVICE, dtype).requires_grad_(requires_grad)


def stall():
    """Hold the GPU back so the packs that follow run before the kernels producing what they
    save: each put must wait for its producer (nothing to hold back on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda._sleep(SLEEP)


def settled(check, timeout=10.0):
    """Poll check() until it holds: the offloader's deletes have no handle to wait on, and
    store.synchronize() does not wait for deletes already issued."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.001)
    return check()


def assert_all_released(store, off, tier="nvme"):
    off.synchronize()
    store.synchronize()
    assert store.keys() == [], "every record is deleted after backward"
    assert off.live_entries() == 0 and off.live == {"gpu": 0, tier: 0}
    assert settled(lambda: store.pool.in_use == 0), "host buffers still held"
    assert settled(lambda: sum(f.used for d in store._drive.drives
                               for f in d.files.values()) == 0), "swap space held"


# ------------------------------------------------------------------ plain autograd region

def mlp_step(mlp, x, off=None):
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with off if off is not None else contextlib.nullcontext():
        stall()
        loss = mlp(x * 2).square().mean()
    if off is not None:
        off.synchronize()            # every write landed: backward reads from the tier
    loss.backward()
    return loss.detach(), x.grad, [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_plain_region_bit_identical(store, tier, dtype):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 64), torch.nn.LayerNorm(64)).to(DEVICE, dtype)
    x = randn(32, 64, dtype=dtype)
    ref = mlp_step(mlp, x)
    off = SavedTensorOffloader(store, tier, params=mlp.parameters(), min_bytes=MIN_BYTES,
                               prefetch_depth=1)
    got = mlp_step(mlp, x, off)
    sync()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
    s = off.stats
    assert s.unique_writes >= 3 and s.forwarded == 0
    assert store.counters.written[tier] == s.bytes_written
    assert store.counters.read[tier] == s.bytes_read == s.bytes_written, "all read from the tier"
    assert off.peak[tier] > 0 and off.peak["gpu"] > 0
    assert_all_released(store, off, tier)


# ------------------------------------------------------------------ forwarding

def test_read_racing_its_write_is_forwarded(tmp_path, monkeypatch):
    # more workers than writes + deletes queued behind them: forwarded reads need one free
    with TensorStore(tmp_path, rank=0, host_memory_limit=64 << 20, device=DEVICE,
                     workers=8) as store:
        gate = hold_nvme_writes(store, monkeypatch)
        a = randn(64, 64, requires_grad=True)
        off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES)
        try:
            with off:
                stall()
                x = a.exp()
                y = (x * x.t()).tanh()
            (y * 3).sum().backward()         # every write is still blocked
            assert not any(h.done() for h in off._writes)
        finally:
            gate.set()
        a2 = a.detach().clone().requires_grad_()
        x2 = a2.exp()
        y2 = (x2 * x2.t()).tanh()
        (y2 * 3).sum().backward()
        assert torch.equal(a.grad, a2.grad) and torch.equal(y.detach(), y2.detach())
        assert off.stats.forwarded >= 2 and off.stats.cancelled == off.stats.unique_writes
        assert store.counters.read["nvme"] == 0, "nothing was read back from the drive"
        assert_all_released(store, off)


# ------------------------------------------------------------------ accounting

@pytest.mark.parametrize("depth", [0, 2])
def test_peak_bytes_per_tier(store, depth):
    """All 4 records are on the drive at once at the end of the forward; in backward the
    device holds the record being used plus the ``depth`` read ahead of it."""
    one = 64 * 64 * 4
    h = randn(64, 64, seed=depth, requires_grad=True)
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES, prefetch_depth=depth)
    with off:
        x = h
        for _ in range(5):
            x = x.sin()                      # each sin saves its input (the leaf h is kept)
    off.synchronize()
    assert off.peak == {"gpu": 0, "nvme": 4 * one} and off.live == off.peak
    off.reset_peak()
    x.sum().backward()
    assert off.peak == {"gpu": (1 + depth) * one, "nvme": 4 * one}
    assert off.live == {"gpu": 0, "nvme": 0}
    ref = h.detach().clone().requires_grad_()
    y = ref
    for _ in range(5):
        y = y.sin()
    y.sum().backward()
    assert torch.equal(h.grad, ref.grad)
    assert_all_released(store, off)
