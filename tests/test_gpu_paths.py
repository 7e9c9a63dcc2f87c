"""CPU tests of code paths that matter on a GPU: what a CPU can show of them (the rest is
in tests/gpu, which runs where CUDA is).

- GDS: kvikio's compat mode AUTO means "cuFile when the system allows it"; the store asks
  kvikio which it will use instead of treating AUTO as POSIX.
- The activation planner's profiler times events with the compute device's clock: on a
  GPU, CUDA timing events read once per iteration, not the host's clock at launch.
- --snake-io-engine picks the store's engine and is refused where it would be ignored.
- The log line's first interval starts at the first step, not at start-up.
- --deterministic-mode sets the cuBLAS workspace torch requires for deterministic matmuls.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types

import pytest
import torch

from conftest import expect_flag_error, tiny_args
from megatron_snake.storage import gds
from megatron_snake.placement.lifetimes import LifetimeRecorder


def _fake_kvikio(mode: str, prefers_compat: bool | None):
    defaults = types.SimpleNamespace(compat_mode=lambda: types.SimpleNamespace(name=mode))
    if prefers_compat is not None:
        defaults.is_compat_mode_preferred = lambda: prefers_compat
    return types.SimpleNamespace(defaults=defaults, CuFile=None, __version__="fake")


@pytest.mark.parametrize("mode,prefers_compat,uses_gds", [
    ("AUTO", False, True),   # cuFile works here: GDS
    ("AUTO", True, False),   # kvikio would fall back to POSIX: our own engine instead
    ("ON", None, False),
    ("OFF", None, True),
])
def test_gds_follows_what_kvikio_will_use(monkeypatch, caplog, mode, prefers_compat, uses_gds):
    kvikio = _fake_kvikio(mode, prefers_compat)
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kvikio.defaults)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="megatron_snake.storage"):
        backend = gds.GdsBackend.create()
    assert (backend is not None) == uses_gds
    if not uses_gds:
        assert "--snake-io-engine gds" in caplog.text


class _FakeTimingEvent:
    """A CUDA timing event on a fake device clock that advances 5 ms per recorded event."""

    clock_ms = 0.0
    synchronized = 0

    def __init__(self, enable_timing=False, blocking=False):
        assert enable_timing, "profiling events must be timing events"
        self.at = None

    def record(self, stream=None):
        _FakeTimingEvent.clock_ms += 5.0
        self.at = _FakeTimingEvent.clock_ms

    def synchronize(self):
        _FakeTimingEvent.synchronized += 1

    def elapsed_time(self, end):
        return end.at - self.at


def test_profiler_times_events_with_the_device_clock(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeTimingEvent)
    rec = LifetimeRecorder(torch.device("cuda", 0))
    for unit in range(3):
        rec.begin(("F", unit, 0))
        time.sleep(0.02)           # host time: must not be what the timeline shows
        rec.end(("F", unit, 0))
    assert _FakeTimingEvent.synchronized == 0  # nothing waits while the schedule runs
    timeline, _ = rec.finish()
    assert [e.seconds for e in timeline.events] == pytest.approx([0.005] * 3)


def test_profiler_on_the_cpu_uses_the_host_clock():
    rec = LifetimeRecorder(torch.device("cpu"))
    rec.begin("a")
    time.sleep(0.02)
    rec.end("a")
    timeline, _ = rec.finish()
    assert timeline.events[0].seconds >= 0.02


def test_io_engine_flag_needs_an_offload_store(capsys):
    expect_flag_error(capsys, ["--snake-io-engine", "python"], "--snake-io-engine")


def test_io_engine_flag_reaches_the_store(megatron_world, tmp_path):
    from megatron_snake.training.offloaded_state import open_store

    args = tiny_args("--snake-offload", "--snake-io-engine", "python",
                     "--snake-offload-dir", str(tmp_path))
    with open_store(args, torch.device("cpu"), 0) as store:
        assert store.engine.name == "python"


def test_first_log_interval_starts_at_the_first_step(capsys):
    from megatron_snake.training.train_log import TrainLog

    args = tiny_args("--log-interval", "1")
    log = TrainLog(args, 128, torch.device("cpu"))
    time.sleep(0.5)                 # start-up: building the model, the store...
    log.start_interval()            # what the train loop does before its first step
    log.step(iteration=1, consumed_samples=8, lm_loss=1.0, lr=1e-4, grad_norm=1.0,
             loss_scale=1.0, skipped=False)
    line = capsys.readouterr().out
    per_iter_ms = float(line.split("elapsed time per iteration (ms):")[1].split("|")[0])
    assert per_iter_ms < 400, line
    assert "| snake: peak RSS " in line, line


def test_deterministic_mode_sets_the_cublas_workspace(megatron_world, monkeypatch):
    from megatron_snake.training.loop import pretrain

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    args = tiny_args("--deterministic-mode", "--train-iters", "1", "--device", "cpu")
    pretrain(args)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
