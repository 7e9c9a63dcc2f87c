"""Saved-tensor offload (SSDTrain): numbers never change, bytes really go to the tier,
dedup writes a storage once, forwarding serves a read racing its write, nothing is left."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import (build_model, gradients, hold_nvme_writes, make_microbatches, tiny_args,
                      zero_gradients)
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.offload.saved_tensors import SavedTensorOffloader
from megatron_snake.storage.store import TensorStore
from megatron_snake.training.distributed import set_seed
from megatron_snake.training.step import (activation_offload_forward_backward,
                                               megatron_forward_backward)

MIN_BYTES = 4096
SHAPE = ("--hidden-size", "64", "--seq-length", "64")
DROPOUT = ("--hidden-dropout", "0.2", "--attention-dropout", "0.3")


@pytest.fixture
def deterministic():
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(old)


@pytest.fixture
def store(tmp_path):
    with TensorStore(tmp_path, rank=0, host_memory_limit=64 << 20) as s:
        yield s


def _assert_all_released(store, off):
    off.synchronize()
    store.synchronize()
    assert store.keys() == [], "every record is deleted after backward"
    assert off.live_entries() == 0
    assert store.counters.written["nvme"] == off.stats.bytes_written > 0


# ------------------------------------------------------------------ Megatron's schedule

@pytest.mark.parametrize("dropout", [(), DROPOUT], ids=["no-dropout", "dropout"])
def test_megatron_schedule_bit_identical(megatron_world, deterministic, store, dropout):
    model = build_model(tiny_args(*SHAPE, *dropout), megatron_world)
    model.train()
    mbs = make_microbatches(2, seq=64)

    set_seed(5)
    ref_losses = megatron_forward_backward(model, mbs)
    ref = gradients(model)
    zero_gradients(model)

    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES)
    set_seed(5)
    losses = activation_offload_forward_backward(model, mbs, offloader=off)

    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for name, g in gradients(model).items():
        assert torch.equal(g, ref[name]), name
    assert off.stats.unique_writes > 0 and off.stats.dedup_hits > 0
    assert off.stats.prefetched > 0
    _assert_all_released(store, off)

    set_seed(5)
    fwd = activation_offload_forward_backward(model, mbs, forward_only=True,
                                                       offloader=off)
    assert all(torch.equal(a, b) for a, b in zip(fwd, ref_losses)) or dropout
    _assert_all_released(store, off)


# ------------------------------------------------------------------ plain autograd region

def _mlp_step(mlp, x, off=None):
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if off is None:
        loss = mlp(x * 2).square().mean()
    else:
        with off:
            loss = mlp(x * 2).square().mean()
    loss.backward()
    return loss.detach(), x.grad, [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_plain_region_bit_identical(deterministic, store, tier):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.0),
                              torch.nn.Linear(256, 64), torch.nn.LayerNorm(64))
    x = torch.randn(32, 64)
    ref = _mlp_step(mlp, x)
    off = SavedTensorOffloader(store, tier, params=mlp.parameters(), min_bytes=MIN_BYTES,
                               prefetch_depth=1)
    got = _mlp_step(mlp, x, off)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
    assert off.stats.unique_writes >= 3
    off.synchronize()
    store.synchronize()
    assert store.counters.written[tier] == off.stats.bytes_written
    assert store.keys() == []


# ------------------------------------------------------------------ vertical unit recompute

def test_unit_recompute_bit_identical(megatron_world, deterministic, store):
    model = build_model(tiny_args(*SHAPE), megatron_world)
    units = GPTUnits(model, checkpoint_interval=2)
    mb = make_microbatches(1, seq=64)[0]
    ctx = units.context(mb, seq_length=mb["tokens"].shape[1])
    with torch.no_grad():
        checkpoint = units.forward_unit(0, None, ctx)
    grad_out = torch.randn(checkpoint.shape, generator=torch.Generator().manual_seed(3))
    off = SavedTensorOffloader(store, "nvme", params=model.parameters(), min_bytes=MIN_BYTES)

    def run(unit, offloader):
        model.zero_grad(set_to_none=True)
        ckpt = checkpoint.detach().requires_grad_()
        if offloader is None:
            out = units.forward_unit(unit, ckpt, ctx)
        else:
            with offloader:
                out = units.forward_unit(unit, ckpt, ctx)
        if units.owns_head(unit):
            out.float().mean().backward()
        else:
            out.backward(grad_out)
        return ckpt.grad, [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]

    for unit in (1, units.num_units - 1):
        ref_in, ref_params = run(unit, None)
        got_in, got_params = run(unit, off)
        assert torch.equal(got_in, ref_in)
        assert [n for n, _ in got_params] == [n for n, _ in ref_params]
        for (n, a), (_, b) in zip(got_params, ref_params):
            assert torch.equal(a, b), n
    _assert_all_released(store, off)


# ------------------------------------------------------------------ dedup and what is kept

def test_tensor_saved_twice_is_written_once(store):
    a = torch.randn(64, 64, requires_grad=True)
    x = a.exp()                              # not a leaf: offloadable (16 KiB)
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES)
    with off:
        y = x * x                            # mul saves x twice
        z = torch.mul(x, x)                  # and again, by a second op
    (y.sum() + z.sum()).backward()
    off.synchronize()
    assert torch.equal(a.grad, 4 * x.detach() * x.detach())
    s = off.stats
    assert (s.offloaded, s.unique_writes, s.dedup_hits) == (4, 1, 3)
    assert store.counters.written["nvme"] == x.numel() * 4
    _assert_all_released(store, off)


def test_views_share_one_record(store):
    a = torch.randn(64, 128, requires_grad=True)
    x = a.sin()
    left, right = x[:, :64], x[:, 64:]       # two views of one storage
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES)
    with off:
        y = left * right.t()                 # saves a slice and a transposed slice
    y.sum().backward()
    off.synchronize()
    xd = x.detach()
    expected = torch.cat([xd[:, 64:].t(), xd[:, :64].t()], dim=1) * a.detach().cos()
    assert torch.equal(a.grad, expected)
    assert (off.stats.offloaded, off.stats.unique_writes, off.stats.dedup_hits) == (2, 1, 1)
    assert store.counters.written["nvme"] == x.numel() * 4   # the whole storage, once
    _assert_all_released(store, off)


def test_reused_address_is_not_a_dedup_hit(store):
    """A new storage at a freed storage's address must get its own record. from_numpy on one
    buffer makes that happen deterministically (malloc reuse does not)."""
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES)
    buf = np.zeros(4096, dtype=np.float32)
    w = torch.ones(4096, requires_grad=True)
    with off:
        buf[:] = 1
        x = torch.from_numpy(buf)
        ptr = x.data_ptr()
        y1 = w * x                           # saves x (not a leaf that requires grad)
        del x
        off.synchronize()                    # written; the first storage is gone
        buf[:] = 2
        x = torch.from_numpy(buf)            # a new storage at the same address
        assert x.data_ptr() == ptr
        y2 = w * x
    (y1.sum() + y2.sum()).backward()
    assert torch.equal(w.grad, torch.full((4096,), 3.0))
    assert off.stats.unique_writes == 2 and off.stats.dedup_hits == 0
    _assert_all_released(store, off)


def test_parameters_and_small_tensors_stay(store):
    lin = torch.nn.Linear(64, 64)            # weight 16 KiB > MIN_BYTES
    off = SavedTensorOffloader(store, "nvme", params=lin.parameters(), min_bytes=MIN_BYTES)
    big = torch.randn(128, 64, requires_grad=True) * 1
    small = torch.randn(8, 64, requires_grad=True) * 1   # 2 KiB < MIN_BYTES
    with off:
        y = lin(big)                                 # saves big (offloaded) and the weight
        y2 = big @ lin.weight.t()                    # a view of the weight: kept
        y3 = small * small                           # small: kept
        leaf = torch.randn(64, 64, requires_grad=True)
        y4 = big @ leaf                              # a leaf that requires grad: kept
    (y.sum() + y2.sum() + y3.sum() + y4.sum()).backward()
    off.synchronize()
    assert off.stats.unique_writes == 1, "only `big` goes to the tier"
    assert store.counters.written["nvme"] == big.numel() * 4
    assert off.stats.kept >= 5
    _assert_all_released(store, off)


def test_inplace_change_of_a_saved_tensor_is_refused(store):
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES)
    x = torch.randn(64, 64, requires_grad=True) * 1
    with off:
        y = x * x
    with torch.no_grad():
        x.add_(1)
    with pytest.raises(RuntimeError, match="in-place"):
        y.sum().backward()
    del y


def test_prefetch_in_reverse_pack_order(store, monkeypatch):
    issued = []                              # (store key, number of unpacks so far)
    unpacks = []
    get = store.get
    monkeypatch.setattr(store, "get", lambda key, **kw: issued.append((key, len(unpacks)))
                        or get(key, **kw))
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES, prefetch_depth=2)
    h = torch.randn(64, 64, requires_grad=True)
    with off:
        for _ in range(5):
            h = h.sin()                      # each sin saves its input: 5 records
    off.synchronize()                        # so reads come from the drive
    h.register_hook(lambda g: unpacks.append(1))
    h.sum().backward()
    seqs = [key[1] for key, _ in issued]
    assert seqs == sorted(seqs, reverse=True) and len(seqs) == 4  # the leaf input is kept
    assert [n for _, n in issued[:3]] == [1, 1, 1], "first unpack reads 2 ahead"
    assert off.stats.prefetched == 3
    assert store.counters.read["nvme"] == off.stats.bytes_read == 4 * h.numel() * 4
    _assert_all_released(store, off)


# ------------------------------------------------------------------ forwarding

def test_read_racing_its_write_is_forwarded(store, monkeypatch):
    gate = hold_nvme_writes(store, monkeypatch)
    a = torch.randn(64, 64, requires_grad=True)
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES)
    try:
        with off:
            x = a.exp()
            y = (x * x.t()).tanh()
        (y * 3).sum().backward()             # every write is still blocked
        assert not any(h.done() for h in off._writes)
    finally:
        gate.set()
    ref_x = a.detach().exp()
    ref_y = (ref_x * ref_x.t()).tanh()
    a2 = a.detach().clone().requires_grad_()
    x2 = a2.exp()
    (3 * (x2 * x2.t()).tanh()).sum().backward()
    assert torch.equal(a.grad, a2.grad) and torch.equal(y.detach(), ref_y)
    assert off.stats.forwarded >= 2 and off.stats.cancelled == off.stats.unique_writes
    assert store.counters.read["nvme"] == 0, "nothing was read back from the drive"
    _assert_all_released(store, off)


# ------------------------------------------------------------------ counters

def _sin_chain(off, steps=5):
    """A chain of sins under ``off``: each saves its input, 4 records of 64 x 64 fp32."""
    h = torch.randn(64, 64, requires_grad=True)
    hs = []
    with off:
        x = h
        for _ in range(steps):
            x = x.sin()
            hs.append(x)
    return h, hs, x


@pytest.mark.parametrize("depth", [0, 2])
def test_peak_bytes_per_tier(store, depth):
    """All 4 records are on the drive at once at the end of the forward; in backward the
    device holds the record being used plus the ``depth`` read ahead of it."""
    one = 64 * 64 * 4
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES, prefetch_depth=depth)
    _, _, out = _sin_chain(off)
    off.synchronize()
    assert off.peak == {"gpu": 0, "nvme": 4 * one} and off.live == off.peak
    off.reset_peak()
    out.sum().backward()
    assert off.peak == {"gpu": (1 + depth) * one, "nvme": 4 * one}
    assert off.live == {"gpu": 0, "nvme": 0}
    _assert_all_released(store, off)


@pytest.mark.parametrize("slow", ["drive", "compute"])
def test_prefetch_wait_is_counted_only_when_a_prefetch_is_late(store, monkeypatch, slow):
    """A drive slower than compute: backward blocks on prefetched reads (prefetch wait > 0).
    Compute slower than the drive: every prefetch is in before its use (exactly 0)."""
    import time

    run_get = store._run_get
    if slow == "drive":
        monkeypatch.setattr(store, "_run_get", lambda *a, **kw: time.sleep(0.05) or
                            run_get(*a, **kw))
    off = SavedTensorOffloader(store, "nvme", min_bytes=MIN_BYTES, prefetch_depth=1)
    _, hs, out = _sin_chain(off)
    off.synchronize()
    if slow == "compute":
        for x in hs[:-1]:
            x.register_hook(lambda g: time.sleep(0.05))
    out.sum().backward()
    assert off.stats.prefetched == 3
    if slow == "drive":
        assert store.counters.prefetch_wait_s > 0.02
    else:
        assert store.counters.prefetch_wait_s == 0.0
    assert store.counters.blocked_s >= store.counters.prefetch_wait_s
    _assert_all_released(store, off)
