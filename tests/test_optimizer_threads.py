"""--snake-optimizer-threads: the host optimizer's update runs on its own budget of torch
threads, and every other thread keeps its own (optim/cpu_threads.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import build_model, expect_flag_error, tiny_args
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.optim import cpu_threads
from megatron_snake.optim.cpu_threads import (default_optimizer_threads, limit_this_thread,
                                              usable_cores)
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.unit_params import UnitParams
from megatron_snake.optim.zenflow import ZenFlowAdamW
from megatron_snake.storage.store import TensorStore
from megatron_snake.training import calibration

MiB = 1 << 20


def _threads_of_a_new_thread() -> int:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_limit_changes_the_calling_thread_only():
    before = torch.get_num_threads()
    other = 2 if before != 2 else 3
    seen = []

    def limited():
        limit_this_thread(other)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=limited)
    thread.start()
    thread.join()
    assert seen == [other]
    assert torch.get_num_threads() == before, "the caller's own count"
    assert _threads_of_a_new_thread() == before, "the default of threads started later"


def test_limits_on_several_threads_at_once_leave_the_default():
    before = torch.get_num_threads()
    for _ in range(50):
        start = threading.Barrier(2)

        def limit(n):
            start.wait()
            limit_this_thread(n)

        callers = [threading.Thread(target=limit, args=(n,)) for n in (2, 3)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        assert _threads_of_a_new_thread() == before


@pytest.mark.parametrize("cores, torch_threads, expected", [(16, 16, 8), (16, 4, 4), (2, 2, 1),
                                                            (1, 1, 1), (128, 1, 1)])
def test_the_default_is_half_the_cores_within_torchs_threads(monkeypatch, cores,
                                                             torch_threads, expected):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    assert default_optimizer_threads() == expected


def test_the_calibration_runs_at_the_budget(monkeypatch):
    seen = []
    real = calibration.fused_adamw_

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "fused_adamw_", counting)
    budget = 2 if torch.get_num_threads() != 2 else 1
    assert calibration.adamw_rate(1 << 12, threads=budget) > 0
    assert seen == [budget] * 3


def test_zenflows_cpu_update_runs_on_its_budget():
    budget = 2 if torch.get_num_threads() != 2 else 1
    layer = torch.nn.Linear(8, 8)
    opt = ZenFlowAdamW(layer.named_parameters(), lr=1e-3, weight_decay=0.0, threads=budget)
    try:
        assert opt._worker.submit(torch.get_num_threads).result() == budget
    finally:
        opt.close()


@pytest.mark.skipif(usable_cores() < 2, reason="a budget apart from the main thread's "
                    "count needs 2 cores")
def test_the_offloaded_optimizer_updates_on_its_budget(megatron_world, tmp_path):
    main = torch.get_num_threads()
    budget = 2 if main != 2 else 1
    params = UnitParams.of(GPTUnits(build_model(tiny_args(), megatron_world), 1))
    with TensorStore(tmp_path, host_memory_limit=64 * MiB) as store:
        opt = OffloadedAdamW(params, store, lr=1e-3, weight_decay=0.0, threads=budget)
        try:
            assert opt.updates.executor.submit(torch.get_num_threads).result() == budget
            assert torch.get_num_threads() == main
            assert _threads_of_a_new_thread() == main
        finally:
            opt.close()


@pytest.mark.parametrize("flags", [["--snake-optimizer-threads", "1"],
                                   ["--snake-offload", "--snake-optimizer-threads", "0"],
                                   ["--snake-offload", "--snake-optimizer-threads",
                                    str(usable_cores() + 1)]],
                         ids=["without an offloaded optimizer", "zero", "beyond the cores"])
def test_a_bad_budget_is_one_line_naming_the_flag(capsys, flags):
    expect_flag_error(capsys, flags, "--snake-optimizer-threads")


def test_the_budget_defaults_with_an_offloaded_optimizer():
    assert tiny_args("--snake-offload").snake_optimizer_threads == default_optimizer_threads()
    assert tiny_args("--snake-offload", "--snake-optimizer-threads", "1") \
        .snake_optimizer_threads == 1
    assert tiny_args().snake_optimizer_threads is None
