"""The lifetime recorder and the placement planner (TERAIO), checked by the independent
continuous-time simulator: budgets, no late prefetch, bandwidth edges, adaptive keep."""

import random

import pytest

from megatron_snake.offload.activation_plan import measure_tier_bandwidth
from megatron_snake.placement.lifetimes import Event, LifetimeRecorder, TensorLifetime, Timeline
from megatron_snake.placement.plan import INF, Plan, make_plan, simulate

FLAG = "--snake-gpu-memory-limit"


def vertical(units, mbs, ckpt_bytes, weight_bytes, fwd_s=1.0, bwd_s=2.0):
    """A vertical schedule: forward sweep over units 0..U-2, backward over U-1..0, each unit
    over the micro-batches in snake order. Checkpoint (u, mb) is produced by F(u-1, mb) and
    used by F(u, mb) (u <= U-2) and B(u, mb)."""
    events, idx = [], {}

    def snake(u):
        return range(mbs) if u % 2 == 0 else range(mbs - 1, -1, -1)

    for sweep, unit_range, secs in (("F", range(units - 1), fwd_s),
                                    ("B", range(units - 1, -1, -1), bwd_s)):
        for u in unit_range:
            for mb in snake(u):
                idx[(sweep, u, mb)] = len(events)
                events.append(Event((sweep, u, mb), secs, weight_bytes))
    lifetimes = []
    for u in range(1, units):
        for mb in range(mbs):
            uses = ([idx[("F", u, mb)]] if u <= units - 2 else []) + [idx[("B", u, mb)]]
            lifetimes.append(TensorLifetime(("ckpt", u, mb), ckpt_bytes, idx[("F", u - 1, mb)],
                                            tuple(uses)))
    return Timeline(events), lifetimes


def minimum(lifetimes, timeline):
    need = [e.working_bytes for e in timeline.events]
    for lt in lifetimes:
        for a in lt.accesses:
            need[a] += lt.nbytes
    return max(need)


def check(plan, lifetimes, timeline, bw, pcie=INF):
    """The simulator's verdict on a plan the planner returned."""
    sim = simulate(plan, lifetimes, timeline, bw, pcie)
    assert sim.peak_bytes["gpu"] <= plan.gpu_budget_bytes
    assert sim.peak_bytes["host"] <= plan.host_budget_bytes
    assert sim.stall_s == 0 and all(p.arrival_s <= p.needed_s + 1e-9 for p in sim.prefetches)
    assert sim.late_writes == 0
    for tier in ("gpu", "host", "nvme"):       # the planner's accounting is conservative
        assert sim.peak_bytes[tier] <= plan.peak_bytes[tier]
    assert plan.stall_s == 0
    return sim


def kept_last_gap(plan, lifetimes):
    """Keys whose forward-to-backward gap stays on the GPU, in backward order."""
    kept = [lt for lt in lifetimes
            if not any(r == lt.accesses[-2] for r, _ in plan.placements[lt.key].offloads)]
    return [lt.key for lt in sorted(kept, key=lambda lt: lt.accesses[-1])]


# ============================================================ planner

def random_scenario(rng):
    n_ev = rng.randint(4, 30)
    timeline = Timeline([Event(i, rng.uniform(0.0, 1.0) if rng.random() > 0.1 else 0.0,
                               rng.choice([0, rng.randint(0, 500)])) for i in range(n_ev)])
    lifetimes = []
    for k in range(rng.randint(5, 25)):
        p = rng.randrange(n_ev)
        uses = sorted(rng.sample(range(p + 1, n_ev), min(rng.randint(0, 3), n_ev - p - 1)))
        nbytes = 0 if rng.random() < 0.1 else rng.randint(1, 400)
        lifetimes.append(TensorLifetime(("t", k), nbytes, p, tuple(uses)))
    bw = {tier: tuple(rng.choice([INF, 0.0] + [10 ** rng.uniform(3, 5.5)] * 8) for _ in range(2))
          for tier in ("host", "nvme") if rng.random() < 0.8}
    return timeline, lifetimes, bw, rng.choice([INF, 10 ** rng.uniform(3, 5)])


def test_random_scenarios_respect_budgets_and_never_prefetch_late():
    rng = random.Random(1234)
    planned = offloaded = on_host = 0
    for _ in range(50):
        timeline, lifetimes, bw, pcie = random_scenario(rng)
        lo = minimum(lifetimes, timeline)
        hi = make_plan(lifetimes, timeline, gpu_budget_bytes=10**12, host_budget_bytes=0,
                       bandwidth={}).peak_bytes["gpu"]        # everything on the GPU
        gpu_budget = rng.randint((lo + hi) // 2, hi) if rng.random() < 0.9 else rng.randint(0, lo)
        host_budget = rng.choice([0, rng.randint(0, 3000)] + [10**9] * 3)
        try:
            plan = make_plan(lifetimes, timeline, gpu_budget_bytes=gpu_budget,
                             host_budget_bytes=host_budget, bandwidth=bw, pcie_Bps=pcie)
            planned += 1
            check(plan, lifetimes, timeline, bw, pcie)
            offloaded += any(p.offloads for p in plan.placements.values())
            on_host += any(p.tier == "host" for p in plan.placements.values())
        except ValueError as exc:
            assert FLAG in str(exc)
            assert gpu_budget < hi, "everything on the GPU fits: no error allowed"
        if gpu_budget >= lo:     # free transfers reach any budget down to the minimum, on NVMe
            free = {"host": (INF, INF), "nvme": (INF, INF)}
            plan = make_plan(lifetimes, timeline, gpu_budget_bytes=gpu_budget,
                             host_budget_bytes=10**9, bandwidth=free)
            check(plan, lifetimes, timeline, free)
            assert {p.tier for p in plan.placements.values() if p.offloads} <= {"nvme"}
    assert planned >= 25 and offloaded >= 12 and on_host >= 3, (planned, offloaded, on_host)


def test_infinite_bandwidth_offloads_to_the_slowest_tier_down_to_the_minimum():
    timeline, lifetimes = vertical(6, 4, ckpt_bytes=100, weight_bytes=1000)
    bw = {"host": (INF, INF), "nvme": (INF, INF)}
    lo = minimum(lifetimes, timeline)
    for budget in (lo, lo + 500):
        plan = make_plan(lifetimes, timeline, gpu_budget_bytes=budget, host_budget_bytes=10**9,
                         bandwidth=bw)
        sim = check(plan, lifetimes, timeline, bw)
        tiers = {p.tier for p in plan.placements.values() if p.offloads}
        assert tiers == {"nvme"} and sim.peak_bytes["host"] == 0
        assert all(p.offloads for p in plan.placements.values() if p.tier != "gpu")
    assert sim.peak_bytes["gpu"] <= lo + 500
    tight = make_plan(lifetimes, timeline, gpu_budget_bytes=lo, host_budget_bytes=0, bandwidth=bw)
    assert simulate(tight, lifetimes, timeline, bw).peak_bytes["gpu"] == lo


def test_zero_bandwidth_offloads_nothing_and_errors_when_it_does_not_fit():
    timeline, lifetimes = vertical(5, 3, ckpt_bytes=100, weight_bytes=1000)
    bw = {"host": (0.0, 0.0), "nvme": (0.0, 0.0)}
    everything = make_plan(lifetimes, timeline, gpu_budget_bytes=10**9, host_budget_bytes=10**9,
                           bandwidth={}).peak_bytes["gpu"]
    plan = make_plan(lifetimes, timeline, gpu_budget_bytes=everything, host_budget_bytes=10**9,
                     bandwidth=bw)
    check(plan, lifetimes, timeline, bw)
    assert {p.tier for p in plan.placements.values()} == {"gpu"}
    assert sorted(plan.kept()) == sorted(lt.key for lt in lifetimes)
    with pytest.raises(ValueError, match=FLAG) as err:
        make_plan(lifetimes, timeline, gpu_budget_bytes=everything - 1, host_budget_bytes=10**9,
                  bandwidth=bw)
    assert str(everything) in str(err.value)


def test_budget_below_the_largest_tensor_needed_at_once_is_a_clear_error():
    timeline = Timeline([Event("a", 1.0, 300), Event("b", 1.0, 400), Event("c", 1.0, 0)])
    lifetimes = [TensorLifetime("big", 5000, 0, (2,)), TensorLifetime("small", 10, 1, (2,))]
    with pytest.raises(ValueError, match=FLAG) as err:
        make_plan(lifetimes, timeline, gpu_budget_bytes=5000, host_budget_bytes=0,
                  bandwidth={"nvme": (INF, INF)})
    msg = str(err.value)
    assert "5300" in msg and "'big'" in msg and "minimum" in msg   # event a: 300 + 5000
    plan = make_plan(lifetimes, timeline, gpu_budget_bytes=5300, host_budget_bytes=0,
                     bandwidth={"nvme": (INF, INF)})
    assert plan.placements["big"].offloads == [(0, 2)]      # it is away during event b


def test_adaptive_keep_the_last_units_stay_on_the_gpu_behind_a_slow_drive():
    """The drive writes one checkpoint per 2-4 forward events: the checkpoints of the last
    units (first needed in backward) cannot be written and read back in time and stay."""
    timeline, lifetimes = vertical(8, 4, ckpt_bytes=100, weight_bytes=1000)
    lo = minimum(lifetimes, timeline)

    def tightest(write_Bps):
        bw = {"nvme": (4 * write_Bps, write_Bps)}
        for extra in range(len(lifetimes) + 1):
            try:
                plan = make_plan(lifetimes, timeline, gpu_budget_bytes=lo + 100 * extra,
                                 host_budget_bytes=0, bandwidth=bw)
            except ValueError:
                continue
            check(plan, lifetimes, timeline, bw)
            return plan
        raise AssertionError("no plan at any budget")

    backward_order = [lt.key for lt in sorted(lifetimes, key=lambda lt: lt.accesses[-1])]
    kept = {}
    for write_Bps in (INF, 1000, 50, 30):
        kept[write_Bps] = kept_last_gap(tightest(write_Bps), lifetimes)
    for write_Bps in (50, 30):   # the drive decides: the tail of the forward = head of backward
        assert kept[write_Bps] == backward_order[:len(kept[write_Bps])]
    sizes = [len(kept[w]) for w in (INF, 1000, 50, 30)]
    assert sizes == sorted(sizes) and sizes[0] <= 2 and sizes[-1] >= 12, sizes
    assert len(kept[30]) < len(lifetimes)          # the early units still go to the drive


def test_host_tier_takes_what_the_slow_drive_cannot_within_the_host_budget():
    timeline, lifetimes = vertical(8, 4, ckpt_bytes=100, weight_bytes=1000)
    bw = {"host": (400.0, 400.0), "nvme": (120.0, 30.0)}    # the drive absorbs ~7 checkpoints
    lo = minimum(lifetimes, timeline)
    plan = make_plan(lifetimes, timeline, gpu_budget_bytes=lo + 500, host_budget_bytes=10**9,
                     bandwidth=bw)
    check(plan, lifetimes, timeline, bw)
    assert {p.tier for p in plan.placements.values()} == {"gpu", "host", "nvme"}
    capped = make_plan(lifetimes, timeline, gpu_budget_bytes=lo + 800, host_budget_bytes=1200,
                       bandwidth=bw)
    check(capped, lifetimes, timeline, bw)
    with pytest.raises(ValueError, match="--snake-host-memory-limit"):
        make_plan(lifetimes, timeline, gpu_budget_bytes=lo + 800, host_budget_bytes=0,
                  bandwidth=bw)


def test_host_first_fills_the_host_budget_before_the_drive():
    """The offloaded state shares the drive: checkpoints take host memory while it has room,
    and only the rest go to the drive, at any bandwidth."""
    timeline, lifetimes = vertical(6, 4, ckpt_bytes=100, weight_bytes=1000)
    lo = minimum(lifetimes, timeline)
    for bw in ({"host": (INF, INF), "nvme": (INF, INF)},
               {"host": (4000.0, 4000.0), "nvme": (1000.0, 500.0)}):
        everything = make_plan(lifetimes, timeline, gpu_budget_bytes=lo + 300, bandwidth=bw,
                               host_budget_bytes=10**9, host_first=True)
        check(everything, lifetimes, timeline, bw)
        offloaded = [p for p in everything.placements.values() if p.offloads]
        assert offloaded and all(p.tier == "host" for p in offloaded)
        capped = make_plan(lifetimes, timeline, gpu_budget_bytes=lo + 300, bandwidth=bw,
                           host_budget_bytes=700, host_first=True)
        sim = check(capped, lifetimes, timeline, bw)
        tiers = [p.tier for p in capped.placements.values() if p.offloads]
        assert 0 < sim.peak_bytes["host"] <= 700 and "nvme" in tiers
        assert tiers.count("host") >= 5, "the host budget is used, not left to the drive"


def test_plan_json_round_trip_summary_and_actions():
    timeline, lifetimes = vertical(5, 3, ckpt_bytes=100, weight_bytes=1000)
    lifetimes.append(TensorLifetime("plain-key", 7, 0, (len(timeline) - 1,)))
    bw = {"host": (500.0, 500.0), "nvme": (300.0, 100.0)}
    plan = make_plan(lifetimes, timeline, gpu_budget_bytes=minimum(lifetimes, timeline) + 300,
                     host_budget_bytes=250, bandwidth=bw, pcie_Bps=1000.0)
    check(plan, lifetimes, timeline, bw, 1000.0)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.placements[("ckpt", 1, 0)] == plan.placements[("ckpt", 1, 0)]
    text = plan.summary()
    assert "placement plan" in text and "nvme" in text and "predicted stall 0.000 s" in text
    seen = {}
    for event in sorted(plan.actions(lifetimes)):
        for phase, op, key in plan.actions(lifetimes)[event]:
            seen.setdefault(key, []).append((event, phase, op))
    for key, ops in seen.items():
        assert ops[0][2] == "write" and plan.tier(key) != "gpu"
        assert [o for _, _, o in ops].count("release") == len(plan.placements[key].offloads)


def test_bad_lifetimes_are_rejected():
    timeline = Timeline([Event("a", 1.0), Event("b", 1.0)])
    for bad in (TensorLifetime("x", 1, 1, (0,)), TensorLifetime("x", 1, 0, (5,))):
        with pytest.raises(ValueError, match="'x'"):
            make_plan([bad], timeline, gpu_budget_bytes=10, host_budget_bytes=0, bandwidth={})


# ============================================================ recorder and probe

def test_recorder_builds_timeline_and_lifetimes_over_iterations():
    rec = LifetimeRecorder()
    for _ in range(3):
        for i in range(3):
            rec.begin(("F", i))
            if i > 0:
                rec.used(("ckpt", i))
                rec.used(("ckpt", i))             # one use per event
            rec.produced(("ckpt", i + 1), 64 * (i + 1))
            rec.end(("F", i), working_bytes=10 * i)
        rec.begin("B")
        for i in (1, 2, 3):
            rec.used(("ckpt", i))
        rec.end("B")
        rec.step()
    timeline, lifetimes = rec.finish()
    assert [e.name for e in timeline.events] == [("F", 0), ("F", 1), ("F", 2), "B"]
    assert [e.working_bytes for e in timeline.events] == [0, 10, 20, 0]
    assert all(e.seconds >= 0 for e in timeline.events)
    by_key = {lt.key: lt for lt in lifetimes}
    assert by_key[("ckpt", 1)] == TensorLifetime(("ckpt", 1), 64, 0, (1, 3))
    assert by_key[("ckpt", 3)] == TensorLifetime(("ckpt", 3), 192, 2, (3,))
    with pytest.raises(RuntimeError):
        rec.produced("y", 1)                      # outside an event
    rec.begin("x")
    with pytest.raises(KeyError):
        rec.used("never-produced")
    with pytest.raises(RuntimeError):
        rec.end("not-x")


def test_bandwidth_probe_on_a_tiny_store(tmp_path):
    from megatron_snake.storage.store import TensorStore

    with TensorStore(tmp_path, host_memory_limit=8 << 20, buffer_bytes=1 << 20) as store:
        bw = measure_tier_bandwidth(store, nbytes=256 << 10)
        assert set(bw) == {"host", "nvme"}
        assert all(r > 0 and w > 0 for r, w in bw.values())
        assert store.keys() == []
