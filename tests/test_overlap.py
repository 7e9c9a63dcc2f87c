"""Overlap mechanisms, so that the device never waits for the host or the drive: gradients
in the fastest tier with room, norms where the gradients are, updated weights kept close
for their read, the emulated device and its roofline, and --snake-trace."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import build_model, make_microbatches, tiny_args
import megatron_snake.emulated_device as emulated_device
import megatron_snake.timeline as timeline
from megatron_snake import vertical_forward_backward
from megatron_snake.models.emulated_compute import emulate_compute, unit_forward_flops
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.offload.unit_inputs import OffloadedUnitInputs
from megatron_snake.offload.unit_weights import OffloadedUnits
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.parts import PARTS
from megatron_snake.optim.unit_params import SHARED, UnitParams
from megatron_snake.schedule.unit_store import CombinedStore
from megatron_snake.storage.store import TensorStore
from megatron_snake.training.train_log import model_flops_per_iteration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the store: host when it fits, else the drive ---------------------------------------
def test_a_spillable_put_goes_to_host_when_it_fits_and_to_the_drive_when_not(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=64 * MiB, buffer_bytes=MiB) as store:
        store.spill_keep_free = 16
        store.put("small", torch.ones(8 * MiB // 4), tier="host", spill="nvme").wait()
        assert store.tiers("small") == ["host"]
        # 64 buffers, 8 resident, 16 kept free: 40 more fit, 48 do not
        big = torch.arange(48 * MiB // 4, dtype=torch.float32)
        store.put("big", big, tier="host", spill="nvme").wait()
        assert store.tiers("big") == ["nvme"], "no room: written to the drive, not raised"
        assert torch.equal(store.get("big").wait(), big)
        assert store.counters.spilled == 1
        with pytest.raises(ValueError, match="spill"):
            store.put("x", big, tier="nvme", spill="host")


def test_spilled_records_use_what_the_planned_host_records_do_not_hold(tmp_path):
    """The pool keeps the planned host buffers not yet taken (``reserved``) from records that
    may go to the drive, and no more: once the planned records hold them they are not
    counted twice, and what they free is room again."""
    with TensorStore(tmp_path, host_memory_limit=64 * MiB, buffer_bytes=MiB) as store:
        store.spill_keep_free, store.pool.reserved = 1, 32

        def spilled(key, mib):
            store.put(key, torch.ones(mib * MiB // 4), tier="host", spill="nvme").wait()
            return store.tiers(key) == ["nvme"]

        assert spilled("a", 40), "32 of 64 buffers are planned: 40 do not fit"
        store.put("planned", torch.ones(32 * MiB // 4), tier="host").wait()
        assert store.tiers("planned") == ["host"]
        assert not spilled("b", 24), "the planned record holds its 32: 31 others are free"
        store.delete("planned")
        store.synchronize()
        assert spilled("c", 16), "the planned 32 are kept free again"
        store.pool.reserved = 0
        assert not spilled("d", 16)


def test_a_converted_put_into_host_memory_is_in_place_without_queueing(tmp_path):
    """New weights (fp32 master pieces, cut wherever their buffers end) go into the host
    tier as bf16 on the calling thread, stored when the call returns even while both
    memory writers are busy: no converted copy is made to be copied again by them."""
    pieces = [torch.randn(n) for n in (100_000, 3, 300_001, 0, 123_456)]
    expected = torch.cat(pieces).to(torch.bfloat16)
    with TensorStore(tmp_path, host_memory_limit=64 * MiB, buffer_bytes=256 * 1024) as store:
        store.put("w", torch.zeros(7), tier="host").wait()   # an old value, replaced
        busy = threading.Event()
        blockers = [store._memory_writers.submit(busy.wait) for _ in range(2)]
        try:
            stored = store.put_converted("w", pieces, torch.bfloat16, tier="host",
                                         kind="weights", spill="nvme").done()
        finally:
            busy.set()
            for blocker in blockers:
                blocker.result()
        assert stored, "in place when put_converted returns, not queued for a writer"
        assert store.tiers("w") == ["host"]
        got = store.get("w").wait()
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
        for piece in pieces:   # the pieces may change once the put returns
            piece.fill_(7.0)
        assert torch.equal(store.get("w").wait(), expected)
        # no room now: converted here and put to the drive instead
        store.spill_keep_free = store.pool.count
        store.put_converted("w", pieces, torch.bfloat16, tier="host", kind="weights",
                            spill="nvme").wait()
        assert store.tiers("w") == ["nvme"]
        assert torch.equal(store.get("w").wait(), torch.full((expected.numel(),), 7.0,
                                                             dtype=torch.bfloat16))
        store.synchronize()
        assert store.pool.resident == 0, "the replaced values' host buffers are free"


def test_a_prefetch_if_room_is_skipped_when_the_pool_has_none(tmp_path):
    with TensorStore(tmp_path, host_memory_limit=64 * MiB, buffer_bytes=MiB) as store:
        store.put("k", torch.ones(4 * MiB // 4), tier="nvme").wait()
        store.spill_keep_free = store.pool.count   # as if the plan held every buffer
        store.prefetch("k", "host", if_room=True, background=True).wait()
        assert store.tiers("k") == ["nvme"], "skipped, not raised, not waited"
        store.spill_keep_free = 1
        store.prefetch("k", "host", if_room=True).wait()
        assert store.tiers("k") == ["host", "nvme"]


# --- gradients and their norms -----------------------------------------------------------
def _optimizer_with_gradients(model, tmp_path, *, clip, host_limit, seed=0):
    params = UnitParams.of(GPTUnits(model, 2))
    tmp_path.mkdir(exist_ok=True)
    store = TensorStore(tmp_path, host_memory_limit=host_limit)
    opt = OffloadedAdamW(params, store, lr=1e-3, weight_decay=0.0, clip_grad=clip, alpha=0.3)
    gen = torch.Generator().manual_seed(seed)
    grads = {lay.key: torch.randn(lay.numel, generator=gen) for lay in params.all_layouts()}
    for key, grad in grads.items():
        opt.gradient_ready(key, grad.clone())
    store.synchronize()
    return store, opt, params, grads


def test_clipping_keeps_gradients_on_the_host_tier_when_they_fit(megatron_world, tmp_path):
    model = build_model(tiny_args(), megatron_world)
    store, opt, params, _ = _optimizer_with_gradients(model, tmp_path / "a", clip=1.0,
                                                      host_limit=256 * MiB)
    try:
        keys = [k for k in store.keys() if k[0] == "grad"]
        assert keys and all(store.tiers(k) == ["host"] for k in keys), \
            "gradients waiting for the global norm sit in host memory"
        assert store.counters.by_kind["grad"]["nvme"] == [0, 0], "none went to the drive"
    finally:
        opt.close()
        store.close()
    # a pool with no room beyond what is kept free: the drive
    store, opt, _, _ = _optimizer_with_gradients(model, tmp_path / "b", clip=1.0,
                                                 host_limit=16 * MiB)
    try:
        store.spill_keep_free = store.pool.count   # as if the plan held the whole pool
        opt.gradient_ready(0, torch.ones(params.units[0].numel))
        store.synchronize()
        assert all(store.tiers(("grad", 0, part)) == ["nvme"] for part in PARTS
                   if ("grad", 0, part) in store)
    finally:
        opt.close()
        store.close()


def test_gradients_are_scaled_only_when_the_norm_is_over_the_limit(megatron_world, tmp_path):
    """As Megatron's clip_grad_by_total_norm_fp32: a coefficient of 1 (the norm within
    --clip-grad) scales nothing, rather than a pass over every gradient that changes no
    bit; one below 1 scales them."""
    model = build_model(tiny_args(), megatron_world)
    for clip, applied in ((1.0, True), (1e9, False)):
        store, opt, _, _ = _optimizer_with_gradients(model, tmp_path / str(clip), clip=clip,
                                                     host_limit=256 * MiB)
        try:
            opt.step()
            assert (opt._clip_coef is not None) == applied, clip
            assert not applied or float(opt._clip_coef) < 1.0
        finally:
            opt.close()
            store.close()


def test_gradient_norms_computed_where_the_gradients_are_equal_torchs(megatron_world,
                                                                      tmp_path):
    model = build_model(tiny_args(), megatron_world)
    store, opt, params, grads = _optimizer_with_gradients(model, tmp_path, clip=1.0,
                                                          host_limit=256 * MiB)
    try:
        assert all(n.device == grads[0].device for n in opt._norms.values())
        _, grad_norm, _ = opt.step()
        # torch's own norm over the same per-parameter gradients (every parameter counts:
        # no tensor-parallel duplicates here)
        pieces = [grads[lay.key][seg.offset:seg.offset + seg.numel]
                  for lay in params.all_layouts() for seg in lay.segments]
        expected = torch.nn.utils.get_total_norm(pieces)
        assert grad_norm == pytest.approx(expected.item(), rel=1e-6)
        assert opt._clip_coef.device.type == "cpu", "the update on the CPU worker uses it"
    finally:
        opt.close()
        store.close()


# --- weights: updated just before their read, kept close ---------------------------------
def test_a_deferred_update_publishes_to_host_and_the_read_moves_it_to_the_drive(
        megatron_world, tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny_args(), megatron_world)
    units = GPTUnits(model, 2)
    params = UnitParams.of(units)
    with TensorStore(tmp_path, host_memory_limit=256 * MiB) as tstore:
        opt = OffloadedAdamW(params, tstore, lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                             alpha=0.3)
        weights = OffloadedUnits(params, tstore, opt, device=torch.device("cpu"),
                                 dtype=torch.float32)
        published, publish = [], weights.publish

        def watch(key, part, master, soon=False, name="w"):
            published.append((key, part, soon))
            publish(key, part, master, soon=soon, name=name)

        opt.on_weights = watch
        for step in range(2):
            mbs = make_microbatches(2, seed=step)
            store = CombinedStore(OffloadedUnitInputs(tstore, "nvme", 2, torch.device("cpu")),
                                  weights)
            vertical_forward_backward(model, mbs, checkpoint_interval=2, store=store)
            store.inputs.finish_step()
            opt.step()
        tstore.synchronize()
        # step 2's forward sweep applied step 1's clipped updates one unit ahead
        unit_updates = [p for p in published if p[0] in range(units.num_units)]
        assert unit_updates and all(soon for _, _, soon in unit_updates)
        assert tstore.counters.by_kind["weights"]["host"][1] > 0, "published into host"
        # every unit read since then: its weights are back on the drive only (no host copy
        # left behind: the pool is not filled by weights)
        for unit in range(units.num_units):
            for part in PARTS:
                if ("w", unit, part) in tstore:
                    assert tstore.tiers(("w", unit, part)) == ["nvme"], (unit, part)
        weights.load_all()
        opt.close()


@contextmanager
def _clipped_training(megatron_world, tmp_path, alpha=0.0):
    """A tiny GPT, one layer a unit, its weights and its clipped AdamW's state on the drive:
    (model, units, params, tensor store, optimizer, weights)."""
    torch.manual_seed(0)
    model = build_model(tiny_args(), megatron_world)
    units = GPTUnits(model, 1)
    params = UnitParams.of(units)
    with TensorStore(tmp_path, host_memory_limit=256 * MiB) as tstore:
        opt = OffloadedAdamW(params, tstore, lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                             alpha=alpha)
        weights = OffloadedUnits(params, tstore, opt, device=torch.device("cpu"),
                                 dtype=torch.float32)
        try:
            yield model, units, params, tstore, opt, weights
        finally:
            opt.close()


def _two_steps(model, tstore, weights, opt, events: list, optimizer_after=(0, 1)) -> None:
    """Two steps of the vertical schedule over ``weights`` (``events`` cleared before each,
    so it keeps the second's), the optimizer stepped after the steps in
    ``optimizer_after``."""
    for step in range(2):
        events.clear()
        store = CombinedStore(OffloadedUnitInputs(tstore, "nvme", 2, torch.device("cpu")),
                              weights)
        vertical_forward_backward(model, make_microbatches(2, seed=step),
                                  checkpoint_interval=1, store=store)
        store.inputs.finish_step()
        if step in optimizer_after:
            opt.step()


def _record_weight_reads(tstore, events: list, entry) -> None:
    """Spy on ``tstore.get``: each read of working weights appends ``entry(key)`` to
    ``events`` as it is issued."""
    get = tstore.get

    def spy_get(key, *args, **kwargs):
        if key[0] == "w":
            events.append(entry(key))
        return get(key, *args, **kwargs)

    tstore.get = spy_get


def test_weights_stay_in_host_from_the_forward_read_to_the_backward_read(megatron_world,
                                                                       tmp_path):
    """A unit's weights published into host memory are not evicted by their forward read:
    the backward read finds them there and moves them down (before, every forward read
    wrote them to the drive and the backward sweep read them back, its reads queued
    behind those writes, themselves behind the forward sweep's updated state)."""
    with _clipped_training(megatron_world, tmp_path) as (model, units, params, tstore, opt,
                                                         weights):
        events, evict = [], tstore.evict

        def spy_evict(key, *args, **kwargs):
            events.append(("evict", key[1]))
            return evict(key, *args, **kwargs)

        tstore.evict = spy_evict
        _record_weight_reads(tstore, events, lambda key: ("read", key[1],
                                                          tuple(tstore.tiers(key))))
        _two_steps(model, tstore, weights, opt, events, optimizer_after=(0, 1))
        # step 2: the units of the forward sweep (the loss unit runs only in the backward)
        forward = range(units.num_units - 1)
        assert len(forward) >= 2
        for unit in forward:
            reads = [i for i, e in enumerate(events) if e[:2] == ("read", unit)]
            assert len(reads) == 2, (unit, events)
            assert ("evict", unit) not in events[reads[0] + 1:reads[1]], (unit, events)
            assert "host" in events[reads[1]][2], (unit, events)   # read from the host copy
            assert ("evict", unit) in events[reads[1]:], (unit, events)


def test_the_forward_sweep_queues_the_next_update_before_it_reads_a_units_weights(
        megatron_world, tmp_path):
    """The optimizer worker goes from one unit's update to the next while the main thread
    reads the unit's weights: unit u+1's update is queued before unit u's weights are read
    (before, it was queued after, so the updates and the reads took turns)."""
    with _clipped_training(megatron_world, tmp_path) as (model, units, params, tstore, opt,
                                                         weights):
        events, start_update = [], opt.start_update

        def spy_start(key, soon=False):
            if opt.pending(key):
                events.append(("update", key))
            start_update(key, soon)

        opt.start_update = spy_start
        _record_weight_reads(tstore, events, lambda key: ("read", key[1]))
        _two_steps(model, tstore, weights, opt, events, optimizer_after=(0,))
        # step 2's forward sweep applied step 1's updates (clipping: all deferred)
        forward = [unit for unit in range(units.num_units - 1)]
        assert len(forward) >= 2
        for unit in forward:
            read = events.index(("read", unit))
            for lay in params.layouts_owned_by(unit + 1):
                assert events.index(("update", lay.key)) < read, (unit, events)


def _record_part_reads_and_updates(opt, tstore) -> list:
    """Spy on the optimizer's ``finish_update`` and the store's weight reads: returns the
    list they append ("updated", key, parts) and ("read", key, part) to, in order."""
    events, finish_update = [], opt.finish_update

    def spy_finish(key, soon=False, parts=PARTS):
        finish_update(key, soon, parts)
        events.append(("updated", key, tuple(parts)))

    opt.finish_update = spy_finish
    _record_weight_reads(tstore, events, lambda key: ("read", key[1], key[2]))
    return events


def _first_part_read_before_second_updated(events: list, key) -> bool:
    first_read = events.index(("read", key, PARTS[0]))
    second_done = next(i for i, e in enumerate(events)
                       if e[:2] == ("updated", key) and PARTS[1] in e[2])
    return first_read < second_done


def test_a_units_weights_are_read_part_by_part_as_each_parts_update_finishes(
        megatron_world, tmp_path):
    """With clipping every update waits for the forward sweep; a unit's first part is read
    as soon as its update is done, while the second part's update runs (before, both parts'
    updates were waited for before either part was read)."""
    with _clipped_training(megatron_world, tmp_path, alpha=0.25) as (
            model, units, params, tstore, opt, weights):
        events = _record_part_reads_and_updates(opt, tstore)
        _two_steps(model, tstore, weights, opt, events, optimizer_after=(0,))
        forward = [unit for unit in range(units.num_units - 1)]
        assert len(forward) >= 2
        for unit in forward:
            assert _first_part_read_before_second_updated(events, unit), (unit, events)


def test_the_shared_layout_is_read_part_by_part_and_its_parameters_are_not_copied(
        megatron_world, tmp_path):
    """The shared layout's update waits for the forward sweep too: its first part is read
    while its second part's update runs (before, both were waited for, then the whole
    layout read and copied into the parameters on the main thread), and the parameters
    take views of the buffer read, as a unit's do."""
    with _clipped_training(megatron_world, tmp_path, alpha=0.25) as (
            model, units, params, tstore, opt, weights):
        assert params.shared.segments and len(weights.record_parts(params.shared)) == 2
        events = _record_part_reads_and_updates(opt, tstore)

        def storages():
            return [seg.param.data.untyped_storage().data_ptr()
                    for seg in params.shared.segments]

        for seg in params.shared.segments:   # each in memory of its own
            seg.param.data = seg.param.data.clone()
        own = set(storages())
        _two_steps(model, tstore, weights, opt, events, optimizer_after=(0,))
        assert _first_part_read_before_second_updated(events, SHARED), events
        # not copied into the parameters' own memory: views of the one buffer read
        assert len(set(storages())) == 1 and not own & set(storages())


def test_the_backward_sweep_reads_ahead_the_state_the_forward_sweep_updates(megatron_world,
                                                                           tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny_args(), megatron_world)
    params = UnitParams.of(GPTUnits(model, 2))
    with TensorStore(tmp_path, host_memory_limit=1024 * MiB) as tstore:  # room for all
        opt = OffloadedAdamW(params, tstore, lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                             alpha=0.3)
        weights = OffloadedUnits(params, tstore, opt, device=torch.device("cpu"),
                                 dtype=torch.float32)
        store = CombinedStore(OffloadedUnitInputs(tstore, "nvme", 2, torch.device("cpu")),
                              weights)
        vertical_forward_backward(model, make_microbatches(2, seed=0), checkpoint_interval=2,
                                  store=store)
        store.inputs.finish_step()
        tstore.synchronize()
        # the first layout the next forward sweep updates has its master weights and
        # moments in host memory (and still on the drive); the read ahead was issued in
        # the backward sweep, before the step boundary
        first = weights._update_order[0]
        for name in ("master", "exp_avg", "exp_avg_sq"):
            for part in PARTS:
                assert tstore.tiers((name, first, part)) == ["host", "nvme"], (name, part)
        # and, one layout after the other as each read comes in, every layout's: more
        # layouts than the sweep visits units (the shared one too)
        assert len(weights._update_order) > len(params.units)

        def read_ahead(key):
            return all(tstore.tiers((name, key, part)) == ["host", "nvme"]
                       for name in ("master", "exp_avg", "exp_avg_sq") for part in PARTS)
        deadline = time.monotonic() + 30
        while not all(map(read_ahead, weights._update_order)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [read_ahead(key) for key in weights._update_order] == \
            [True] * len(weights._update_order)
        opt.step()
        read_before = tstore.counters.by_kind["optim"]["nvme"][0]
        opt.flush()   # the update of that layout reads nothing of it from the drive
        tstore.synchronize()
        assert all(tstore.tiers((name, first, part)) == ["nvme"]
                   for name in ("master", "exp_avg", "exp_avg_sq") for part in PARTS), \
            "the update wrote the new state to its tier and freed the host copy"
        assert tstore.counters.by_kind["optim"]["nvme"][0] - read_before < \
            sum(4 * 3 * lay.numel for lay in params.all_layouts()), \
            "part of the state came from host memory"
        weights.load_all()
        opt.close()


# --- the emulated device and its roofline -------------------------------------------------
def test_the_emulated_device_runs_the_flops_over_its_rate_apart_from_the_host(
        megatron_world, tmp_path):
    args = tiny_args()
    model = build_model(args, megatron_world)
    units = GPTUnits(model, 2)
    mbs = make_microbatches(2, seed=0)
    before = vertical_forward_backward(model, mbs, checkpoint_interval=2, units=units)
    model.zero_grad()
    tflops = 1e-6   # slow enough to dwarf the host's own time
    with emulate_compute(units, tflops) as device, timeline.recording() as recorded:
        vertical_forward_backward(model, mbs, checkpoint_interval=2, units=units)
        host_done = time.perf_counter() - recorded.t0
        device.synchronize()
    waits = sorted((s for s in recorded.spans if s["cat"] == "device"),
                   key=lambda s: s["start"])
    assert {s["thread"] for s in waits} == {"device"}
    # one in-order queue: each span starts when the one before ends, or later
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in zip(waits, waits[1:]))
    assert all(s["end"] - s["start"] == pytest.approx(s["args"]["seconds"], abs=1e-9)
               for s in waits)
    # the host queued the work and went on: it was done before the device
    assert host_done < waits[-1]["end"] - 0.5 * sum(s["args"]["seconds"] for s in waits)
    batch, seq = mbs[0]["tokens"].shape
    # forward sweep: units 0..U-2 once per micro-batch; backward: every unit, 1 + 2 waits
    flops = sum(unit_forward_flops(units, u, batch, seq) for u in range(units.num_units - 1))
    flops += 3 * sum(unit_forward_flops(units, u, batch, seq) for u in range(units.num_units))
    nominal = sum(s["args"]["seconds"] for s in waits)
    assert nominal == pytest.approx(len(mbs) * flops / (tflops * 1e12), rel=1e-9)
    # the FLOPs are Megatron's (train_log's count of a step: 3 x forward, the output layer
    # included), here for the len(mbs) micro-batches of this step, but for the attention
    # core: the emulated device computes it whole, Megatron-LM 0.16.1 counts it causal
    # (half of QK^T and of its product with V: 2 x seq x width FLOPs a token and layer)
    every_unit = sum(unit_forward_flops(units, u, batch, seq) for u in range(units.num_units))
    megatron = model_flops_per_iteration(
        argparse.Namespace(**{**vars(args), "seq_length": seq,
                              "global_batch_size": batch * len(mbs)}), units.gpt.vocab_size)
    width = (args.kv_channels or args.hidden_size // args.num_attention_heads) * \
        args.num_attention_heads
    causal_half = 3 * 2 * seq * width * args.num_layers * batch * seq * len(mbs)
    assert 3 * len(mbs) * every_unit == pytest.approx(megatron + causal_half, rel=1e-12)
    model.zero_grad()
    after = vertical_forward_backward(model, mbs, checkpoint_interval=2, units=units)
    assert [torch.equal(a, b) for a, b in zip(before, after)] == [True] * len(mbs), \
        "outside the block the units compute again, the same numbers"


@pytest.mark.parametrize("rate", [1e6, None], ids=["memory rate", "none"])
def test_the_device_shares_update_is_time_on_the_emulated_devices_memory(megatron_world,
                                                                         tmp_path, rate):
    """With a memory rate, the update of a layout of the device share is the emulated
    device's work: a device span of its bytes over the rate (the gradient read, the master
    and both moments read and written: 28 B a parameter without the clip), queued while the
    host goes on, its state left as it was; the other layouts update on the host's kernel.
    Without the rate, the share's update is the host's arithmetic (its master decays)."""
    args = tiny_args("--untie-embeddings-and-output-weights")
    model = build_model(args, megatron_world)
    units = GPTUnits(model, 2)
    params = UnitParams.of(units)
    share = params.units[0].key
    with TensorStore(str(tmp_path), host_memory_limit=256 * MiB) as tstore:
        opt = OffloadedAdamW(params, tstore, lr=1e-3, weight_decay=0.1, clip_grad=0.0,
                             device_share=[share])
        weights = OffloadedUnits(params, tstore, opt, device=torch.device("cpu"),
                                 dtype=torch.float32, pinned=[0])
        master = {part: tstore.get(("master", share, part)).wait().clone()
                  for part, _, _ in opt.states.parts(share)}
        mbs = make_microbatches(2, seed=0)
        # the rate is slow enough to dwarf the host's own time
        with emulate_compute(units, 1e3, memory_bytes_per_s=rate) as device, \
                timeline.recording() as recorded:
            store = CombinedStore(OffloadedUnitInputs(tstore, "host", len(mbs),
                                                       torch.device("cpu")), weights)
            vertical_forward_backward(model, mbs, checkpoint_interval=2, store=store)
            store.inputs.finish_step()
            host_done = time.perf_counter()   # the backward sweep queued the share's update
            opt.step()
            opt.flush()
            device.synchronize()
        device_updates = [s for s in recorded.spans if s["name"] == "device adamw"]
        host_params = sum(s["args"]["params"] for s in recorded.spans
                          if s["cat"] == "cpu adamw")
        others = sum(lay.numel for lay in params.all_layouts() if lay.key != share)
        unchanged = [torch.equal(tstore.get(("master", share, part)).wait(), before)
                     for part, before in master.items()]
        weights.load_all()
        opt.close()
    if rate is None:
        assert not device_updates and host_params == others + params.units[0].numel
        assert unchanged == [False] * len(master)
        return
    assert sorted(s["args"]["params"] for s in device_updates) == \
        sorted(hi - lo for _, lo, hi in opt.states.parts(share))
    assert all(s["args"]["seconds"] == pytest.approx(28 * s["args"]["params"] / rate)
               and s["thread"] == "device" for s in device_updates)
    # queued at unit 0's gradient, the backward sweep's last, and not waited for: the host
    # waits for the device only where it reads the step's norm
    last = max(device_updates, key=lambda s: s["end"])
    assert host_done - recorded.t0 < last["end"] - 0.5 * last["args"]["seconds"], \
        "the host waited for the device's update"
    assert host_params == others and unchanged == [True] * len(master)


def test_the_store_waits_for_the_emulated_device_where_a_gpu_run_waits_for_events(tmp_path):
    """A put's source is copied once the device has produced it, and a get fills a buffer
    once the device is done with it; without the emulated device, neither waits."""
    work = 0.4
    with TensorStore(str(tmp_path), host_memory_limit=64 * MiB) as store:
        src, buf = torch.ones(1024), torch.empty(1024)
        t0 = time.perf_counter()
        store.put("a", src, tier="host").wait()
        store.get("a", out=buf).wait()
        assert time.perf_counter() - t0 < work / 2
        with emulated_device.emulating() as device:
            device.launch(work)            # the kernel that writes src
            t0 = time.perf_counter()
            store.put("b", src, tier="host").wait()
            assert time.perf_counter() - t0 >= work - 0.01
            device.launch(work)            # a kernel that still reads buf
            t0 = time.perf_counter()
            store.get("b", out=buf).wait()
            assert time.perf_counter() - t0 >= work - 0.01
        assert torch.equal(buf, src)


def test_copies_within_the_emulated_devices_memory_are_no_host_traffic(tmp_path):
    """The device tier's records and the device's buffers are the emulated device's memory:
    a put of a device value onto the device tier, a read back into a device buffer and a
    conversion of device values into a device-tier record move no host memory (as on a
    GPU), and the values are still right; on a machine without a GPU or an emulated device
    the same copies are host copies, counted."""
    def traffic(emulate: bool):
        (tmp_path / str(emulate)).mkdir()
        with TensorStore(str(tmp_path / str(emulate)), host_memory_limit=64 * MiB) as store:
            src, buf = torch.arange(1024.0), torch.empty(1024)
            with emulated_device.emulating() if emulate else nullcontext():
                store.put("a", src, tier="gpu").wait()
                store.get("a", out=buf).wait()
                store.put_converted("b", [src[:512], src[512:]], torch.bfloat16,
                                    tier="gpu").wait()
                converted = store.get("b").wait()
            assert torch.equal(buf, src) and torch.equal(converted, src.bfloat16())
            return store.copies.traffic.snapshot()
    assert sum(traffic(emulate=True).values()) == 0
    plain = traffic(emulate=False)
    # without a device, the puts onto the device tier count their source's side (4 KiB,
    # 2 KiB); the reads 4 KiB and 2 KiB each way, the conversion 4 KiB read and 2 written
    assert (plain["crossing"], plain["copy"]) == (4096 + 2048, 2 * 4096 + 2 * 2048 + 6144)


def test_with_a_memory_rate_the_emulated_devices_own_copies_are_time_on_it(tmp_path):
    """With a memory rate, a copy within the device's memory (a device value put onto the
    device tier, a device-tier record read into a device buffer) takes its bytes read and
    written over the rate on a copy engine the caller waits for, and a cast of device values
    into a record is a kernel on the device's clock (a "device cast" span) the host does not
    wait for; no host memory traffic."""
    rate, n = 40 * MiB, 2 * MiB            # 0.1 s a copy of 2 MiB (read and written)
    with TensorStore(str(tmp_path), host_memory_limit=64 * MiB) as store:
        src, buf = torch.ones(n // 4), torch.empty(n // 4)
        with emulated_device.emulating(memory_bytes_per_s=rate) as device, \
                timeline.recording() as recorded:
            t0 = time.perf_counter()
            store.put("a", src, tier="gpu").wait()
            store.get("a", out=buf).wait()
            assert time.perf_counter() - t0 >= 2 * 2 * n / rate - 0.01
            t0 = time.perf_counter()
            store.put_converted("b", [src], torch.bfloat16, tier="gpu")
            assert time.perf_counter() - t0 < (n + n // 2) / rate / 2
            device.synchronize()
        assert sum(store.copies.traffic.snapshot().values()) == 0
    casts = [s for s in recorded.spans if s["name"] == "device cast"]
    assert [s["args"]["seconds"] for s in casts] == [pytest.approx((n + n // 2) / rate)]


def test_the_emulated_host_link_carries_the_devices_copies_without_the_cpu(tmp_path):
    """With a host link, the device's copies to and from host memory (the thread that runs
    the device puts and gets) take bytes / rate on one engine per direction, in order, and
    no CPU copy; the workers' host tensors are copied by the CPU and wait for no device
    work, as on a GPU where they have no event."""
    rate, n = 40 * MiB, 4 * MiB            # 0.1 s a copy
    with TensorStore(str(tmp_path), host_memory_limit=64 * MiB) as store:
        src, buf = torch.ones(n // 4), torch.empty(n // 4)
        with emulated_device.emulating(link_bytes_per_s=rate) as device, \
                timeline.recording() as recorded:
            t0 = time.perf_counter()
            puts = [store.put(("act", i), src, tier="host") for i in range(2)]
            puts.append(store.put("to-drive", src, tier="nvme"))
            for handle in puts:
                handle.wait()
            assert time.perf_counter() - t0 >= 3 * n / rate - 0.01   # one d2h engine
            store.get(("act", 0), out=buf).wait()
            store.get("to-drive", out=buf).wait()
            device.launch(0.5)                 # device work the host's tensors do not wait for
            host = torch.full((n // 4,), 2.0)
            t0 = time.perf_counter()
            worker = ThreadPoolExecutor(1)
            worker.submit(lambda: store.put("host", host, tier="host").wait()).result()
            assert time.perf_counter() - t0 < 0.25
            back = worker.submit(lambda: store.get("host").wait()).result()
            worker.shutdown()
            device.synchronize()
        assert torch.equal(back, host)
    link = [s for s in recorded.spans if s["cat"] == "link"]
    assert sorted(s["name"] for s in link) == ["link d2h"] * 3 + ["link h2d"] * 2
    assert all(s["args"]["bytes"] == n and s["args"]["seconds"] == pytest.approx(n / rate)
               and s["thread"] == s["name"] for s in link)
    d2h = sorted((s for s in link if s["name"] == "link d2h"), key=lambda s: s["start"])
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in zip(d2h, d2h[1:]))
    copies = [(s["name"], s["args"]["bytes"]) for s in recorded.spans if s["cat"] == "host copy"]
    assert copies == [("host write misc", n), ("host read misc", n)]   # the worker's only


HELD_PUT = 4 * MiB


def _link_spans_of_a_read_during_a_held_put(tmp_path, monkeypatch, tier, read) -> list:
    """The emulated host link's copies (name, bytes) when ``read(store)`` runs while a
    worker's put of HELD_PUT bytes to ``tier`` is still writing (its source copy held
    until the read has been issued, or 5 s); ``read`` returns a handle to wait for, or
    None."""
    with TensorStore(str(tmp_path), host_memory_limit=64 * MiB) as store:
        release = threading.Event()
        contiguous_source = store.copies.contiguous_source

        def held(tensor, ready):      # the put is still writing while the device reads
            release.wait(5)
            return contiguous_source(tensor, ready)

        monkeypatch.setattr(store.copies, "contiguous_source", held)
        host = torch.full((HELD_PUT // 4,), 2.0)
        with emulated_device.emulating(link_bytes_per_s=40 * MiB), \
                timeline.recording() as recorded:
            worker = ThreadPoolExecutor(1)
            put = worker.submit(lambda: store.put("w", host, tier=tier)).result()
            pending = read(store)
            release.set()
            put.wait()
            if pending is not None:
                pending.wait()
            worker.shutdown()
    return [(s["name"], s["args"]["bytes"]) for s in recorded.spans if s["cat"] == "link"]


def test_the_emulated_device_reads_a_host_put_still_writing_over_its_link(tmp_path,
                                                                          monkeypatch):
    """A device get served from a worker's put that is still writing (forwarding, as of
    weights just published) is a copy over the host link, as on a GPU's copy stream, not
    a CPU copy on the thread that runs the device."""
    def read(store):
        store.get("w").wait()

    link = _link_spans_of_a_read_during_a_held_put(tmp_path, monkeypatch, "nvme", read)
    assert link == [("link h2d", HELD_PUT)]


def test_weights_put_onto_the_device_cross_the_link_once_when_read_at_once(tmp_path,
                                                                            monkeypatch):
    """New weights an update puts onto the device tier (a pinned unit's) and the unit reads
    while that put is still copying: the read waits for the put and copies on the device,
    so the weights cross the host link once, not a second time from the put's source.
    (Over the emulated link no byte moves: no values to check.)"""
    link = _link_spans_of_a_read_during_a_held_put(
        tmp_path, monkeypatch, "gpu",
        lambda store: store.get("w", out=torch.empty(HELD_PUT // 4)))
    assert link == [("link h2d", HELD_PUT)]


def _span(name, cat, start, end, **args):
    return {"name": name, "cat": cat, "thread": "t", "start": start, "end": end, "args": args}


def test_the_roofline_is_the_busiest_resource_per_phase_on_a_synthetic_step():
    bench = _tool("bench_overlap")
    rates = {"drive_read": 100.0, "drive_write": 50.0, "copy": 1000.0, "update": 10.0}
    spans = [
        _span("forward_backward", "step", 0.0, 9.0),
        _span("forward sweep", "sweep", 0.0, 4.0),
        _span("device", "device", 0.1, 1.1, seconds=1.0),          # forward: compute 1 s
        _span("drive read grad", "drive", 0.2, 2.0, bytes=200),     # 2 s
        _span("drive write optim", "drive", 0.3, 3.0, bytes=100),   # + 2 s = 4 s at the
        # probes' rates, but the drive was in flight for 2.8 s: it needed no more
        _span("fused adamw", "cpu adamw", 0.5, 1.0, params=20),     # 2 s
        _span("backward sweep", "sweep", 4.0, 9.0),
        _span("device", "device", 4.0, 7.0, seconds=3.0),           # backward: compute 3 s
        _span("drive read weights", "drive", 4.0, 6.0, bytes=100),  # 1 s at the probe's rate
        _span("host write ckpt", "host copy", 4.0, 4.5, bytes=500),  # 0.5 s
        _span("link d2h", "link", 4.0, 6.5, seconds=2.5, bytes=5),   # the busier direction
        _span("link h2d", "link", 4.0, 6.0, seconds=2.0, bytes=5),   # runs beside it
        _span("fused adamw", "cpu adamw", 5.0, 6.0, params=10),     # 1 s
        _span("optimizer step", "step boundary", 9.0, 10.0),
    ]
    out = bench.roofline(spans, rates)
    assert out["measured_s"] == 10.0
    assert out["phases"]["forward"]["drive"] == pytest.approx(2.8)
    assert out["phases"]["forward"]["roofline_s"] == pytest.approx(2.8)   # the drive
    assert out["phases"]["backward"]["drive"] == pytest.approx(1.0)
    assert out["phases"]["backward"]["roofline_s"] == pytest.approx(3.0)  # the device
    assert out["phases"]["backward"]["host link"] == pytest.approx(2.5)
    assert out["phases"]["forward"]["host link"] == 0.0
    assert out["roofline_s"] == pytest.approx(5.8)
    assert out["bound_s"] == pytest.approx(4.0)    # compute 4, drive 3.8, update 3 over the step
    # the drive in flight 0.2-3.0 s (the two transfers overlap): 300 bytes in 2.8 s
    assert out["phases"]["forward"]["drive_busy_s"] == pytest.approx(2.8)
    assert out["phases"]["forward"]["drive_GBps_while_busy"] == pytest.approx(300 / 2.8 / 1e9)
    assert out["phases"]["backward"]["drive_busy_s"] == pytest.approx(2.0)


# --- --snake-trace ----------------------------------------------------------------------
def test_snake_trace_writes_a_chrome_trace_of_one_iteration(tmp_path):
    trace = tmp_path / "step.json"
    (tmp_path / "off").mkdir()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), "--snake-offload",
         "--snake-offload-dir", str(tmp_path / "off"), "--train-iters", "2",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--global-batch-size", "4", "--log-interval", "1",
         "--snake-trace", str(trace), "--clip-grad", "0", "--snake-alpha", "0.3"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--snake-trace: iteration 2 written" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    cats = {e.get("cat") for e in events if e["ph"] == "X"}
    assert {"compute", "sweep", "store", "drive", "optimizer", "cpu adamw"} <= cats
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "MainThread" in threads and any(t.startswith("snake-store-write") for t in threads)
    assert any(t.startswith("snake-adamw") for t in threads)
    assert not os.path.islink(trace) and (os.stat(trace).st_mode & 0o777) == 0o600


def test_snake_trace_into_a_missing_directory_is_refused_at_start(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), "--snake-offload",
         "--snake-offload-dir", str(tmp_path), "--snake-trace", str(tmp_path / "no" / "t.json")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--snake-trace" in proc.stderr and "existing, writable directory" in proc.stderr
