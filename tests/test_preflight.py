"""The pre-flight: parameter counts from the flags equal Megatron-Core's models (TP=1 grid
in process; TP=2 x PP=2 on four gloo ranks), its bytes equal what build_offloaded_state
checks on the built model, a 175B configuration is decided in seconds with little memory,
and a tier that does not fit is refused, naming the flag and the amount, before the model
is built."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from megatron_snake.storage.sizes import size
import torch
import torch.multiprocessing as mp

from conftest import VOCAB, expect_flag_error
from megatron_snake.training import preflight
from megatron_snake.training.distributed import free_port, local_rank_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt.py")
TINY = ["--num-layers", "5", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--hidden-dropout", "0", "--attention-dropout", "0"]
SHAPES = {
    "default": [],
    "untied": ["--untie-embeddings-and-output-weights"],
    "swiglu-gqa-rmsnorm-nobias-rope": ["--swiglu", "--group-query-attention",
                                       "--num-query-groups", "2", "--normalization", "RMSNorm",
                                       "--disable-bias-linear", "--position-embedding-type",
                                       "rope"],
    "kv-channels-ffn-maxpos": ["--kv-channels", "12", "--ffn-hidden-size", "40",
                               "--max-position-embeddings", "24", "--swiglu"],
    "untied-rmsnorm-no-position": ["--untie-embeddings-and-output-weights", "--normalization",
                                   "RMSNorm", "--position-embedding-type", "none",
                                   "--group-query-attention", "--num-query-groups", "1"],
}
INTERVALS = (1, 2, 5)  # 5, 3 (2+2+1) and 1 unit(s) of the 5 layers


def _args(*flags):
    from megatron_snake.training.arguments import parse_args

    return parse_args([*TINY, *flags])


def _with_interval(args, interval):
    args = copy.copy(args)
    args.snake_checkpoint_interval = interval
    return args


def _megatron_counts(gpt, interval) -> tuple[list[int], int]:
    from megatron_snake.models.gpt_units import GPTUnits
    from megatron_snake.optim.unit_params import UnitParams

    params = UnitParams.of(GPTUnits(gpt, interval))
    return [lay.numel for lay in params.units], params.shared.numel


# --- parameter counts -------------------------------------------------------------------

@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parameter_counts_equal_megatron_tp1(megatron_world, shape):
    """Per unit (UnitParams of GPTUnits: what each unit alone reads, and the tied weights
    several read) and in all, for 5, 3 and 1 unit(s)."""
    from megatron_snake.training.model import build_gpt_model

    args = _args(*SHAPES[shape])
    gpt = build_gpt_model(args, VOCAB, megatron_world)
    total = sum(p.numel() for p in gpt.parameters())
    assert preflight.gpt_parameter_total(args, VOCAB) == total
    for interval in INTERVALS:
        counts = preflight.gpt_parameter_counts(_with_interval(args, interval), VOCAB)
        units, shared = _megatron_counts(gpt, interval)
        assert (list(counts.units), counts.shared) == (units, shared), (shape, interval)
        assert counts.total == total
    # --bf16: the parameters Megatron still creates in fp32 (the initial weights' dtype)
    half = build_gpt_model(_args("--bf16", *SHAPES[shape]), VOCAB, megatron_world)
    assert preflight.fp32_at_build(args) == sum(
        p.numel() for p in half.parameters() if p.dtype == torch.float32)


def _parallel_counts_main(rank, world, port, out_dir):
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(local_rank_env(rank, world, port))
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megatron_snake.training import distributed
    from megatron_snake.training.model import build_gpt_model

    distributed.initialize(device=torch.device("cpu"), tensor_model_parallel_size=2,
                           pipeline_model_parallel_size=2)
    tp, pp = (parallel_state.get_tensor_model_parallel_rank(),
              parallel_state.get_pipeline_model_parallel_rank())
    found = {}
    for shape in ("default", "untied", "swiglu-gqa-rmsnorm-nobias-rope"):
        args = _args("--num-layers", "6", "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2", *SHAPES[shape])
        gpt = build_gpt_model(args, 2 * VOCAB, torch.device("cpu"))
        for interval in (1, 2, 3):
            counts = preflight.gpt_parameter_counts(_with_interval(args, interval), 2 * VOCAB,
                                                    tp_rank=tp, pp_rank=pp)
            found[f"{shape}/{interval}"] = {
                "megatron": _megatron_counts(gpt, interval),
                "total": sum(p.numel() for p in gpt.parameters()),
                "formula": [list(counts.units), counts.shared], "formula_total": counts.total}
    bf16 = _args("--num-layers", "6", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--bf16")
    half = build_gpt_model(bf16, 2 * VOCAB, torch.device("cpu"))
    found["bf16: created in fp32"] = {
        "megatron": sum(p.numel() for p in half.parameters() if p.dtype == torch.float32),
        "formula": preflight.fp32_at_build(bf16, pp_rank=pp)}
    with open(os.path.join(out_dir, f"counts{rank}.json"), "w") as f:
        json.dump({"tp": tp, "pp": pp, "found": found}, f)
    distributed.shutdown()


def test_parameter_counts_equal_megatron_tp2_pp2(tmp_path):
    """Four gloo ranks build the models under TP=2 x PP=2: each rank's per-unit counts
    (column/row-parallel weights split, row-parallel biases and norms whole, the last
    stage's copy of a tied embedding) equal the formula for its (tp, pp) rank."""
    mp.spawn(_parallel_counts_main, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    seen = set()
    for rank in range(4):
        report = json.loads((tmp_path / f"counts{rank}.json").read_text())
        seen.add((report["tp"], report["pp"]))
        for key, got in report["found"].items():
            assert got["formula"] == got["megatron"], (rank, key, got)
            assert got.get("formula_total") == got.get("total"), (rank, key, got)
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


# --- the bytes equal the start check on the built model ------------------------------------

CASES = {
    "nvme, tied, --save on the drive": ["--bf16", "--snake-checkpoint-interval", "2",
                                        "--save-interval", "5", "--train-iters", "20"],
    "pinned, auto tiers, host inputs": ["--untie-embeddings-and-output-weights",
                                        "--snake-gpu-memory-limit", "300KiB",
                                        "--snake-param-tier", "auto", "--snake-optimizer-tier",
                                        "auto", "--snake-activation-tier", "host",
                                        "--snake-host-memory-limit", "256MiB"],
    "data-parallel rank 1 of 3, alpha 0.4": ["--snake-alpha", "0.4", "--snake-param-tier",
                                             "host", "--snake-host-memory-limit", "1GiB",
                                             "--swiglu"],
}


@pytest.mark.parametrize("layer_by_layer", [True, False], ids=["as-build_run", "in-memory"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bytes_equal_build_offloaded_state(megatron_world, tmp_path, monkeypatch, case,
                                           layer_by_layer):
    """The pre-flight's figures are those the start check computes on the built model:
    tiers, pinned units, working set, host buffers, and the bytes the free-space check is
    asked for (build_run's path spills the initial weights to the drive while the model is
    built: they count until the state is made from them)."""
    from megatron_snake.offload.initial_weights import InitialWeights
    from megatron_snake.optim.dp_shards import DataParallel
    from megatron_snake.storage.store import TensorStore
    from megatron_snake.training import offloaded_state
    from megatron_snake.training.model import build_gpt_model

    offload = tmp_path / "offload"
    offload.mkdir()
    flags = [*CASES[case], "--snake-offload", "--snake-offload-dir", str(offload)]
    if "--save-interval" in flags:
        flags += ["--save", str(tmp_path / "ckpt")]
    args = _args(*flags)
    dp = DataParallel(1, 3) if "data-parallel" in case else DataParallel()
    if dp.size > 1:  # the build takes this rank's shards (no collective runs while building)
        monkeypatch.setattr(offloaded_state.DataParallel, "from_megatron", classmethod(
            lambda cls: dp))
    pf_args = copy.copy(args)
    pf_args.data_parallel_size = dp.size
    pf = preflight.estimate(pf_args, VOCAB, dp_rank=dp.rank)
    args.snake_host_memory_limit = pf.pool_bytes   # as preflight.run sets it (its default)

    with TensorStore(str(offload), rank=0, device=megatron_world,
                     host_memory_limit=args.snake_host_memory_limit) as store:
        asked, check_capacity = [], store.check_capacity
        store.check_capacity = lambda nbytes, also=None: \
            asked.append(nbytes + sum((also or {}).values())) or check_capacity(nbytes, also)
        initial = InitialWeights(store) if layer_by_layer else None
        gpt = build_gpt_model(args, VOCAB, megatron_world,
                              on_built=initial.spill if initial else None)
        assert pf.params_rank == sum(p.numel() for p in gpt.parameters())
        if initial:
            assert pf.nvme_initial == initial.nbytes
        state = offloaded_state.build_offloaded_state(args, gpt, store, megatron_world,
                                                      initial=initial)
        params = state.weights.params   # the layouts the build made (before the release)
        assert pf.tiers == state.tiers
        assert pf.pinned_units == tuple(sorted(state.weights.pinned))
        assert pf.pinned == state.weights.pinned_bytes()
        assert (pf.working_set, pf.working_set_unit) == \
            offloaded_state.unit_working_set_bytes(args, params)
        assert pf.host_buffers == offloaded_state.host_buffers_needed(
            args, params, dp, sorted(state.weights.pinned), store.host_buffers_for)
        assert pf.pool_buffers == store.pool.count
        assert pf.speculation == state.speculation and state.speculation.layouts
        assert pf.device_plan == state.device
        assert pf.device_plan.share == tuple(sorted(state.optimizer.device_layouts))
        assert asked == [pf.drive_planned - (0 if initial else pf.nvme_initial)]
        if not initial:   # nothing on the drive yet: the same margin, the same figure
            assert state.capacity[0] == pf.drive_needed - (
                pf.drive_needed - _with_margin(asked[0]))
            assert state.capacity[0] == _with_margin(pf.drive_planned - pf.nvme_initial)
        # what the store wrote: this rank's records (the start check also counts the
        # resident tied and pinned weights, and rounds the shard up over all of them)
        elem = pf.elem
        weights = sum(hi - lo for u, lay in enumerate(params.units)
                      if u not in state.weights.pinned
                      for _, (lo, hi) in state.weights.record_parts(lay)) * elem
        optimizer = state.optimizer.state_bytes()
        written = store.counters.written
        assert written["nvme"] + written["host"] == \
            weights + optimizer + (pf.nvme_initial if initial else 0)
        if dp.size == 1:
            assert pf.nvme_optimizer in (0, optimizer)
            assert weights == pf.counts.total * elem - pf.counts.shared * elem - pf.pinned
        state.optimizer.close()
    if "--save-interval" in flags:
        assert pf.checkpoints_on_drive and pf.checkpoints == 5 * (
            pf.params_rank * pf.elem + 12 * pf.params_rank)


def test_speculation_is_planned_first_in_the_forward_order_while_its_state_fits():
    """The layouts first in the forward sweep's order speculate while their kept state fits
    (the host pool's room, or the drive's free space with the space check's margin); none
    where no update waits for the step's verdict, or where the flag turns it off."""
    from megatron_snake.storage import directory
    from megatron_snake.training.offloaded_state import plan_speculation

    parts = [1000, 3000, 2000]            # each layout's backward part, in forward order
    buffers = lambda nbytes: -(-nbytes // 4096)   # noqa: E731 - a toy pool of 4 KiB buffers
    args = _args("--snake-offload")
    host = plan_speculation(args, parts, "host", buffers, host_room=11)
    assert host.layouts == (0,) and host.host_buffers == 3 and host.kept_bytes == 12000
    assert "room" in host.summary() and "1 of 3" in host.summary()
    assert plan_speculation(args, parts, "host", buffers, host_room=None).layouts == (0, 1, 2)
    room = int(12 * 4000 * (1 + directory.MARGIN_FRACTION)) + 1
    drive = plan_speculation(args, parts, "nvme", buffers, drive_room=room)
    assert drive.layouts == (0, 1) and drive.host_buffers == 0 and drive.kept_bytes == 48000
    for flags, why in [(["--snake-speculate", "off"], "--snake-speculate off"),
                       (["--clip-grad", "0"], "no clip or loss scale")]:
        none = plan_speculation(_args("--snake-offload", *flags), parts, "nvme", buffers)
        assert none.layouts == () and why in none.summary()
    fp16 = _args("--snake-offload", "--fp16", "--clip-grad", "0")
    assert plan_speculation(fp16, parts, "nvme", buffers).layouts == (0, 1, 2)


@pytest.mark.parametrize("flags,named", [
    (["--snake-device-optimizer-share", "1.5"], "auto or a share from 0 to 1"),
    (["--snake-device-optimizer-share", "half"], "auto or a share from 0 to 1"),
    (["--snake-device-optimizer-share", "0.5", "--use-precision-aware-optimizer", "--bf16"],
     "the states stay on the host"),
    (["--snake-device-optimizer-share", "1", "--snake-gpu-memory-limit", "600KiB"],
     "lower the share, or raise the limit")])
def test_a_device_share_that_cannot_be_is_one_line(capsys, tmp_path, flags, named):
    """--snake-device-optimizer-share: a value out of range, with the precision-aware
    optimizer, or more than the device memory limit leaves room for: one line naming the
    flag, before anything is built."""
    proc = subprocess.run(
        [sys.executable, SCRIPT, *TINY, "--snake-offload", "--snake-offload-dir",
         str(tmp_path), "--snake-dry-run", *flags], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert "--snake-device-optimizer-share" in err[-1] and named in err[-1], proc.stderr[-800:]
    assert "Traceback" not in proc.stderr


def _with_margin(planned: int) -> int:
    from megatron_snake.storage import directory

    return int(planned * (1 + directory.MARGIN_FRACTION)) + directory.MARGIN_BYTES


# --- 175B: decided from the flags in seconds -----------------------------------------------

GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
             "--seq-length", "2048", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             "50256", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--device", "cpu", "--snake-offload", "--snake-dry-run"]


def _gpt3_parameters() -> int:
    h, layers, vocab, seq = 12288, 96, 50304, 2048   # 50257 tokens padded to 128
    per_layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + \
        (4 * h * h + h)   # two LayerNorms, QKV, proj, fc1, fc2 (weights and biases)
    return layers * per_layer + vocab * h + seq * h + 2 * h   # + embeddings, final norm


def test_175b_is_decided_in_seconds_with_little_memory(tmp_path):
    """examples/pretrain_gpt.py --snake-dry-run on GPT-3 175B: the counts and every tier in
    seconds and under 1 GiB of peak RSS (measured in a fresh parent, so no other child of this
    test process counts). Refused here for the drive (about 3 TiB), with the shortfall."""
    flags = [*GPT3_175B, "--snake-offload-dir", str(tmp_path)]
    runner = textwrap.dedent(f"""
        import json, resource, subprocess, sys, time
        t0 = time.perf_counter()
        p = subprocess.run({[sys.executable, SCRIPT, *flags]!r}, capture_output=True,
                           text=True)
        print(json.dumps({{"s": time.perf_counter() - t0, "rc": p.returncode, "out": p.stdout,
                          "err": p.stderr[-4000:],
                          "rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}}))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = json.loads(subprocess.run([sys.executable, "-c", runner], capture_output=True,
                                       text=True, env=env, timeout=300, check=True).stdout)
    out, err = result["out"], result["err"]
    expected = _gpt3_parameters()
    assert expected == 174_604_836_864
    assert f"> pre-flight (from the flags, before anything is allocated): {expected:,} " \
           "parameters (174.60B)" in out, out + err
    assert "> pre-flight drive, --snake-offload-dir" in out, out
    # seconds, not the minutes (or the memory) building the model would take; 30 s leaves
    # room for a busy 2-core machine (13.6 s was measured beside another test run)
    assert result["s"] < 30, result["s"]
    assert result["rss"] * 1024 < 1 << 30, result["rss"]   # KiB on Linux
    from megatron_snake.training.arguments import parse_args

    args = parse_args(flags)   # the same flags, parsed here
    pf = preflight.estimate(args, 50304)
    free = preflight.drive_free_bytes(str(tmp_path))
    if pf.drive_needed <= free:   # a drive of 3 TiB: accepted
        assert result["rc"] == 0, err
        return
    assert result["rc"] == 1 and "pretrain_gpt.py: error: does not fit: " in err, err
    assert "Traceback" not in err, err
    needed, free_s, short = re.search(
        r"needs ([0-9.]+) GiB of drive space in all .*, ([0-9.]+) GiB is free: free "
        r"([0-9.]+) GiB more", err).groups()
    assert float(needed) == round(pf.drive_needed / 2**30, 2)
    assert abs(float(needed) - float(free_s) - float(short)) < 0.015
    assert float(short) > 0
    # with a drive large enough the same plan is accepted
    preflight.check(pf, args, [10 * pf.drive_needed])


# --- refusals before the model is built -----------------------------------------------------

@pytest.fixture
def no_model(monkeypatch):
    """pretrain must stop in the pre-flight: building the run is an error here."""
    from megatron_snake.training import loop

    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "build_run", built)


def _mounted_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def test_small_drive_is_refused_before_the_model_with_the_shortfall(megatron_world, tmp_path,
                                                                    monkeypatch, no_model):
    """A 4 MiB tmpfs (or, where mounting is not permitted, a probe saying 4 MiB): one
    CapacityError naming --snake-offload-dir, the total needed, the free space and the
    shortfall, and nothing made in the directory."""
    from megatron_snake.storage import directory
    from megatron_snake.storage.errors import CapacityError
    from megatron_snake.training.loop import pretrain

    tiny = tmp_path / "tiny"
    mounted = _mounted_tmpfs(tiny, "4m")
    try:
        if not mounted:
            monkeypatch.setattr(directory, "disk_free_bytes", lambda path: 4 << 20)
        args = _args("--snake-offload", "--snake-offload-dir", str(tiny))
        pf = preflight.estimate(args, 384)   # ByteTokenizer: 257 padded to 384
        free = preflight.drive_free_bytes(str(tiny))
        assert free <= 4 << 20
        with pytest.raises(CapacityError) as exc:
            pretrain(args)
        message = str(exc.value)
        assert message.startswith(f"--snake-offload-dir {tiny}: the run needs "
                                  f"{size(pf.drive_needed)} of drive space in all")
        assert f"{size(free)} is free: free " \
               f"{size(pf.drive_needed - free)} more" in message, message
        assert os.listdir(tiny) == [], "nothing made on the drive"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(tiny)], capture_output=True)


def test_each_tier_that_does_not_fit_is_named(megatron_world, tmp_path, monkeypatch,
                                              no_model):
    """Device, host and drive all too small: one error, each tier's flag and amount."""
    from megatron_snake.storage import directory
    from megatron_snake.training.loop import pretrain

    monkeypatch.setattr(directory, "disk_free_bytes", lambda path: 1 << 20)
    args = _args("--snake-offload", "--snake-offload-dir", str(tmp_path),
                 "--snake-gpu-memory-limit", "100KiB", "--snake-param-tier", "host",
                 "--snake-host-memory-limit", "24MiB")
    with pytest.raises(ValueError) as exc:
        pretrain(args)
    lines = str(exc.value).split("; --")   # one line: the three refusals, each its flag
    lines[1:] = ["--" + line for line in lines[1:]]
    assert len(lines) == 3, lines
    assert re.match(r"--snake-gpu-memory-limit 0.1 MiB is below .* the minimum is \d+ bytes",
                    lines[0]), lines[0]
    assert "raise --snake-host-memory-limit to at least" in lines[1], lines[1]
    assert lines[2].startswith(f"--snake-offload-dir {tmp_path}: the run needs"), lines[2]
    assert "1.0 MiB is free: free" in lines[2], lines[2]


def test_the_datasets_are_in_the_resident_memory_the_preflight_starts_from(
        megatron_world, tmp_path, monkeypatch, no_model):
    """The host figure starts from the resident memory measured at the pre-flight: the
    datasets' indices are counted only when they are built before it."""
    from megatron_snake.training import loop

    order, build_datasets, run = [], loop.build_gpt_datasets, preflight.run
    monkeypatch.setattr(loop, "build_gpt_datasets",
                        lambda *a, **k: order.append("datasets") or build_datasets(*a, **k))
    monkeypatch.setattr(preflight, "run",
                        lambda *a, **k: order.append("pre-flight") or run(*a, **k))
    with pytest.raises(AssertionError, match="the model was built"):
        loop.pretrain(_args("--snake-offload", "--snake-offload-dir", str(tmp_path)))
    assert order == ["datasets", "pre-flight"]


def test_dry_run_prints_the_estimate_and_builds_nothing(megatron_world, tmp_path, capfd,
                                                        no_model, monkeypatch):
    from megatron_snake.training.loop import pretrain

    # the process's resident memory, which the host line starts from, held still
    monkeypatch.setattr(preflight, "resident_bytes", lambda: 400 << 20)
    args = _args("--snake-offload", "--snake-dry-run", "--snake-offload-dir", str(tmp_path),
                 "--untie-embeddings-and-output-weights")
    assert pretrain(args) == []
    out = capfd.readouterr().out
    pf = preflight.estimate(args, 384)
    assert pf.summary([preflight.drive_free_bytes(str(tmp_path))]) in out
    for label in ("> pre-flight (", "> pre-flight device: ", "> pre-flight host: ",
                  "> pre-flight drive, "):
        assert label in out, out
    assert f"{pf.params_total:,} parameters" in out
    assert "iteration" not in out and os.listdir(tmp_path) == []


def test_dry_run_needs_snake_offload(capsys):
    expect_flag_error(capsys, ["--snake-dry-run"], "--snake-dry-run")


def _killed_runs_files(root, rank_dir_bytes: int):
    """rank0/ as a SIGKILLed run leaves it: its LOCK (nobody holds it) and a swap file of
    ``rank_dir_bytes`` allocated."""
    rank0 = root / "rank0"
    rank0.mkdir(mode=0o700)
    (rank0 / "LOCK").write_text('{"pid": 999999, "host": "gone"}')
    fd = os.open(rank0 / "weights.swap", os.O_WRONLY | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, rank_dir_bytes)
    os.close(fd)
    return rank0


def test_a_killed_runs_files_count_as_free_space(megatron_world, tmp_path, capsys):
    """A 300 MiB drive whose rank0/ holds 100 MiB of a killed run's swap files: the run
    removes them as it opens the store, so the pre-flight counts them as free and says so
    (it asked to "free 200 MiB more" of space the run would free itself); while a live
    job holds rank0/'s lock they are not counted."""
    import fcntl
    import subprocess

    from conftest import tiny_args
    from megatron_snake.training.loop import pretrain
    from megatron_snake.training.preflight import DoesNotFitError

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300m", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("mount not permitted here")
    try:
        rank0 = _killed_runs_files(mnt, 100 << 20)
        flags = ("--snake-offload", "--snake-offload-dir", str(mnt), "--train-iters", "1")
        lock = os.open(rank0 / "LOCK", os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)          # a live job's files: not counted
        with pytest.raises(DoesNotFitError, match=r"200\.\d MiB is free: free"):
            pretrain(tiny_args(*flags, "--snake-dry-run"))
        os.close(lock)
        capsys.readouterr()
        pretrain(tiny_args(*flags, "--snake-dry-run"))
        out = capsys.readouterr().out
        assert (f"300.0 MiB (with the 100.0 MiB of swap files a killed run left in {rank0}, "
                "which this run removes first) free") in out, out
        assert pretrain(tiny_args(*flags))                  # it trains, having removed them
        assert not rank0.exists()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
