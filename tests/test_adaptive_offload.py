"""The adaptive saved-tensor offload on Megatron's schedule: the profiled step keeps every
save, then a tier fast enough to hide everything gets the saves (and the numbers do not
change by a bit), and one too slow to hide anything gets none."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import build_model, gradients, make_microbatches, tiny_args, zero_gradients
from megatron_snake.offload.adaptive import AdaptiveOffloader
from megatron_snake.storage.store import TensorStore
from megatron_snake.training.distributed import set_seed
from megatron_snake.training.step import (activation_offload_forward_backward,
                                          megatron_forward_backward)

SHAPE = ("--hidden-size", "64", "--seq-length", "64")


@pytest.fixture
def store(tmp_path):
    with TensorStore(tmp_path, rank=0, host_memory_limit=64 << 20) as s:
        yield s


@pytest.fixture(scope="module")
def model(megatron_world):
    m = build_model(tiny_args(*SHAPE), megatron_world)
    m.train()
    return m


def _reference(model, mbs):
    set_seed(5)
    losses = megatron_forward_backward(model, mbs)
    grads = gradients(model)
    zero_gradients(model)
    return losses, grads


def _step(model, mbs, off):
    set_seed(5)
    before = off.stats.offloaded
    losses = activation_offload_forward_backward(model, mbs, offloader=off)
    grads = gradients(model)
    zero_gradients(model)
    return losses, grads, off.stats.offloaded - before


def _assert_same(got, ref):
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert got[1].keys() == ref[1].keys()
    for name, g in got[1].items():
        assert torch.equal(g, ref[1][name]), name


def test_fast_tier_offloads_and_stays_bit_exact(model, store, tmp_path):
    mbs = make_microbatches(2, seq=64)
    ref = _reference(model, mbs)
    lines = []
    off = AdaptiveOffloader(store, "nvme", min_bytes=4096, profile_iters=2,
                            rates=lambda largest: (1e15, 1e15), log=lines.append,
                            plan_path=str(tmp_path / "plan.json"))
    for _ in range(2):                       # the profiled steps keep every save
        *got, offloaded = _step(model, mbs, off)
        _assert_same(got, ref)
        assert offloaded == 0 and store.counters.written["nvme"] == 0
    assert off.plans_made == 1 and len(lines) == 1 and "saved-tensor offload plan" in lines[0]
    plan = off.plan
    assert plan.saves > 0 and len(plan.offload) == plan.saves   # every one hides
    assert {g for g, _ in plan.offload} == {0, 1}                # in both micro-batches
    assert len(json.loads((tmp_path / "plan.json").read_text())["saves"]) == plan.saves
    for _ in range(2):
        *got, offloaded = _step(model, mbs, off)
        _assert_same(got, ref)
        assert offloaded >= len(plan.offload)
    assert store.counters.written["nvme"] == off.stats.bytes_written > 0
    assert off.stats.prefetched > 0          # reads issued at the planned unpacks
    store.synchronize()
    assert store.keys() == [] and off.live_entries() == 0


def test_slow_tier_offloads_nothing(model, store):
    mbs = make_microbatches(2, seq=64)
    ref = _reference(model, mbs)
    off = AdaptiveOffloader(store, "nvme", min_bytes=4096, profile_iters=1,
                            rates=lambda largest: (1.0, 1.0), log=lambda line: None)
    _step(model, mbs, off)
    assert off.plan.saves > 0 and off.plan.offload == {}
    *got, offloaded = _step(model, mbs, off)
    _assert_same(got, ref)
    assert offloaded == 0 and store.counters.written["nvme"] == 0
    # nothing planned: the step runs without the hooks, and a save would be left as it is
    assert off.leaves_all
    off.begin_step()
    saved = torch.randn(4096)
    assert off._pack(saved) is saved
    off.end_step()


def test_changed_saves_are_kept_and_profiled_again(model, store):
    lines = []
    off = AdaptiveOffloader(store, "nvme", min_bytes=4096, profile_iters=1,
                            rates=lambda largest: (1e15, 1e15), log=lines.append)
    _step(model, make_microbatches(2, seq=64), off)
    planned = len(off.plan.offload)
    assert planned
    bigger = make_microbatches(2, batch=3, seq=64)   # the activations' bytes change
    ref = _reference(model, bigger)
    *got, offloaded = _step(model, bigger, off)
    _assert_same(got, ref)
    assert offloaded < planned        # only saves whose bytes still match the plan's
    assert off.plan is None and "profiling again" in lines[-1]
    *got, offloaded = _step(model, bigger, off)   # profiled: everything kept
    _assert_same(got, ref)
    assert offloaded == 0 and off.plans_made == 2


@pytest.mark.parametrize("flags, why", [
    (["--snake-activation-offload-policy", "all"], "applies with --snake-activation-offload"),
    (["--snake-offload", "--snake-activation-offload", "--snake-activation-offload-policy",
      "adaptive"], "adaptive plans Megatron's schedule"),
])
def test_the_policy_is_refused_where_it_does_not_apply(flags, why, capsys):
    from megatron_snake.training.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("pretrain_gpt.py: error: --snake-activation-offload-policy: ") and \
        why in err, err


def test_the_policy_defaults_to_adaptive_on_megatrons_schedule():
    from megatron_snake.training.arguments import parse_args

    assert parse_args(["--snake-activation-offload"]).snake_activation_offload_policy == \
        "adaptive"
    assert parse_args(["--snake-offload", "--snake-activation-offload"]) \
        .snake_activation_offload_policy == "all"
    assert parse_args([]).snake_activation_offload_policy is None


def test_out_of_memory_while_profiling_names_the_policy(store, monkeypatch):
    """A profiled iteration keeps every saved tensor: where that does not fit the device,
    the error is the user's one line naming the flag that offloads them all."""
    from megatron_snake.errors import UserError
    from megatron_snake.training import step as step_module

    def schedule(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(step_module, "megatron_schedule", lambda: schedule)
    offload = step_module.ActivationOffloadStep(AdaptiveOffloader(store, "host"))
    with pytest.raises(UserError, match="--snake-activation-offload-policy all"):
        offload(forward_step_func=None, model=[])
    offload.offloader.plan = SimpleNamespace(offload={})   # past the profile: not ours
    with pytest.raises(torch.OutOfMemoryError):
        offload(forward_step_func=None, model=[])
