"""The cost model (megatron_snake/planner): its bytes against the store's own counters on real
runs, its time against an independent 1F1B schedule and monotone in every bandwidth, the
command line, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_snake.planner import DoesNotFit, Hardware, Stage, Workload, predict
from megatron_snake.planner.cost import one_f_one_b
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.build import build_run
from megatron_snake.training.data import random_microbatches
from megatron_snake.training.workload import workload_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = os.path.join(ROOT, "megatron_snake", "planner", "profiles")
H100 = Hardware.load(os.path.join(PROFILES, "h100_4x_gen4.json"))
VOCAB = 256
SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", str(VOCAB), "--device", "cpu", "--snake-offload"]
BYTES = {"weights", "optim", "grad", "activations"}


def _measured_step_bytes(args, device, steps: int = 4) -> dict:
    """The store's counters over the last of ``steps`` steps: kind -> tier -> [read, written]."""
    with build_run(args, device, VOCAB, log=lambda _: None) as run:
        store = run.tensor_store
        for step in range(steps):
            before = {k: {t: list(v) for t, v in tiers.items()}
                      for k, tiers in store.counters.by_kind.items()}
            run.step(random_microbatches(args.num_microbatches, args.micro_batch_size,
                                         args.seq_length, VOCAB, seed=step, device=device))
            run.optimizer.wait_running()
            store.synchronize()
        return {k: {t: [v[0] - before.get(k, {}).get(t, [0, 0])[0],
                        v[1] - before.get(k, {}).get(t, [0, 0])[1]]
                    for t, v in tiers.items() if v != before.get(k, {}).get(t, [0, 0])}
                for k, tiers in store.counters.by_kind.items() if k in BYTES}


@pytest.mark.parametrize("extra", [
    ["--snake-activation-tier", "nvme"],                             # clipping: all forward
    ["--clip-grad", "0", "--snake-activation-tier", "nvme"],         # alpha split
    ["--bf16", "--snake-activation-tier", "host"],
    ["--snake-group-size", "2", "--snake-activation-tier", "nvme"],  # two snake groups
])
def test_predicted_drive_bytes_match_the_stores_counters(megatron_world, tmp_path, extra):
    """Per kind of state, the bytes per step: the optimizer state's on the drive, the
    weights' written and the unit inputs' written exactly, the gradients' tier exactly, the
    weights' reads within 10% and one unit's weights (a read served from a just-published
    or prefetched host copy depends on room and timing), and the unit inputs' reads exactly
    (the forward sweep reads none back: a group's inputs stay on the device from one unit
    to the next, and the loss unit's until the backward sweep). Speculation is off: the
    model prices the update as it runs once the step's norm is known, while a speculated
    part that misses reads and writes its state twice, and how many parts the backward
    sweep reaches before the norm is known depends on timing (speculation's own counts are
    tested in test_offloaded_training.py)."""
    args = parse_args([*SMALL, "--snake-offload-dir", str(tmp_path), "--snake-speculate",
                       "off", *extra])
    workload = workload_from_args(args, VOCAB)
    predicted = predict(workload, H100.with_(gpus_per_node=1), check=False).bytes_by_kind
    unit_weights = max(workload.stages[0].unit_params) * workload.elem_bytes
    measured = _measured_step_bytes(args, megatron_world)
    assert measured["optim"]["nvme"] == predicted["optim"]["nvme"]
    assert set(measured["grad"]) == set(predicted["grad"]) == {"host"}
    assert measured["grad"]["host"][1] == predicted["grad"]["host"][1]
    assert measured["weights"]["nvme"][1] == predicted["weights"]["nvme"][1], "written once"
    assert measured["weights"]["nvme"][0] == pytest.approx(predicted["weights"]["nvme"][0],
                                                           rel=0.10, abs=unit_weights)
    tier = "host" if "host" in extra else "nvme"
    (m_read, m_written), (p_read, p_written) = (measured["activations"][tier],
                                                predicted["activations"][tier])
    assert m_written == p_written
    assert m_read == p_read


def _uniform(stages: int, units: int = 4, micro_batches: int = 8, group_size: int = 1,
             **changes) -> Workload:
    stage = Stage(unit_params=(100_000_000,) * units, unit_layers=(1,) * units,
                  unit_flops=(5e12,) * units)
    fields = dict(stages=(stage,) * stages, tp=1, dp=1, micro_batches=micro_batches,
                  group_size=group_size, micro_batch_size=1, seq_length=4096, hidden_size=8192,
                  heads=64, elem_bytes=2, alpha=0.25, update_in_forward=True,
                  param_tier="nvme", optimizer_tier="nvme", activation_tier="nvme",
                  host_pool_bytes=64 << 30, model_flops=1e15, global_batch=micro_batches)
    fields.update(changes)
    return Workload(**fields)


def _one_f_one_b(stages: int, groups: int, fwd, bwd) -> float:
    """Megatron's 1F1B (warm-up forwards, steady one forward one backward, cool-down), each
    stage waiting for its neighbour's output, stage s taking fwd[s] and bwd[s] (or one
    figure for all): the finish time of the first stage's last backward, by a small event
    simulation."""
    fwd = fwd if isinstance(fwd, list) else [fwd] * stages
    bwd = bwd if isinstance(bwd, list) else [bwd] * stages
    done_f, done_b = {}, {}
    order = []
    for s in range(stages):
        warm = min(stages - s - 1, groups)
        ops = [("F", g) for g in range(warm)]
        f, b = warm, 0
        while b < groups:
            if f < groups:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
            b += 1
        order.append(ops)
    clock = [0.0] * stages
    pending = [list(ops) for ops in order]
    while any(pending):
        progressed = False
        for s in range(stages):
            while pending[s]:
                kind, g = pending[s][0]
                if kind == "F":
                    dep = 0.0 if s == 0 else done_f.get((s - 1, g))
                else:
                    dep = done_f.get((s, g)) if s == stages - 1 else done_b.get((s + 1, g))
                if dep is None:
                    break
                start = max(clock[s], dep)
                clock[s] = start + (fwd[s] if kind == "F" else bwd[s])
                (done_f if kind == "F" else done_b)[(s, g)] = clock[s]
                pending[s].pop(0)
                progressed = True
        assert progressed, "the schedule deadlocked"
    return done_b[(0, groups - 1)]


@pytest.mark.parametrize("stages,groups", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_the_bubble_is_1f1bs_at_equal_stage_times(stages, groups):
    """At equal stages the step is (M/G + p - 1) groups' time, a bubble of
    (p - 1) / (M/G + p - 1)."""
    f, b = 0.3, 0.7
    assert one_f_one_b([f] * stages, [b] * stages, groups) == \
        pytest.approx((groups + stages - 1) * (f + b), rel=1e-12)
    assert _one_f_one_b(stages, groups, f, b) == pytest.approx((groups + stages - 1) * (f + b))


@pytest.mark.parametrize("stages,groups", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_the_step_is_1f1bs_end_at_the_models_stage_times(stages, groups):
    """The stages of a real split are not equal (the last one's forward sweep skips its last
    unit, middle stages send both ways): the step is when an event simulation of 1F1B with
    each stage's own per-group sweeps ends."""
    hw = H100.with_(gpus_per_node=8)
    w = _uniform(stages, micro_batches=groups * 2, group_size=2)
    pred = predict(w, hw, check=False)
    fwd = [(c.sweeps["forward"]["time"] + c.p2p_s / 2) / groups for c in pred.stages]
    bwd = [(c.sweeps["backward"]["time"] + c.p2p_s / 2) / groups for c in pred.stages]
    assert pred.step_time_s == pytest.approx(_one_f_one_b(stages, groups, fwd, bwd), rel=1e-9)
    assert pred.bubble_s == pytest.approx(pred.step_time_s - pred.stages[pred.slowest].time_s)


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_one_slow_stage_adds_only_its_neighbours_fill_and_drain(groups):
    """Two stages, worked by hand. The last stage slow: the first stage's forward fills the
    pipe and its backward drains it, n(f1 + b1) + f0 + b0. The first stage slow: 1F1B hides
    the last stage's group (g1) behind the first one's second forward and its last backward,
    so it adds only what g1 takes beyond each. A cruder model, the slowest stage times
    (n + 1)/n, over-predicts both."""
    f0, b0, f1, b1 = 0.2, 0.4, 0.5, 1.0
    slow_last = groups * (f1 + b1) + f0 + b0
    assert one_f_one_b([f0, f1], [b0, b1], groups) == pytest.approx(slow_last)
    f0, b0, f1, b1 = 0.5, 1.0, 0.3, 0.5
    g1 = f1 + b1
    slow_first = groups * (f0 + b0) + max(0.0, g1 - f0) + max(0.0, g1 - b0)
    assert one_f_one_b([f0, f1], [b0, b1], groups) == pytest.approx(slow_first)
    assert max(slow_last, slow_first) < (groups + 1) * (f0 + b0)
    # one group: nothing to overlap, the four sweeps in a row
    assert one_f_one_b([f0, f1], [b0, b1], 1) == pytest.approx(f0 + f1 + b1 + b0)


RATES = ["device_tflops", "pcie_Bps", "drive_read_Bps", "drive_write_Bps", "host_copy_Bps",
         "cpu_adam_params_per_s", "intra_node_Bps", "inter_node_Bps"]


@pytest.mark.parametrize("workload", [
    _uniform(1, micro_batches=4, group_size=4),
    _uniform(1, micro_batches=32, group_size=32, update_in_forward=False),
    _uniform(2, micro_batches=16, group_size=2, dp=4, tp=2, activation_tier="auto"),
    _uniform(4, micro_batches=8, group_size=1, dp=16, optimizer_tier="host",
             host_pool_bytes=1 << 40),
])
def test_time_is_monotone_in_every_bandwidth(workload):
    for field in RATES:
        times = []
        for scale in (0.1, 0.3, 0.5, 1, 2, 4, 16):
            hw = H100.with_(**{field: getattr(H100, field) * scale,
                               "device_peak_tflops": H100.device_peak_tflops * 16})
            times.append(predict(workload, hw, check=False).step_time_s)
        assert all(a >= b for a, b in zip(times, times[1:])), (field, times)
    assert times[0] > 0


def test_the_output_layer_runs_at_its_own_rate_in_the_last_stages_backward_sweep():
    """head_tflops times the last stage's output layer (three passes a micro-batch, in the
    backward sweep: the forward sweep stops before the last unit); absent, the layer rate."""
    head = Stage(unit_params=(100_000_000,) * 4, unit_layers=(1,) * 4,
                 unit_flops=(5e12,) * 4, head_flops=2e12)
    w = _uniform(2, micro_batches=8, group_size=2)
    w = Workload(**{**w.__dict__, "stages": (w.stages[0], head)})
    hw = H100.with_(drive_read_Bps=1e15, drive_write_Bps=1e15, pcie_Bps=1e15,
                    host_copy_Bps=1e15, cpu_adam_params_per_s=1e15)   # compute-bound
    same = predict(w, hw.with_(head_tflops=hw.device_tflops), check=False)
    assert predict(w, hw, check=False).step_time_s == same.step_time_s
    slow = predict(w, hw.with_(head_tflops=hw.device_tflops / 4), check=False)
    extra = 3 * 2e12 * 8 * (4 - 1) / (hw.device_tflops * 1e12)
    fwd, bwd = (slow.stages[1].sweeps[s]["compute"] - same.stages[1].sweeps[s]["compute"]
                for s in ("forward", "backward"))
    assert fwd == 0 and bwd == pytest.approx(extra)
    assert slow.stages[0].sweeps == same.stages[0].sweeps


def test_a_compute_device_sharing_the_cores_is_slowed_by_the_drive_beside_it():
    """io_compute_slowdown stretches each sweep's compute by that share of the time the
    drive overlaps it (the drive's time, or the stretched compute's if shorter); 0, the
    default of a profile without the field, changes nothing; a share of 1 is refused."""
    w = _uniform(1, micro_batches=8)
    base = predict(w, H100, check=False)
    for share in (0.25, 0.6):
        slow = predict(w, H100.with_(io_compute_slowdown=share), check=False)
        for sweep in ("forward", "backward"):
            was, now = base.stages[0].sweeps[sweep], slow.stages[0].sweeps[sweep]
            expected = was["compute"] + share * min(was["drive"], was["compute"] / (1 - share))
            assert now["compute"] == pytest.approx(expected)
            assert now["compute"] > was["compute"] and now["drive"] == was["drive"]
        assert slow.step_time_s > base.step_time_s
    profile = {k: v for k, v in H100.to_dict().items() if k != "io_compute_slowdown"}
    assert Hardware.from_dict(profile) == H100 and H100.io_compute_slowdown == 0
    with pytest.raises(ValueError, match="io_compute_slowdown must be below 1"):
        H100.with_(io_compute_slowdown=1.0)


def test_each_unit_visit_adds_its_host_time_to_the_compute():
    """unit_visit_s is paid once per unit per sweep per snake group: the forward sweep of
    the last stage visits all units but the last (it turns in place), the backward sweep all
    of them. 0, the default of a profile without the field, changes nothing."""
    visit = 0.01
    for groups, stages in ((1, 1), (4, 1), (2, 2)):
        w = _uniform(stages, units=4, micro_batches=8, group_size=8 // groups)
        base = predict(w, H100, check=False)
        slow = predict(w, H100.with_(unit_visit_s=visit), check=False)
        last = w.pp - 1
        for sweep, units in (("forward", 3), ("backward", 4)):
            was, now = base.stages[last].sweeps[sweep], slow.stages[last].sweeps[sweep]
            assert now["compute"] - was["compute"] == pytest.approx(units * groups * visit)
        assert slow.step_time_s > base.step_time_s
    profile = {k: v for k, v in H100.to_dict().items() if k != "unit_visit_s"}
    assert Hardware.from_dict(profile) == H100 and H100.unit_visit_s == 0
    with pytest.raises(ValueError, match="unit_visit_s must be a positive number"):
        H100.with_(unit_visit_s=-0.001)


def _plan(*argv, check=True):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *argv],
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


GPT7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
         "--seq-length", "2048", "--micro-batch-size", "4", "--global-batch-size", "256",
         "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
         "--snake-offload", "--snake-host-memory-limit", "64GiB"]


def test_the_command_line_prints_one_json_object():
    out = json.loads(_plan(*GPT7B, "--hardware", "h100_4x_gen4", "--json", "--nodes", "2",
                           "--pipeline-model-parallel-size", "2").stdout)
    assert out["step_time_s"] > 0 and out["settings"]["dp"] == 8 and out["settings"]["pp"] == 2
    assert out["tokens_per_s"] == pytest.approx(256 * 2048 / out["step_time_s"])
    for sweep in ("forward", "backward"):
        assert set(out["breakdown"][sweep]) >= {"compute", "drive", "copy", "cpu_adam", "time"}
    assert set(out["bytes"]) == {"device", "host", "nvme"}
    assert all({"capacity", "read", "written"} <= set(t) for t in out["bytes"].values())
    assert 0 < out["mfu"] < 1
    text = _plan(*GPT7B, "--hardware", os.path.join(PROFILES, "h100_8x_gen5.json")).stdout
    assert "> step" in text and "tokens/s" in text


def test_calibrate_writes_a_profile_the_planner_predicts_with(tmp_path):
    """tools/calibrate.py on this machine: every rate measured and positive, the output
    layer timed apart, the drives counted (two directories striped over: one file system,
    counted once), and plan.py predicts the same model with the profile."""
    out = tmp_path / "profile.json"
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    flags = [f for f in SMALL if f != "--snake-offload"] + \
        ["--snake-offload-dir", f"{tmp_path / 'a'},{tmp_path / 'b'}"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "calibrate.py"), *flags,
                           "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hw = Hardware.load(str(out))
    assert hw.head_tflops is not None and hw.head_tflops > 0 and hw.device_tflops > 0
    assert hw.device_peak_tflops >= max(hw.device_tflops, hw.head_tflops)
    # a CPU device shares its cores with the store's I/O: about half of a hidden-256 layer's
    # time (docs/scaling.md); this tiny layer's single-threaded ops may lose nothing
    assert 0 <= hw.io_compute_slowdown < 1
    # a real step's host time: each unit visit costs something beside its passes
    assert hw.unit_visit_s > 0 and hw.unit_overhead_s > 0
    assert "measured by tools/calibrate.py" in hw.source
    fs = os.statvfs(tmp_path)
    assert hw.drives == 2 and hw.drive_capacity == fs.f_blocks * fs.f_frsize
    # on the CPU the compute rate is the one inside a real step; the layer alone is kept
    assert hw.device_tflops_alone > 0 and hw.head_tflops_alone > 0
    assert "inside a real step" in hw.source
    pred = json.loads(_plan(*SMALL, "--hardware", str(out), "--json").stdout)
    assert pred["step_time_s"] > 0


def test_bad_input_gets_one_clear_error(tmp_path):
    profile = json.loads(open(os.path.join(PROFILES, "h100_4x_gen4.json")).read())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**profile, "drive_bandwith": 1}))
    proc = _plan(*GPT7B, "--hardware", str(bad), check=False)
    assert proc.returncode == 2 and "unknown field(s) ['drive_bandwith']" in proc.stderr
    bad.write_text(json.dumps({**profile, "pcie_Bps": -1}))
    assert "pcie_Bps must be a positive number" in _plan(*GPT7B, "--hardware", str(bad),
                                                         check=False).stderr
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**profile, "drive_capacity": 1e11}))
    proc = _plan(*GPT7B, "--hardware", str(small), check=False)
    assert proc.returncode == 2 and "does not fit: drive: a node needs" in proc.stderr
    assert "TB" in proc.stderr and "0.10 TB" in proc.stderr
    flags = [f for f in GPT7B if f != "--snake-offload"]
    assert "add --snake-offload" in _plan(*flags, "--snake-host-memory-limit", "1GiB",
                                          "--hardware", "h100_4x_gen4", check=False).stderr
    assert "--snake-activation-offload: the planner does not model it" in _plan(
        *GPT7B, "--snake-activation-offload", "--hardware", "h100_4x_gen4", check=False).stderr
    assert "no such file, nor a shipped profile" in _plan(*GPT7B, "--hardware", "h999",
                                                          check=False).stderr
    with pytest.raises(DoesNotFit, match="host memory: stage 0's host tiers need"):
        predict(_uniform(1, micro_batches=4, group_size=4, optimizer_tier="host",
                         host_pool_bytes=1 << 30), H100)
    with pytest.raises(DoesNotFit, match="device memory: stage 0 needs"):
        predict(_uniform(1, micro_batches=4, group_size=4),
                H100.with_(device_memory=1 << 30))


def test_the_planner_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_snake.planner import predict, Hardware\n"
            f"hw = Hardware.load({os.path.join(PROFILES, 'h100_8x_gen5.json')!r})\n"
            "print('ok', hw.gpus_per_node)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "ok 8", out.stderr


# --- --snake-auto and --snake-dry-run's prediction ---------------------------------------
def test_snake_auto_flags_are_checked(capsys):
    from conftest import expect_flag_error

    expect_flag_error(capsys, [*SMALL, "--snake-auto"], "--snake-hardware")
    expect_flag_error(capsys, [*SMALL, "--snake-auto", "--snake-hardware", "h100_4x_gen4",
                               "--snake-alpha", "0.5"], "--snake-alpha")
    expect_flag_error(capsys, [*SMALL, "--snake-hardware", "h100_4x_gen4"], "--snake-hardware")
    expect_flag_error(capsys, [*SMALL, "--snake-dry-run", "--snake-hardware", "h100_4x_gen4",
                               "--snake-activation-offload"], "--snake-hardware")
    err = expect_flag_error(capsys, [*SMALL, "--snake-auto", "--snake-hardware", "nope"],
                            "--snake-hardware")
    assert "shipped profile" in err


def test_snake_auto_trains_with_the_fastest_predicted_setting(megatron_world, tmp_path,
                                                               capsys):
    from megatron_snake.training.auto_config import candidates, choose
    from megatron_snake.training.loop import pretrain

    flags = [*SMALL, "--snake-offload-dir", str(tmp_path), "--train-iters", "2"]
    hw = H100.with_(gpus_per_node=1, device_memory=2 << 20)   # some choices do not fit
    args = parse_args([*flags, "--snake-auto", "--snake-hardware", "h100_4x_gen4"])
    choice, prediction, fitting = choose(args, VOCAB, hw)
    times = []
    for c in candidates(args):
        try:
            times.append(predict(workload_from_args(c.apply(args), VOCAB), hw).step_time_s)
        except DoesNotFit:
            pass
    assert 0 < fitting <= len(times) < len(candidates(args))
    assert prediction.step_time_s == min(times)
    profile = tmp_path / "hw.json"
    profile.write_text(json.dumps(hw.to_dict()))
    capsys.readouterr()
    losses = pretrain(parse_args([*flags, "--snake-auto", "--snake-hardware", str(profile)]))
    out = capsys.readouterr().out
    assert len(losses) == 2 and f"snake-auto chose, of {fitting} settings" in out
    assert choice.flags() in out and "> predicted on" in out
    assert f"checkpoint interval {choice.checkpoint_interval}," in out


def test_a_dry_run_with_a_profile_prints_the_prediction(megatron_world, tmp_path, capsys):
    from megatron_snake.training.loop import pretrain

    pretrain(parse_args([*SMALL, "--snake-dry-run", "--snake-hardware", "h100_8x_gen5"]))
    out = capsys.readouterr().out
    assert "> predicted on 8x H100 SXM, 8 PCIe Gen5" in out and "> pre-flight" in out


def test_a_profile_names_its_drives_and_a_study_changes_their_number():
    """The shipped profiles say how many drives their figures add up; ``with_drives`` is the
    same node with more or fewer drives of that kind (rates and capacity in proportion)."""
    assert H100.drives == 4
    eight = H100.with_drives(8)
    assert eight.drives == 8
    assert eight.drive_read_Bps == pytest.approx(2 * H100.drive_read_Bps)
    assert eight.drive_write_Bps == pytest.approx(2 * H100.drive_write_Bps)
    assert eight.drive_capacity == pytest.approx(2 * H100.drive_capacity, rel=1e-9)
    assert eight.with_drives(4).drive_read_Bps == pytest.approx(H100.drive_read_Bps)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="drives must be a whole number"):
            H100.with_(drives=bad)


def test_more_drives_shorten_the_drive_time_of_a_step():
    """plan.py --drives: a node with twice the drives of its kind moves the same bytes in
    half the drive time."""
    runs = {d: json.loads(_plan(*GPT7B, "--hardware", "h100_1x_gen5", "--json", "--drives",
                                str(d)).stdout) for d in (4, 8)}
    assert runs[4]["drives"] == 4 and runs[8]["drives"] == 8
    for sweep in ("forward", "backward"):
        assert runs[8]["breakdown"][sweep]["drive"] == pytest.approx(
            runs[4]["breakdown"][sweep]["drive"] / 2)
    assert runs[8]["bytes"]["nvme"] == runs[4]["bytes"]["nvme"]
    assert "--drives must be >= 1" in _plan(*GPT7B, "--hardware", "h100_1x_gen5", "--drives",
                                            "0", check=False).stderr


def test_the_planner_counts_the_precision_modes_bytes_and_update_rate():
    """--use-precision-aware-optimizer with bf16 moments: the optimizer state moves 6 of 12
    bytes per parameter, and its update takes 1 / update_rate_share of fp32's CPU time."""
    from megatron_snake.optim.precision import UPDATE_RATE_SHARE
    bf16 = [*SMALL, "--bf16"]
    reduced = [*bf16, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
               "--exp-avg-sq-dtype", "bf16"]
    hw = H100.with_(gpus_per_node=1)
    fp32, ours = (predict(workload_from_args(parse_args(flags), VOCAB), hw, check=False)
                  for flags in (bf16, reduced))
    assert ours.bytes_by_kind["optim"]["nvme"][0] * 2 == fp32.bytes_by_kind["optim"]["nvme"][0]
    assert ours.bytes_by_kind["optim"]["nvme"][1] * 2 == fp32.bytes_by_kind["optim"]["nvme"][1]
    adam = {name: sum(p.breakdown[s]["cpu_adam"] for s in ("forward", "backward"))
            for name, p in (("fp32", fp32), ("ours", ours))}
    assert adam["ours"] == pytest.approx(adam["fp32"] / UPDATE_RATE_SHARE["bf16"])
