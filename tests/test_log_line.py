"""The log line a newcomer reads: Megatron-LM's fields first (its names, order and
meanings), then the snake's after ``snake:``, compact by default and every figure with
--snake-log-details; the activation plan in one line and its JSON; no word that does not
apply (a CPU run's "gpu", an untied model's "tied"); the host pool's default sized to the
model."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import types

import pytest
import torch

from conftest import VOCAB
from megatron_snake.storage.host_pool import (DEFAULT_BUFFER_BYTES, DEFAULT_POOL_CAP_BYTES,
                                              STAGING_BUFFERS, default_pool_bytes)
from megatron_snake.storage.store import TensorStore
from megatron_snake.training import preflight
from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain
from megatron_snake.training.offloaded_state import working_set_error

# Megatron-LM 0.16.1's training_log (l.2033-2083) on this run: no --log-throughput flag
# here, so the throughput is always there; "GPU" is "device" off a GPU; one loss (lm loss)
MEGATRON_FIELDS = [
    r"iteration +\d+/ +\d+",
    r"consumed samples: +\d+",
    r"elapsed time per iteration \(ms\): \d+\.\d",
    r"throughput per device \(TFLOP/s/device\): [0-9.e+-]+",
    r"learning rate: \d\.\d{6}E[+-]\d\d",
    r"global batch size: +\d+",
    r"lm loss: \d\.\d{6}E[+-]\d\d",
    r"loss scale: \d+\.\d",
    r"grad norm: \d+\.\d{3}",
    r"number of skipped iterations: +\d+",
    r"number of nan iterations: +\d+",
]
MEGATRON_PREFIX = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] "
                             + " \\| ".join(MEGATRON_FIELDS) + " \\|")
COMPACT_SNAKE = re.compile(r" snake: peak RSS( \(cumulative\))? [0-9.]+ GiB \| drive r/w "
                           r"[0-9.]+/[0-9.]+ MB/s \| io wait [0-9.]+% \| pool peak \d+/\d+ MiB \|$")
DETAILS = ("tokens/s (all ranks): ", "peak RSS (", "nvme r/w (interval) ",
           "host pool peak (cumulative) ", "prefetch wait (interval) ",
           "other io wait (interval) ", "not waiting on io (interval) ")


def _pretrain_output(flags: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(parse_args(flags))
    return out.getvalue()


def _log_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "| lm loss: " in line]


@pytest.fixture(scope="module")
def demo(megatron_world, tmp_path_factory):
    """examples/pretrain_gpt.py --snake-offload --log-interval 5 on the CPU (the demo GPT),
    for 5 iterations, with the activation plan's JSON asked for."""
    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    out = _pretrain_output(["--snake-offload", "--log-interval", "5", "--train-iters", "5",
                            "--device", "cpu", "--snake-plan-json", str(plan)])
    return types.SimpleNamespace(out=out, plan=plan)


def test_the_default_line_is_megatron_lms_then_a_compact_snake_part(demo):
    """Megatron-LM's fields first, in its order and formats, then the snake's four; the
    whole line about 450 characters instead of 730-900: Megatron-LM's own fields take about
    350 of them (so 250 is out of reach while they keep their names), the snake's under 100."""
    (line,) = _log_lines(demo.out)
    head = MEGATRON_PREFIX.match(line)
    assert head, line
    snake = line[head.end():]
    assert COMPACT_SNAKE.fullmatch(snake), snake
    assert len(snake) < 100, (len(snake), snake)
    assert len(line) < 480, (len(line), line)
    assert not any(label in line for label in DETAILS), line
    # the line before it says what the compact figures are
    assert "(--snake-log-details: every figure)" in demo.out


def test_a_cpu_runs_output_never_says_gpu(demo):
    assert "gpu" not in demo.out.lower(), [l for l in demo.out.splitlines()
                                           if "gpu" in l.lower()]


def test_the_activation_plan_is_one_summary_line_and_its_json(demo):
    lines = [line for line in demo.out.splitlines() if line.startswith("> activation plan")]
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith("> activation plan after 2 profiled iterations: 12 unit inputs "), line
    assert line.endswith(f"every placement in {demo.plan}"), line
    assert not any(l.startswith(("placement plan", "  ('ckpt'")) for l in demo.out.splitlines())
    plan = json.loads(demo.plan.read_text())
    counts = {tier: sum(p["tier"] == tier for p in plan["placements"])
              for tier in ("gpu", "host", "nvme")}
    assert f"device {counts['gpu']}, host {counts['host']}, nvme {counts['nvme']};" in line


def test_the_store_is_made_with_the_pool_the_preflight_printed(demo):
    pool = re.search(r"> pre-flight host: .*\(pool ([0-9.]+) MiB: (\d+) buffers", demo.out)
    assert pool, demo.out
    assert float(pool.group(1)) < DEFAULT_POOL_CAP_BYTES >> 20
    assert "the pool is the default without --snake-host-memory-limit: " in demo.out
    (line,) = _log_lines(demo.out)
    assert re.search(rf"pool peak \d+/{float(pool.group(1)):.0f} MiB", line), line


def test_snake_log_details_brings_every_figure_back(megatron_world, tmp_path):
    """--snake-log-details: every figure after Megatron-LM's fields, the saved tensors'
    peak on the compute device named "device" on a CPU."""
    out = _pretrain_output(["--num-layers", "2", "--hidden-size", "32",
                            "--num-attention-heads", "4", "--seq-length", "64",
                            "--micro-batch-size", "2", "--global-batch-size", "4",
                            "--train-iters", "2", "--log-interval", "2", "--device", "cpu",
                            "--snake-offload", "--snake-activation-tier", "nvme",
                            "--snake-activation-offload",
                            "--snake-activation-offload-min-bytes", "4096",
                            "--snake-offload-dir", str(tmp_path), "--snake-log-details"])
    (line,) = _log_lines(out)
    head = MEGATRON_PREFIX.match(line)
    assert head and line[head.end():].startswith(" snake: tokens/s (all ranks): "), line
    for label in (*DETAILS, "unit inputs (interval) ", "unit inputs peak (last step) ",
                  "saved tensors peak (last step) device "):
        assert label in line, (label, line)
    assert "unless its label says (cumulative)" in out
    assert "gpu" not in out.lower()


# --- StoreMeter: the snake's fields, on this project's line and Megatron-LM's ----------

@pytest.mark.parametrize("details", [False, True], ids=["compact", "details"])
def test_the_plugins_suffix_has_the_same_fields(tmp_path, monkeypatch, details):
    """megatron_lm/log.py appends StoreMeter's fields, compact or (with
    --snake-log-details) every one, to Megatron-LM's own line."""
    from megatron_snake.megatron_lm import log as snake_log
    from megatron_snake.megatron_lm import run as plugin_run

    store = TensorStore(str(tmp_path), host_memory_limit=64 << 20, device=torch.device("cpu"))
    run = types.SimpleNamespace(tensor_store=store, forward_backward=None,
                                args=argparse.Namespace(snake_log_details=details))
    monkeypatch.setattr(plugin_run, "current", lambda: run)
    monkeypatch.setattr(snake_log, "_meter", None)
    line = (" [2025-01-01 00:00:00.000000] iteration        5/      20 | consumed "
            "samples:           40 | elapsed time per iteration (ms): 12.3 | lm loss: "
            "4.000000E+00 |")
    try:
        snake_log.with_snake_suffix(line, tensorboard_writer=None, wandb_writer=None)
        store.put("x", torch.ones(1 << 18), tier="nvme").wait()
        store.get("x").wait()
        out = snake_log.with_snake_suffix(line, tensorboard_writer=None, wandb_writer=None)
    finally:
        store.close()
    assert out.startswith(line + " snake: "), out
    suffix = out[len(line):]
    if details:
        assert "nvme r/w (interval) 1.0 MiB/1.0 MiB" in suffix, suffix
        assert "not waiting on io (interval)" in suffix, suffix
    else:
        assert re.fullmatch(r" snake: drive r/w [0-9.]+/[0-9.]+ MB/s \| io wait "
                            r"[0-9.]+% \| pool peak \d+/64 MiB \|", suffix), suffix
        assert "(interval)" not in suffix


# --- words that apply ------------------------------------------------------------------

def test_an_untied_models_preflight_never_says_tied():
    untied = parse_args(["--snake-offload", "--untie-embeddings-and-output-weights",
                         "--snake-gpu-memory-limit", "1KiB"])
    pf = preflight.estimate(untied, VOCAB)
    assert "tied" not in pf.summary([10 << 30]), pf.summary()
    with pytest.raises(ValueError) as refused:
        preflight.check(pf, untied, None)
    assert "working set" in str(refused.value) and "tied" not in str(refused.value)
    # a tied one names its shared embedding where it is counted
    tied = preflight.estimate(parse_args(["--snake-offload"]), VOCAB)
    assert "the tied embedding and its fp32 gradient" in tied.summary()
    assert "tied embedding" in str(working_set_error(1, 2, 0, tied=True))


# --- the host pool's default -----------------------------------------------------------

def test_the_pool_rule():
    mib8 = DEFAULT_BUFFER_BYTES
    assert default_pool_bytes(0) == STAGING_BUFFERS * mib8
    assert default_pool_bytes(60) == (60 + STAGING_BUFFERS) * mib8
    assert default_pool_bytes(10**6) == DEFAULT_POOL_CAP_BYTES
    assert default_pool_bytes(0, 1 << 30, cap_bytes=1 << 30) == 2 << 30   # 2 buffers at least


def test_the_pool_default_scales_down_for_a_small_model():
    """The demo GPT's pool: its state's buffers and the staging, not 2 GiB; the flag given
    is kept as it is; a large model gets the cap, and the pre-flight says why."""
    small = preflight.estimate(parse_args(["--snake-offload"]), VOCAB)
    need = small.host_buffers
    assert small.pool_bytes == default_pool_bytes(
        need.weights + need.optimizer + need.unit_inputs) < DEFAULT_POOL_CAP_BYTES
    assert small.pool_buffers == small.pool_bytes // DEFAULT_BUFFER_BYTES
    assert "the pool is the default without --snake-host-memory-limit: room for this " \
           "rank's state" in small.summary()
    given = preflight.estimate(parse_args(["--snake-offload", "--snake-host-memory-limit",
                                           "1GiB"]), VOCAB)
    # the flag bounds the pool and what the run holds outside it
    assert given.pool_bytes == (((1 << 30) - given.optimizer_update - given.partial_gradients)
                                // DEFAULT_BUFFER_BYTES * DEFAULT_BUFFER_BYTES)
    assert given.host_limit == 1 << 30
    assert "the pool is what --snake-host-memory-limit 1.00 GiB leaves after what the run " \
           "holds outside the pool" in given.summary()
    large = preflight.estimate(parse_args(["--snake-offload", "--num-layers", "48",
                                           "--hidden-size", "512",
                                           "--num-attention-heads", "8"]), VOCAB)
    assert large.pool_bytes == DEFAULT_POOL_CAP_BYTES
    assert "the pool is the default's cap" in large.summary() and "would be more" in \
        large.summary()


def test_the_pool_default_keeps_the_auto_tiers_choice():
    """--snake-param-tier / --snake-optimizer-tier auto take a quarter of the pool: the
    smaller default still puts on the host what the 2 GiB pool would."""
    flags = ["--snake-offload", "--snake-param-tier", "auto", "--snake-optimizer-tier", "auto"]
    default = preflight.estimate(parse_args(flags), VOCAB)
    capped = preflight.estimate(parse_args([*flags, "--snake-host-memory-limit", "2GiB"]),
                                VOCAB)
    assert default.tiers == capped.tiers == preflight.StateTiers("host", "host")
    assert default.pool_bytes < capped.pool_bytes
    preflight.check(default, parse_args(flags), None)   # and the host tiers fit it


def test_the_pool_default_is_the_cap_where_nothing_sizes_it():
    """Without --snake-offload (saved tensors alone: no pre-flight) and with saved tensors
    on the host tier (sized only while running) the default is the cap, as before."""
    args = parse_args(["--snake-activation-offload", "--snake-activation-tier", "host"])
    assert args.snake_host_memory_limit == DEFAULT_POOL_CAP_BYTES
    saved_on_host = preflight.estimate(parse_args(
        ["--snake-offload", "--snake-activation-offload", "--snake-activation-tier", "host"]),
        VOCAB)
    assert saved_on_host.pool_bytes == DEFAULT_POOL_CAP_BYTES
    assert "sized while running" in saved_on_host.summary()


# --- Megatron-LM's throughput: its FLOPs, per GPU ---------------------------------------

def test_the_flops_are_megatron_lms():
    """num_floating_point_operations of Megatron-LM 0.16.1 (training.py l.321-575) for a
    dense GPT with grouped-query attention and SwiGLU, written out here on its own."""
    from megatron_snake.training.train_log import model_flops_per_iteration

    args = parse_args(["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads",
                       "8", "--group-query-attention", "--num-query-groups", "2",
                       "--ffn-hidden-size", "96", "--swiglu", "--seq-length", "32",
                       "--micro-batch-size", "2", "--global-batch-size", "6"])
    B, s, h, L, V = 6, 32, 64, 3, 512
    q, kv = 8 * 8, 8 * 2
    megatron = B * s * (3 * 2 * h * (96 * 3) * L
                        + 3 * 2 * (h * (q + kv + kv) + q * s / 2 * 2 + q * h) * L
                        + 3 * 2 * h * V)
    assert model_flops_per_iteration(args, V) == pytest.approx(megatron, rel=1e-12)


def test_on_a_gpu_the_labels_are_megatron_lms_and_the_throughput_is_per_gpu(monkeypatch):
    """On a GPU: "throughput per GPU (TFLOP/s/GPU)", the FLOPs over time x ranks; the
    compact memory figures are the device's peak allocation and the peak RSS."""
    from megatron_snake.training import train_log

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {
        "allocated_bytes.all.peak": 3 << 30, "num_alloc_retries": 0})
    args = parse_args(["--log-interval", "1", "--global-batch-size", "16",
                       "--micro-batch-size", "8", "--fp16"], world_size=2)
    written = {}
    trackers = types.SimpleNamespace(active=True,
                                     write=lambda scalars, it: written.update(scalars))
    out = io.StringIO()
    log = train_log.TrainLog(args, 512, torch.device("cuda", 0), stream=out,
                             trackers=trackers)
    log.step(iteration=1, consumed_samples=16, lm_loss=5.0, lr=1e-4, grad_norm=1.5,
             loss_scale=65536.0, skipped=False)
    line = out.getvalue().rstrip("\n")
    fields = [f.replace("device", "GPU") for f in MEGATRON_FIELDS]
    assert re.match(r"^ \[[0-9 :-]+\] " + " \\| ".join(fields) + " \\| snake: max allocated "
                    r"3\.00 GiB \| peak RSS( \(cumulative\))? [0-9.]+ GiB \|$", line), line
    assert "loss scale: 65536.0 |" in line
    per_gpu = train_log.model_flops_per_iteration(args, 512) / (
        written["iteration-time"] * 1e12 * 2)
    assert written["throughput"] == pytest.approx(per_gpu)
    shown = float(re.search(r"\(TFLOP/s/GPU\): ([0-9.e+-]+)", line).group(1))
    assert shown == pytest.approx(per_gpu, rel=0.06)
