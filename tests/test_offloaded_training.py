"""Weights, gradients and AdamW states on the NVMe tier, the optimizer step split by alpha
and overlapped with the sweeps: five steps equal Megatron-Core's schedule + torch AdamW.

The reference is built only of Megatron-Core and torch pieces: forward_backward_no_pipelining
on a bare GPTModel, torch.nn.utils.clip_grad_norm_, torch.optim.AdamW(fused=True) with
Megatron's no-decay rule, and Megatron's OptimizerParamScheduler.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from conftest import (build_model, cosine_scheduler, make_microbatches, reference_training,
                      tiny_args)
from megatron_snake import vertical_forward_backward
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
from megatron_snake.storage.store import TensorStore
from megatron_snake.offload.unit_weights import OffloadedUnits
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.unit_params import UnitParams
from megatron_snake.schedule.vertical import horizontal_forward_backward
from megatron_snake.schedule.unit_store import CombinedStore

LR, WD, STEPS, M = 5e-3, 0.1, 5, 3


def _reference(model, batches, clip):
    return reference_training(model, batches, clip=clip, lr=LR, weight_decay=WD, steps=STEPS)


def _snake(model, batches, clip, alpha, offload_dir, interval, schedule=vertical_forward_backward,
           speculate=False, device_share=()):
    units = GPTUnits(model, interval)
    params = UnitParams.of(units)
    with TensorStore(offload_dir, rank=0, host_memory_limit=256 << 20) as tstore:
        opt = OffloadedAdamW(params, tstore, lr=LR, weight_decay=WD, clip_grad=clip,
                             alpha=alpha, speculate=[lay.key for lay in params.all_layouts()]
                             if speculate else (), device_share=device_share)
        weights = OffloadedUnits(params, tstore, opt, device=torch.device("cpu"),
                                 dtype=torch.float32, pinned=device_share)
        sched = cosine_scheduler(opt, LR, WD, STEPS)
        losses, traffic = [], []
        weight_reads, store_get = [0], tstore.get

        def counting_get(key, *args, **kwargs):
            weight_reads[0] += key[0] == "w"
            return store_get(key, *args, **kwargs)

        tstore.get = counting_get
        for mbs in batches:
            store = CombinedStore(OffloadedUnitInputs(tstore, "nvme", len(mbs),
                                                       torch.device("cpu")), weights)
            before = weight_reads[0]
            losses.append(schedule(model, mbs, checkpoint_interval=interval, store=store))
            store.inputs.finish_step()
            opt.step()
            sched.step(increment=1)
            traffic.append(weight_reads[0] - before)
        assert any(os.scandir(offload_dir / "rank0")), "state lives in rank0/ swap files"
        for key in device_share:   # the device share's state stayed on the device tier
            assert {tuple(tstore.tiers((name, key, part))) for name in
                    ("master", "exp_avg", "exp_avg_sq", "w") for part in ("bwd", "fwd")} \
                == {("gpu",)}
        weights.load_all()
        opt.close()
        assert not [k for k in tstore.keys() if str(k[0]).endswith(".next")], \
            "no speculative state outlives its step"
    _snake.speculation = (opt.speculated, opt.speculation_misses)
    return losses, traffic


def _train_both(megatron_world, tmp_path, flags, num_mb, clip, alpha, speculate=False,
                device_share=()):
    torch.use_deterministic_algorithms(True)
    args = tiny_args(*flags)
    reference, ours = build_model(args, megatron_world), build_model(args, megatron_world)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    batches = [make_microbatches(num_mb, seed=s) for s in range(STEPS)]
    ref_losses = _reference(reference, batches, clip)
    losses, _ = _snake(ours, batches, clip, alpha, tmp_path, interval=2, speculate=speculate,
                       device_share=device_share)
    torch.use_deterministic_algorithms(False)
    assert [torch.equal(a, b) for a, b in zip(losses[0], ref_losses[0])] == [True] * num_mb, \
        "step 1 sees the same initial weights: identical losses"
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-5 * abs(y), f"step {step}: loss {x} vs {y}"
    ref_params = dict(reference.named_parameters())
    for name, p in ref_params.items():
        assert not torch.equal(p.detach(), initial[name]), f"{name} never moved"
    return {n: (p.detach(), ref_params[n].detach()) for n, p in ours.named_parameters()}


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_offloaded_adamw_equals_megatron_plus_torch_adamw(megatron_world, tmp_path, alpha,
                                                          clip):
    """Untied, M = 2: every gradient is bit-identical to Megatron's (see
    test_vertical_exactness), the global norm is taken with torch's clip_grad_norm_
    arithmetic (norms per parameter, in parameter order), and the update is torch's fused
    AdamW kernel on views: after five steps the weights are bit-identical, whatever alpha
    cuts where and whether the update ran in the backward or the next forward sweep."""
    pairs = _train_both(megatron_world, tmp_path, ("--untie-embeddings-and-output-weights",
                                                   "--position-embedding-type", "rope"),
                        2, clip, alpha)
    for name, (ours, ref) in pairs.items():
        assert torch.equal(ours, ref), f"{name}: not bit-identical"


@pytest.mark.parametrize("clip,steps,misses", [(0.5, 1, 1), (1.5, 2, 1), (100.0, 5, 0)],
                         ids=["the clip binds", "binds, then not", "never binds"])
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_speculative_updates_are_exact_whether_the_clip_binds_or_not(
        megatron_world, tmp_path, clip, steps, misses, alpha):
    """With clipping, each backward part is updated in the backward sweep as if the clip
    coefficient were 1, out of place; the step keeps that state when the norm is within
    --clip-grad, else it updates the part again from the old state with the coefficient,
    and the next step does not speculate. The norms here fall from 2.5 to 1.26 over five
    steps, so a clip of 0.5 binds every step (step 1 speculates), 1.5 the first three (steps
    1 and 5 speculate, the first missing), 100 none (every step speculates and keeps it):
    each run's weights after five steps are those of Megatron's schedule with torch's
    clip_grad_norm_ and fused AdamW, bit for bit."""
    pairs = _train_both(megatron_world, tmp_path, ("--untie-embeddings-and-output-weights",
                                                   "--position-embedding-type", "rope"),
                        2, clip, alpha, speculate=True)
    for name, (ours, ref) in pairs.items():
        assert torch.equal(ours, ref), f"{name}: not bit-identical"
    layouts = 3   # 5 layers in units of 2, untied: no shared layout
    assert _snake.speculation == (steps * layouts, misses * layouts)


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_a_device_share_of_the_optimizer_is_exact(megatron_world, tmp_path, clip):
    """The first units' optimizer state on the device tier, updated there on the training
    thread (the rest on the host worker, speculating under the clip): the same bits as
    Megatron's schedule with torch's clip and fused AdamW."""
    pairs = _train_both(megatron_world, tmp_path, ("--untie-embeddings-and-output-weights",
                                                   "--position-embedding-type", "rope"),
                        2, clip, 0.25, speculate=True, device_share=(0, 1))
    for name, (ours, ref) in pairs.items():
        assert torch.equal(ours, ref), f"{name}: not bit-identical"


def test_offloaded_adamw_tied_three_microbatches(megatron_world, tmp_path):
    """Tied embedding, M = 3: the gradient sums of odd units and of the tied weight run in
    another order than Megatron's (float rounding, 1e-7), and Adam divides every update by
    sqrt(v), so rounding in small gradients shows in the weights. Measured per parameter as
    ||ours - ref|| / ||ref||, within 1e-6. Linear biases are off here: the key bias has a
    gradient of exactly zero in exact arithmetic (softmax ignores it), so Adam turns pure
    rounding noise into lr-sized steps and it cannot match any other summation order."""
    pairs = _train_both(megatron_world, tmp_path, ("--disable-bias-linear",), 3, 0.5, 0.25)
    for name, (ours, ref) in pairs.items():
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel <= 1e-6, f"{name}: relative weight difference {rel:.2e}"


def test_horizontal_ablation_same_numbers_more_weight_traffic(megatron_world, tmp_path):
    """--snake-schedule horizontal over the same store: Megatron's micro-batch order sums
    gradients in Megatron's order (untied: bit-identical weights), but reads every unit's
    weights once per micro-batch instead of once per sweep."""
    args = tiny_args("--untie-embeddings-and-output-weights")
    batches = [make_microbatches(4, seed=s) for s in range(2)]
    torch.use_deterministic_algorithms(True)
    reference = build_model(args, megatron_world)
    _reference(reference, batches, 0.0)
    vertical, horizontal = build_model(args, megatron_world), build_model(args, megatron_world)
    (tmp_path / "v").mkdir()
    (tmp_path / "h").mkdir()
    _, v_reads = _snake(vertical, batches, 0.0, 0.25, tmp_path / "v", 1)
    _, h_reads = _snake(horizontal, batches, 0.0, 0.25, tmp_path / "h", 1,
                        schedule=horizontal_forward_backward)
    torch.use_deterministic_algorithms(False)
    ref = dict(reference.named_parameters())
    for name, p in horizontal.named_parameters():
        assert torch.equal(p.detach(), ref[name].detach()), name
    # Weight reads per step: (2U - 1) unit acquisitions x 2 parts, times M for horizontal.
    units = 5
    assert v_reads == [(2 * units - 1) * 2] * 2
    assert h_reads == [4 * (2 * units - 1) * 2] * 2


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
def test_weight_bytes_from_nvme_per_step_vs_microbatches(megatron_world, tmp_path, schedule):
    """Measured by the store's counters: the vertical schedule reads each unit's weights
    from NVMe once per sweep whatever M is; the horizontal one once per micro-batch."""
    fn = vertical_forward_backward if schedule == "vertical" else horizontal_forward_backward
    args = tiny_args("--untie-embeddings-and-output-weights")
    per_step = {}
    for num_mb in (1, 2, 4, 8):
        model = build_model(args, megatron_world)
        units = GPTUnits(model, 1)
        params = UnitParams.of(units)
        weight_bytes = sum(lay.numel for lay in params.units) * 4
        with TensorStore(tmp_path, rank=0, host_memory_limit=256 << 20) as tstore:
            opt = OffloadedAdamW(params, tstore, lr=LR, weight_decay=WD, alpha=0.25)
            weights = OffloadedUnits(params, tstore, opt, device=torch.device("cpu"),
                                     dtype=torch.float32)
            reads = []
            for step in range(2):
                before = tstore.counters.by_kind["weights"]["nvme"][0]
                store = CombinedStore(OffloadedUnitInputs(tstore, "nvme", num_mb,
                                                           torch.device("cpu")), weights)
                fn(model, make_microbatches(num_mb, seed=step), checkpoint_interval=1,
                   store=store)
                store.inputs.finish_step()
                opt.step()
                tstore.synchronize()
                reads.append(tstore.counters.by_kind["weights"]["nvme"][0] - before)
            opt.close()
        per_step[num_mb] = max(reads)
    # Every unit but the last is read in both sweeps, the last once (fused with the loss):
    # at most that pair of sweeps from the drive (weights kept in host memory from a forward
    # read to the backward read, or a read that finds a write in flight, read less) per
    # sweep pair, which the horizontal schedule makes once per micro-batch.
    sweep_pair = 2 * weight_bytes - params.units[-1].numel * 4
    assert 0 < per_step[1] <= sweep_pair, per_step
    if schedule == "vertical":   # the same whatever M
        assert max(per_step.values()) <= min(1.25 * min(per_step.values()), sweep_pair), \
            per_step
    else:                        # once per micro-batch
        for num_mb, nbytes in per_step.items():
            assert 0.8 * num_mb * per_step[1] <= nbytes <= num_mb * sweep_pair, per_step


def _weights_from_nvme_per_step(model, batches, offload_dir, pinned):
    """Train ``batches`` with units ``pinned`` on the device: per step, the NVMe bytes of
    weights read and the units whose weights were read from the drive."""
    params = UnitParams.of(GPTUnits(model, 1))
    with TensorStore(offload_dir, rank=0, host_memory_limit=256 << 20) as tstore:
        opt = OffloadedAdamW(params, tstore, lr=LR, weight_decay=WD, alpha=0.25)
        weights = OffloadedUnits(params, tstore, opt, device=torch.device("cpu"),
                                 dtype=torch.float32, pinned=pinned)
        reads, units_read, read_nvme = [], [], tstore._drive.read_bytes

        def spy(e, *args, **kwargs):
            if e.key[0] == "w":
                units_read[-1].add(e.key[1])
            return read_nvme(e, *args, **kwargs)

        tstore._drive.read_bytes = spy
        for mbs in batches:
            units_read.append(set())
            before = tstore.counters.by_kind["weights"]["nvme"][0]
            store = CombinedStore(OffloadedUnitInputs(tstore, "nvme", len(mbs),
                                                       torch.device("cpu")), weights)
            vertical_forward_backward(model, mbs, checkpoint_interval=1, store=store)
            store.inputs.finish_step()
            opt.step()
            tstore.synchronize()
            reads.append(tstore.counters.by_kind["weights"]["nvme"][0] - before)
        weights.load_all()
        opt.close()
    return reads, units_read


def test_pinned_units_are_not_read_from_nvme(megatron_world, tmp_path):
    """Units pinned on the device are read from there, not from NVMe: fewer NVMe weight
    bytes per step, and bit-identical weights after three steps."""
    args = tiny_args("--untie-embeddings-and-output-weights")
    batches = [make_microbatches(2, seed=s) for s in range(3)]
    torch.use_deterministic_algorithms(True)
    plain, pinned = build_model(args, megatron_world), build_model(args, megatron_world)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain_reads, plain_units = _weights_from_nvme_per_step(plain, batches, tmp_path / "a", ())
    pinned_reads, pinned_units = _weights_from_nvme_per_step(pinned, batches, tmp_path / "b",
                                                             (1, 2, 3))
    torch.use_deterministic_algorithms(False)
    # every step reads units 1-3 from the drive unpinned, never pinned; the others both
    for step, (plain_step, pinned_step) in enumerate(zip(plain_units, pinned_units)):
        assert {1, 2, 3} <= plain_step and not {1, 2, 3} & pinned_step, (step, plain_units,
                                                                        pinned_units)
        assert pinned_step == plain_step - {1, 2, 3} != set(), (step, plain_units,
                                                                pinned_units)
    assert all(b < a for a, b in zip(plain_reads, pinned_reads)), (plain_reads, pinned_reads)
    ref = dict(plain.named_parameters())
    for name, p in pinned.named_parameters():
        assert torch.equal(p.detach(), ref[name].detach()), name


def test_memory_limit_pins_units_and_auto_tiers_pick_host(megatron_world, tmp_path, capfd):
    """A generous --snake-gpu-memory-limit pins every unit (named in the start summary);
    --snake-param-tier/--snake-optimizer-tier auto choose host under a large host limit and
    nvme for what does not fit. Same losses every time."""
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.loop import pretrain

    flags = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--deterministic-mode", "--snake-offload", "--snake-offload-dir", str(tmp_path)]
    plain = pretrain(parse_args(flags))
    out = capfd.readouterr().out
    assert "pinned on the device: none" in out and "free space checked" in out
    pinned = pretrain(parse_args([*flags, "--snake-gpu-memory-limit", "1GiB"]))
    assert pinned == plain
    out = capfd.readouterr().out
    assert "pinned on the device: units [0, 1, 2]" in out, out
    auto = parse_args([*flags, "--snake-param-tier", "auto", "--snake-optimizer-tier", "auto"])
    assert pretrain(auto) == plain
    out = capfd.readouterr().out
    assert "(weights 0.1 MiB on host, " in out and "gradients 0.8 MiB on host;" in out, out
    # the flags keep what the user gave: the resolved tiers are the state's, not args'
    assert (auto.snake_param_tier, auto.snake_optimizer_tier) == ("auto", "auto")
    tiny = parse_args([*flags, "--snake-param-tier", "auto", "--snake-optimizer-tier", "auto",
                       "--snake-host-memory-limit", "64MiB"])
    from megatron_snake.training.offloaded_state import (HostBuffers, StateTiers,
                                                         resolve_state_tiers)
    # 64 MiB = 8 buffers of 8 MiB: a quarter (2) holds the weights, nothing is left
    need = HostBuffers(weights=2, optimizer=2, unit_inputs=0)
    assert resolve_state_tiers(tiny, need, pool_buffers=8) == \
        StateTiers(params="host", optimizer="nvme")


def test_snake_groups_keep_one_unit_gradient_on_the_device(megatron_world, tmp_path):
    """G = 2 of M = 4: after a group's backward a unit's partial fp32 gradient leaves the
    device (the next group starts a fresh buffer; the last adds them), so the device never
    holds more than the unit being swept; the weights still follow Megatron + AdamW."""
    import functools

    args = tiny_args("--untie-embeddings-and-output-weights", "--disable-bias-linear")
    batches = [make_microbatches(4, seed=s) for s in range(2)]
    torch.use_deterministic_algorithms(True)
    reference, ours = build_model(args, megatron_world), build_model(args, megatron_world)
    _reference(reference, batches, 0.0)
    on_device_after_release = []
    release = OffloadedUnits.release_unit

    def spying_release(self, unit, *, gradients_final):
        release(self, unit, gradients_final=gradients_final)
        on_device_after_release.append(len(self._grads))

    OffloadedUnits.release_unit = spying_release
    try:
        _snake(ours, batches, 0.0, 0.25, tmp_path, 1,
               schedule=functools.partial(vertical_forward_backward, group_size=2))
    finally:
        OffloadedUnits.release_unit = release
        torch.use_deterministic_algorithms(False)
    assert on_device_after_release and max(on_device_after_release) == 0
    ref = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        rel = ((p.detach() - ref[name].detach()).norm() / ref[name].detach().norm()).item()
        assert rel <= 1e-6, f"{name}: relative weight difference {rel:.2e}"


def test_the_alpha_split_falls_on_a_line_of_the_parameter_it_cuts():
    """For every alpha and data-parallel shard, the two parts tile the rank's shard, and
    the split is the shard's edge, a parameter's edge, or a 16-element line of the
    parameter it cuts, within 8 elements of (1 - alpha) of the shard where such a line
    lies inside it."""
    from megatron_snake.optim.dp_shards import DataParallel
    from megatron_snake.optim.parts import LANE_ELEMENTS, part_bounds
    from megatron_snake.optim.unit_params import FlatLayout, Segment

    sizes = [3367, 1001, 7, 7777, 899, 5, 40]
    offsets = list(itertools.accumulate([0] + sizes))
    lay = FlatLayout(0, [Segment(f"p{i}", None, o, n, True, (n,), i)
                         for i, (o, n) in enumerate(zip(offsets, sizes))])
    moved = 0
    for size, alpha in itertools.product((1, 2, 3, 5), (0.0, 0.1, 0.25, 0.37, 0.5)):
        for rank in range(size):
            dp = DataParallel(rank, size)
            start, end, _ = dp.shard(lay.numel)
            (lo, split), (split2, hi) = part_bounds(lay, alpha, dp)
            assert (lo, split2, hi) == (start, split, end) and start <= split <= end
            raw = start + int(round((1.0 - alpha) * (end - start)))
            moved += split != raw
            if split in (start, end) or split in offsets:
                continue
            seg = next(s for s in lay.segments if s.offset < split < s.offset + s.numel)
            assert (split - seg.offset) % LANE_ELEMENTS == 0, (size, rank, alpha, split)
            assert abs(split - raw) <= LANE_ELEMENTS // 2, (size, rank, alpha, split, raw)
    assert moved > 0      # the case is not trivially on lines


@pytest.mark.parametrize("tier,alpha,buf", [
    ("host", 0.0, 16 << 10), ("nvme", 0.0, 16 << 10),   # 4080 fp32 elements a buffer
    ("host", 0.37, 16 << 10), ("host", 0.37, 1 << 20), ("nvme", 0.37, 1 << 20)])
def test_an_update_cut_at_host_buffers_equals_torch_adamw_per_parameter(tmp_path, tier, alpha,
                                                                         buf):
    """The update runs on the host buffers' own bytes (borrowed), so a parameter can be cut
    where one buffer ends, and the alpha split cuts one too. torch's fused kernel rounds a
    tensor's last (numel mod lanes) elements on a scalar path, so a cut off the parameter's
    16-element lines would change bits: a buffer's edge there is bridged, and the split is
    moved to a line (alpha 0.37 puts it 10 elements off one; with 1 MiB buffers no bridge
    hides that). Small buffers and odd sizes put many cuts inside parameters: after three
    steps the state equals torch.optim.AdamW's, bit for bit."""
    from megatron_snake.optim.unit_params import SHARED, FlatLayout, Segment

    torch.manual_seed(0)
    shapes = [(37, 91), (1001,), (53, 67), (99, 101), (7777,), (61, 83), (29, 31)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    segments, offset = [], 0
    for i, p in enumerate(params):
        segments.append(Segment(f"p{i}", p, offset, p.numel(), p.dim() > 1, p.shape, i))
        offset += p.numel()
    units = UnitParams(units=[FlatLayout(0, segments)], shared=FlatLayout(SHARED, []),
                       shared_owner=None)
    ref_opt = torch.optim.AdamW(
        [{"params": [r for r in ref if r.dim() > 1], "weight_decay": WD},
         {"params": [r for r in ref if r.dim() == 1], "weight_decay": 0.0}],
        lr=LR, fused=True)
    with TensorStore(tmp_path, host_memory_limit=64 * buf, buffer_bytes=buf) as store:
        opt = OffloadedAdamW(units, store, lr=LR, weight_decay=WD, tier=tier, alpha=alpha)
        for _ in range(3):
            grads = [torch.randn(s) for s in shapes]
            for r, g in zip(ref, grads):
                r.grad = g.clone()
            ref_opt.step()
            if tier == "nvme":   # read ahead into host memory: borrowed in place
                for name, part in itertools.product(("master", "exp_avg", "exp_avg_sq"),
                                                    ("bwd", "fwd") if alpha else ("bwd",)):
                    store.prefetch((name, 0, part), tier="host").wait()
            opt.gradient_ready(0, torch.cat([g.reshape(-1) for g in grads]))
            opt.step()
            opt.wait_running()
            opt.flush()        # the deferred (forward) part
        state = opt.layout_state(0)
        opt.close()
    expected = {"master": torch.cat([r.detach().reshape(-1) for r in ref]),
                "exp_avg": torch.cat([ref_opt.state[r]["exp_avg"].reshape(-1) for r in ref]),
                "exp_avg_sq": torch.cat([ref_opt.state[r]["exp_avg_sq"].reshape(-1)
                                         for r in ref])}
    for name, value in expected.items():
        assert torch.equal(state[name], value), \
            f"{name}: {(state[name] != value).sum().item()} elements differ"


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_the_update_writes_each_new_working_weight_once_into_its_record(megatron_world,
                                                                        tmp_path, tier):
    """bf16 working weights from fp32 masters: the update's kernel writes them straight
    into the new record the store lends (its host buffers), which is then stored where
    ``publish`` would have put it: no converted copy is made (``put_converted`` is not
    called for a unit's weights), and every record holds its master cast to bf16 (torch's
    rounding, as Megatron copies its masters into the bf16 parameters)."""
    from megatron_snake.optim.unit_params import SHARED
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.build import build_run
    from megatron_snake.training.data import random_microbatches
    args = parse_args(["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads",
                       "4", "--seq-length", "32", "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--tokenizer-type", "NullTokenizer",
                       "--vocab-size", "256", "--device", "cpu", "--snake-offload", "--bf16",
                       "--snake-param-tier", tier, "--snake-speculate", "off",
                       "--snake-offload-dir", str(tmp_path)])
    with build_run(args, megatron_world, 256, log=lambda _: None) as run:
        store, converted = run.tensor_store, []
        put_converted = store.put_converted

        def counting(key, *a, **k):
            converted.append(key)
            return put_converted(key, *a, **k)

        store.put_converted = counting
        for step in range(3):
            run.step(random_microbatches(args.num_microbatches, args.micro_batch_size,
                                         args.seq_length, 256, seed=step,
                                         device=megatron_world))
        run.optimizer.flush()
        store.synchronize()
        units = [k for k in converted if k[0] == "w" and k[1] != SHARED]
        assert units == [], units
        checked = 0
        for key in run.optimizer.layouts:
            for part in ("bwd", "fwd"):
                if key == SHARED or ("w", key, part) not in store:
                    continue
                master = store.get(("master", key, part)).wait()
                assert torch.equal(store.get(("w", key, part)).wait(),
                                   master.to(torch.bfloat16)), (key, part)
                checked += 1
        assert checked >= 4
