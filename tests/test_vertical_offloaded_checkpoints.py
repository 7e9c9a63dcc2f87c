"""Unit checkpoints through the tiered store (host, nvme) change no number, and every one
of them really goes through the tier."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import build_model, make_microbatches, tiny_args
from megatron_snake import vertical_forward_backward
from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
from megatron_snake.storage.store import TensorStore
from megatron_snake.training.distributed import set_seed


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_offloaded_checkpoints_are_bit_identical(megatron_world, tmp_path, tier):
    model = build_model(tiny_args("--hidden-dropout", "0.2", "--attention-dropout", "0.1"),
                        megatron_world)
    model.train()
    mbs = make_microbatches(3)

    set_seed(11)
    ref_losses = vertical_forward_backward(model, mbs, checkpoint_interval=2)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    with TensorStore(tmp_path, rank=0, host_memory_limit=256 << 20) as tensor_store:
        store = OffloadedUnitInputs(tensor_store, tier, len(mbs), megatron_world)
        set_seed(11)
        losses = vertical_forward_backward(model, mbs, checkpoint_interval=2, store=store)
        store.finish_step()
        written = tensor_store.counters.written[tier]
        assert tensor_store.keys() == [], "every checkpoint is dropped after its backward"
        if tier == "nvme":
            assert os.listdir(tmp_path / "rank0"), "swap files live under rank0/"

    units = 3  # 5 layers, interval 2
    one = mbs[0]["tokens"].numel() * 32 * 4  # [s, b, h] fp32
    assert written == (units - 1) * len(mbs) * one
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


def test_late_checkpoint_reads_count_as_prefetch_wait(megatron_world, tmp_path, monkeypatch):
    """Reads issued ahead of use on a drive slower than compute: the time blocked on them
    is counted as prefetch wait, and numbers do not change."""
    import time

    model = build_model(tiny_args(), megatron_world)
    mbs = make_microbatches(3)
    ref_losses = vertical_forward_backward(model, mbs, checkpoint_interval=1)
    model.zero_grad(set_to_none=True)
    with TensorStore(tmp_path, rank=0, host_memory_limit=256 << 20) as tensor_store:
        run_get = tensor_store._run_get
        monkeypatch.setattr(tensor_store, "_run_get", lambda *a, **kw: time.sleep(0.05) or
                            run_get(*a, **kw))
        store = OffloadedUnitInputs(tensor_store, "nvme", len(mbs), megatron_world)
        losses = vertical_forward_backward(model, mbs, checkpoint_interval=1, store=store)
        store.finish_step()
        counters = tensor_store.counters
        assert 0.05 < counters.prefetch_wait_s <= counters.blocked_s
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))


def test_snake_groups_read_ahead_only_within_their_group(megatron_world, tmp_path):
    """G = 2 of M = 4 on nvme: the numbers of the in-memory run, and a read ahead never
    reaches into another group (every checkpoint is read when its group is swept, once per
    sweep)."""
    model = build_model(tiny_args(), megatron_world)
    mbs = make_microbatches(4)
    ref_losses = vertical_forward_backward(model, mbs, group_size=2)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with TensorStore(tmp_path, rank=0, host_memory_limit=256 << 20) as tensor_store:
        store = OffloadedUnitInputs(tensor_store, "nvme", len(mbs), megatron_world)
        sweeps, reads = [], []
        begin = store.begin_group
        store.begin_group = lambda group: sweeps.append(list(group)) or begin(group)
        get = tensor_store.get
        tensor_store.get = lambda key, **kw: reads.append((key, sweeps[-1])) or get(key, **kw)
        losses = vertical_forward_backward(model, mbs, group_size=2, store=store)
        store.finish_step()
    assert sweeps == [[0, 1], [0, 1], [2, 3], [2, 3]], "forward, backward, per group"
    assert all(key[2] in group for key, group in reads), reads
    units = 5  # inputs of units 1..4 read in backward; of 1..3 in forward (4 is the loss unit)
    assert len(reads) == (2 * (units - 1) - 1) * len(mbs), "each read once per sweep"
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_the_forward_window_reads_no_checkpoint_back_and_matches_megatron(
        megatron_world, tmp_path, tier):
    """With a group's checkpoints kept on the device from one unit's forward to the next's
    (``keep_for_next_unit``, G = 2 of M = 4): the forward sweep reads no checkpoint back,
    the loss unit takes its inputs from the window, every other input is read once in the
    backward sweep, and the numbers are Megatron-Core's."""
    from conftest import gradients, megatron_forward_backward, zero_gradients
    from test_vertical_exactness import REL_TOL

    model = build_model(tiny_args(), megatron_world)
    mbs = make_microbatches(4)
    zero_gradients(model)
    ref_losses = megatron_forward_backward(model, mbs)
    ref = gradients(model)
    zero_gradients(model)
    with TensorStore(tmp_path, rank=0, host_memory_limit=256 << 20) as tensor_store:
        store = OffloadedUnitInputs(tensor_store, tier, len(mbs), megatron_world,
                                    keep_for_next_unit=2)
        sweeps, reads = [], []
        begin = store.begin_group
        store.begin_group = lambda group: sweeps.append(len(sweeps)) or begin(group)
        get = tensor_store.get
        tensor_store.get = lambda key, **kw: reads.append((key, sweeps[-1])) or get(key, **kw)
        losses = vertical_forward_backward(model, mbs, group_size=2, checkpoint_interval=1,
                                           store=store)
        store.finish_step()
        assert tensor_store.keys() == [], "every checkpoint is dropped after its backward"
    assert [sweep % 2 for _, sweep in reads] == [1] * len(reads), \
        "checkpoints are read back in the backward sweeps only"
    units = 5   # inputs of units 1..3 read back; the loss unit's (4) come from the window
    assert sorted(key for key, _ in reads) == sorted(
        ("ckpt", u, mb) for u in range(1, units - 1) for mb in range(len(mbs)))
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(losses, ref_losses))
    grads = gradients(model)   # summed group by group: Megatron's order only up to rounding
    for name, want in ref.items():
        rel = ((grads[name] - want).abs().max() / want.abs().max()).item()
        assert rel <= REL_TOL, name
