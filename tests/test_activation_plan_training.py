"""--snake-activation-tier auto: profile, plan (TERAIO), place each unit checkpoint by the
plan; no number changes, and the plan is printed and written as JSON."""

from __future__ import annotations

import json

import pytest

from megatron_snake.training.arguments import parse_args
from megatron_snake.training.loop import pretrain

DEMO = ["--train-iters", "4", "--snake-offload", "--hidden-dropout", "0.1",
        "--deterministic-mode"]


def test_plan_keeps_what_fits_and_offloads_the_rest(megatron_world, tmp_path, capsys):
    """The demo GPT's 12 checkpoints (1.5 MiB a step) under a 2.9 MiB device limit (about
    0.6 MiB left for checkpoints after the largest unit's weights and gradients): some stay
    in memory, the rest go to NVMe, and every loss equals the all-in-memory run's."""
    in_memory = pretrain(parse_args([*DEMO, "--snake-activation-tier", "device"]))
    planned = pretrain(parse_args([*DEMO, "--snake-activation-tier", "auto",
                                   "--snake-gpu-memory-limit", "2.9MiB",
                                   "--snake-offload-dir", str(tmp_path)]))
    assert planned == in_memory
    out = capsys.readouterr().out
    assert "activation plan after 2 profiled iterations" in out
    plan = json.loads((tmp_path / "activation_plan_rank0.json").read_text())
    tiers = [p["tier"] for p in plan["placements"]]
    assert len(tiers) == 12 and {"gpu", "nvme"} <= set(tiers), plan


def test_plan_without_a_limit_offloads_nothing(megatron_world, tmp_path):
    path = tmp_path / "plan.json"
    pretrain(parse_args([*DEMO, "--snake-activation-tier", "auto", "--snake-plan-json",
                         str(path), "--snake-profile-iters", "1"]))
    plan = json.loads(path.read_text())
    assert plan["placements"] and {p["tier"] for p in plan["placements"]} == {"gpu"}, plan


def test_plan_budget_too_small_names_the_flag(megatron_world, tmp_path):
    with pytest.raises(ValueError, match="--snake-gpu-memory-limit"):
        pretrain(parse_args([*DEMO, "--snake-activation-tier", "auto",
                             "--snake-gpu-memory-limit", "2.6MiB"]))
