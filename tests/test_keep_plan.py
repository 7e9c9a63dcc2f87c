"""The adaptive keep's plan on synthetic timelines: which saves the drive can hide."""

from __future__ import annotations

import json

import pytest

from megatron_snake.offload.keep_plan import Save, SaveProfile, plan_offload

MB = 1 << 20


def _mirror(sizes, step=1.0, group=0, start=0.0):
    """A forward packing len(sizes) saves evenly over the first half of [start, start+step],
    the backward unpacking them in reverse over the second half (each used once)."""
    n, half = len(sizes), step / 2
    saves = []
    for i, nbytes in enumerate(sizes):
        pack = start + half * i / n
        unpack = start + step - half * (i + 1) / n
        saves.append(Save(group, i, nbytes, pack, unpack, unpack))
    unpacks = sorted(s.unpack_s for s in saves)
    return saves, unpacks


def _profile(*groups, step):
    saves, unpacks = [], {}
    for g, (s, u) in enumerate(groups):
        saves += s
        unpacks[g] = u
    return SaveProfile(saves, unpacks, step)


def test_fast_drive_offloads_all():
    saves, unpacks = _mirror([MB] * 8)
    plan = plan_offload(_profile((saves, unpacks), step=1.0), 1e15, 1e15)
    assert set(plan.offload) == {(0, i) for i in range(8)}
    assert plan.bytes_offloaded == 8 * MB
    assert plan.added_s < 1e-6
    assert plan.peak_after < plan.peak_before == 8 * MB


def test_slow_drive_offloads_none():
    saves, unpacks = _mirror([MB] * 8)
    plan = plan_offload(_profile((saves, unpacks), step=1.0), 1.0, 1.0)
    assert plan.offload == {}
    assert plan.peak_after == plan.peak_before and plan.added_s == 0
    assert "all kept: no save's write and read-back fit" in plan.summary()


def test_long_lived_big_tensor_is_chosen_over_short_lived_ones():
    # backward starts at 1.0; the 4 MiB tensor's read takes 0.7 s of its 0.75 s to its use,
    # so a small read queued ahead of it (they are all unpacked first) makes it late
    saves, unpacks = _mirror([4 * MB, MB, MB, MB], step=2.0)
    rate = 4 * MB / 0.7
    plan = plan_offload(_profile((saves, unpacks), step=2.0), rate, rate, allowance=0)
    assert set(plan.offload) == {(0, 0)}
    alone = plan_offload(_profile((saves[1:], unpacks[:3]), step=2.0), rate, rate, allowance=0)
    assert alone.offload, "a small one alone would fit"


def test_infeasible_tail_is_dropped():
    # the last-packed save is unpacked right after backward starts: its read cannot hide
    saves, unpacks = _mirror([MB] * 6, step=1.2)
    plan = plan_offload(_profile((saves, unpacks), step=1.2), 20 * MB, 20 * MB, allowance=0)
    assert (0, 5) not in plan.offload
    assert {(0, 0), (0, 1), (0, 2)} <= set(plan.offload)
    assert plan.added_s == 0


def test_allowance_lets_a_little_lateness_through():
    saves, unpacks = _mirror([MB] * 6, step=1.2)
    # the last-packed save's read, issued at its own unpack (0.6 s), takes 25 ms
    tight = plan_offload(_profile((saves, unpacks), step=1.2), 40 * MB, 40 * MB, allowance=0)
    loose = plan_offload(_profile((saves, unpacks), step=1.2), 40 * MB, 40 * MB,
                         allowance=0.05)
    assert set(tight.offload) < set(loose.offload)
    assert 0 < loose.added_s <= 0.05 * 1.2


def test_reads_are_issued_as_late_as_the_queue_allows():
    saves, unpacks = _mirror([MB] * 8)
    plan = plan_offload(_profile((saves, unpacks), step=1.0), 1e15, 1e15)
    # an instant read is issued at the unpack of the save itself (its unpack number)
    for (_, i), o in plan.offload.items():
        assert o.issue_at == 7 - i
    assert plan.peak_after == MB   # only the save being used is back in memory


def test_groups_plan_independently_and_json_lists_every_save():
    a, ua = _mirror([MB] * 4)
    b, ub = _mirror([MB] * 4, group=1, start=1.0)
    plan = plan_offload(_profile((a, ua), (b, ub), step=2.0), 1e15, 1e15)
    assert {g for g, _ in plan.offload} == {0, 1}
    doc = json.loads(plan.to_json())
    assert len(doc["saves"]) == 8 and all(s["offload"] for s in doc["saves"])
    assert "8 of 8 saved tensors offloaded" in plan.summary()


def test_rates_must_be_positive():
    with pytest.raises(ValueError, match="rates"):
        plan_offload(SaveProfile([], {}, 1.0), 0, 1)
