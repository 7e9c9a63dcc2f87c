"""Predict one training step of a --snake-offload run: its time, where the time goes, and the
bytes each tier holds and moves.

    python tools/plan.py <pretrain_gpt.py flags> --hardware PROFILE.json [--nodes N]
        [--drives N] [--json]

The model and the parallel sizes are pretrain_gpt.py's own flags, read by its own parser;
the world is ``--nodes`` x the profile's GPUs per node. A profile is measured by
tools/calibrate.py, or taken from megatron_snake/planner/profiles/ (public figures). The
cost model is megatron_snake/planner/cost.py; docs/scaling.md says what it counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_snake.planner import DoesNotFit, Hardware, predict  # noqa: E402
from megatron_snake.planner.hardware import load_profile  # noqa: E402


def planner_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plan.py", description="Predict a --snake-offload step; other flags are "
        "pretrain_gpt.py's", allow_abbrev=False)
    p.add_argument("--hardware", required=True,
                   help="hardware profile JSON (tools/calibrate.py, or a name in "
                        "megatron_snake/planner/profiles/ such as h100_4x_gen4)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the profile's kind")
    p.add_argument("--drives", type=int, default=None,
                   help="drives per node, of the kind the profile has (default: its own)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def workload_for(flags: list[str], hardware: Hardware, nodes: int):
    """The workload of pretrain_gpt.py ``flags`` on ``nodes`` nodes."""
    from megatron_snake.training.workload import workload_from_args
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.tokenizer import (build_tokenizer, padded_vocab_size,
                                                   tokenizer_flags)

    args = parse_args(flags, world_size=nodes * hardware.gpus_per_node)
    tokenizer = build_tokenizer(**tokenizer_flags(args))
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    return workload_from_args(args, vocab)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(pred, w, hw, nodes: int) -> str:
    b = pred.breakdown
    lines = [f"> plan: {hw.name}, {nodes} node(s), TP {w.tp} x PP {w.pp} x DP {w.dp}, "
             f"M {w.micro_batches} in groups of {w.group_size}",
             f"> step {pred.step_time_s:.3f} s | tokens/s {pred.tokens_per_s:,.0f} | "
             f"MFU {pred.mfu:.1%} | bubble {pred.bubble_s:.3f} s | slowest stage "
             f"{pred.slowest}"]
    for sweep in ("forward", "backward"):
        parts = ", ".join(f"{k} {v:.3f}" for k, v in b[sweep].items() if k != "time")
        lines.append(f"> {sweep} sweep {b[sweep]['time']:.3f} s (seconds: {parts})")
    for tier, t in pred.bytes.items():
        lines.append(f"> {tier}: holds {_gib(t['capacity'])} per GPU; per step read "
                     f"{_gib(t['read'])}, written {_gib(t['written'])}")
    lines.append(f"> drive capacity per node {pred.drive_capacity_per_node / 1e12:.2f} TB of "
                 f"{hw.drive_capacity / 1e12:.2f} TB")
    return "\n".join(lines)


def main(argv=None) -> int:
    ours, flags = planner_parser().parse_known_args(argv)
    if ours.nodes < 1:
        planner_parser().error("--nodes must be >= 1")
    if ours.drives is not None and ours.drives < 1:
        planner_parser().error("--drives must be >= 1")
    try:
        hw = load_profile(ours.hardware)
        if ours.drives is not None:
            hw = hw.with_drives(ours.drives)
        w = workload_for(flags, hw, ours.nodes)
        pred = predict(w, hw)
    except DoesNotFit as exc:
        print(f"plan.py: does not fit: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"plan.py: {exc}", file=sys.stderr)
        return 2
    if ours.json:
        print(json.dumps({**pred.to_dict(), "nodes": ours.nodes, "hardware": hw.name,
                          "drives": hw.drives,
                          "settings": {"tp": w.tp, "pp": w.pp, "dp": w.dp,
                                       "micro_batches": w.micro_batches,
                                       "group_size": w.group_size, "alpha": w.alpha,
                                       "param_tier": w.param_tier,
                                       "optimizer_tier": w.optimizer_tier,
                                       "activation_tier": w.activation_tier}}))
    else:
        print(report(pred, w, hw, ours.nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
