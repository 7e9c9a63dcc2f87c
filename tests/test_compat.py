"""Megatron-Core on a CPU-only torch: the five patches work, and moving a patched site is
caught loudly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_snake.compat import megatron_on_cpu


def test_patched_sites_match_pinned_megatron_core():
    megatron_on_cpu.check_patched_sites()  # raises PatchedSiteMoved on any mismatch


def test_moved_site_fails_loudly(monkeypatch):
    site = megatron_on_cpu.PATCHED_SITES[0]
    moved = dataclasses.replace(site, fragment="a line Megatron no longer has")
    gone = dataclasses.replace(site, qualname="function_renamed_upstream")
    monkeypatch.setattr(megatron_on_cpu, "PATCHED_SITES", (moved, gone))
    with pytest.raises(megatron_on_cpu.PatchedSiteMoved) as exc:
        megatron_on_cpu.check_patched_sites()
    msg = str(exc.value)
    assert "no longer contains 'a line Megatron no longer has'" in msg
    assert "function_renamed_upstream is gone" in msg
    assert "megatron-core==0.16.1" in msg


def test_version_mismatch_is_reported(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(megatron_on_cpu.PatchedSiteMoved, match="megatron-core is 0.99.0"):
        megatron_on_cpu.check_patched_sites()


def test_not_applied_for_a_gpu_device():
    assert megatron_on_cpu.apply(torch.device("cuda")) is False


def test_cpu_patches_in_effect(megatron_world):
    assert megatron_on_cpu.is_applied()
    assert torch.cuda.current_device() == "cpu"                       # patch 2
    torch.cuda.synchronize()                                          # patch 3: no-op
    assert torch.zeros(3, device="cuda").device.type == "cpu"         # patch 4
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"          # patch 5
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2, dtype=torch.int64).type() == "torch.LongTensor"


def test_rng_tracker_forks_the_cpu_generator(megatron_world):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_snake.training.distributed import set_seed

    set_seed(3)
    tracker = get_cuda_rng_tracker()
    assert set(tracker.get_states()) == {"data-parallel-rng", "model-parallel-rng",
                                         "expert-parallel-rng"}
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default stream"
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b), "the tracked stream must advance between forks"
    set_seed(3)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), a), "same seed, same tracked stream"
    # The tracked stream differs from the default stream of the same seed.
    set_seed(3)
    assert not torch.equal(torch.rand(4), a)


def test_megatron_full_recompute_runs_on_cpu(megatron_world):
    """Megatron's CheckpointFunction saves/restores 'CUDA' RNG state: patched to the CPU's."""
    from conftest import build_model, make_microbatches, megatron_forward_backward, tiny_args

    model = build_model(tiny_args("--hidden-dropout", "0.1"), megatron_world)
    cfg = model.config
    cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers = \
        "full", "uniform", 1  # Megatron's uniform method needs interval | layers
    try:
        losses = megatron_forward_backward(model, make_microbatches(2))
    finally:
        cfg.recompute_granularity = cfg.recompute_method = cfg.recompute_num_layers = None
    assert all(torch.isfinite(l) for l in losses)
    assert all(p.grad is not None for p in model.parameters())
