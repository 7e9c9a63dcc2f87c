"""Unit checkpoints through the tiered store (host, nvme) change no number, and every one
of them really goes through the tier."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import build_model, make_microbatches, tiny_args
from megatron_snake import vertical_forward_backward
from megatron_snake.offload.checkpoint_store import OffloadedCheckpoints
from megatron_snake.offload.store import TensorStore
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
        store = OffloadedCheckpoints(tensor_store, tier, len(mbs), megatron_world)
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
