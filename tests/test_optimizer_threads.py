"""--snake-optimizer-threads: the host optimizer's update runs on its own budget of torch
threads, and every other thread keeps its own (optim/cpu_threads.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import build_model, expect_flag_error, tiny_args
from megatron_snake.models.gpt_units import GPTUnits
from megatron_snake.optim.cpu_threads import (default_optimizer_threads, limit_this_thread,
                                              usable_cores)
from megatron_snake.optim.offloaded_adamw import OffloadedAdamW
from megatron_snake.optim.unit_params import UnitParams
from megatron_snake.storage.store import TensorStore

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


def test_the_default_leaves_half_the_cores():
    threads = default_optimizer_threads()
    assert 1 <= threads <= max(1, usable_cores() // 2)
    assert threads <= torch.get_num_threads()


def test_the_offloaded_optimizer_updates_on_its_budget(megatron_world, tmp_path):
    main = torch.get_num_threads()
    budget = 2 if main != 2 else 1
    params = UnitParams.of(GPTUnits(build_model(tiny_args(), megatron_world), 1))
    with TensorStore(tmp_path, host_memory_limit=64 * MiB) as store:
        opt = OffloadedAdamW(params, store, lr=1e-3, weight_decay=0.0, threads=budget)
        try:
            assert opt._worker.submit(torch.get_num_threads).result() == budget
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
