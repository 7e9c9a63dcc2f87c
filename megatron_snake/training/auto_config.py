"""``--snake-auto``: choose the snake group size G, alpha, the checkpoint interval and the tier
of each state kind by the cost model (megatron_snake/planner), the one with the least
predicted step time among those that fit the device (the hardware profile), the host pool
(``--snake-host-memory-limit``, as the pre-flight checks it) and the drives.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

from megatron_snake.planner import DoesNotFit, Hardware, Prediction, load_profile, predict
from megatron_snake.storage.errors import HostMemoryError
from megatron_snake.training import preflight
from megatron_snake.training.snake_args import AUTO_CHOSEN_FLAGS
from megatron_snake.training.workload import workload_from_args

ALPHAS = (0.0, 0.125, 0.25, 0.375, 0.5)
MAX_INTERVAL = 4


@dataclass(frozen=True)
class Choice:
    group_size: int
    alpha: float
    checkpoint_interval: int
    param_tier: str
    optimizer_tier: str
    activation_tier: str

    def apply(self, args: argparse.Namespace) -> argparse.Namespace:
        return argparse.Namespace(**{
            **vars(args), "snake_group_size": self.group_size, "snake_alpha": self.alpha,
            "snake_checkpoint_interval": self.checkpoint_interval,
            "snake_param_tier": self.param_tier, "snake_optimizer_tier": self.optimizer_tier,
            "snake_activation_tier": self.activation_tier})

    def flags(self) -> str:
        return (f"--snake-group-size {self.group_size} --snake-alpha {self.alpha} "
                f"--snake-checkpoint-interval {self.checkpoint_interval} --snake-param-tier "
                f"{self.param_tier} --snake-optimizer-tier {self.optimizer_tier} "
                f"--snake-activation-tier {self.activation_tier}")


def candidates(args) -> list[Choice]:
    """Every setting worth predicting. Alpha matters only when updates may run in the
    backward sweep (no clipping, no loss scaling); a group size only with several stages."""
    m, pp = args.num_microbatches, args.pipeline_model_parallel_size
    groups = [g for g in range(1, m + 1) if m % g == 0] if pp > 1 else [m]
    alphas = ALPHAS if args.clip_grad == 0 and not args.fp16 else (0.25,)
    layers = args.num_layers // pp
    intervals = [i for i in range(1, min(MAX_INTERVAL, layers) + 1) if layers % i == 0]
    return [Choice(*c) for c in itertools.product(
        groups, alphas, intervals, ("host", "nvme"), ("host", "nvme"),
        ("device", "host", "nvme"))]


def _fits_host_pool(args, vocab_size: int) -> bool:
    pf = preflight.estimate(args, vocab_size)
    if preflight.short_of_pool(pf) is not None:   # the update leaves the pool no room
        return False
    try:
        preflight.check_host_memory(args, pf.tiers, pf.host_buffers, pf.pool_buffers,
                                    pf.buffer_bytes)
    except HostMemoryError:
        return False
    return True


def choose(args, vocab_size: int, hardware: Hardware) -> tuple[Choice, Prediction, int]:
    """(the fastest choice that fits, its prediction, how many candidates fit)."""
    best, fitting = None, 0
    for choice in candidates(args):
        trial = choice.apply(args)
        try:
            prediction = predict(workload_from_args(trial, vocab_size), hardware)
        except DoesNotFit:
            continue
        if not _fits_host_pool(trial, vocab_size):
            continue
        fitting += 1
        if best is None or prediction.step_time_s < best[1].step_time_s:
            best = (choice, prediction)
    if best is None:
        raise DoesNotFit(
            f"--snake-auto: no setting of {', '.join(AUTO_CHOSEN_FLAGS)} fits this model on "
            f"{hardware.name} with --snake-host-memory-limit "
            f"{args.snake_host_memory_limit >> 20} MiB: tools/plan.py with your settings "
            "names the tier that is short")
    return best[0], best[1], fitting


def describe(prediction: Prediction, hardware: Hardware) -> str:
    """The prediction's lines: step time, throughput and each sweep's resources."""
    b = prediction.breakdown
    sweeps = "; ".join(
        f"{s} {b[s]['time']:.3f} s (" + ", ".join(
            f"{k} {v:.3f}" for k, v in b[s].items() if k != "time") + ")"
        for s in ("forward", "backward"))
    return (f"> predicted on {hardware.name}: a step of {prediction.step_time_s:.3f} s, "
            f"{prediction.tokens_per_s:,.0f} tokens/s, MFU {prediction.mfu:.1%}; {sweeps}; "
            f"bubble {prediction.bubble_s:.3f} s")


def configure(args, vocab_size: int, log=print) -> None:
    """``--snake-auto``: set the chosen settings on ``args`` and print them with their
    prediction. ``--snake-dry-run --snake-hardware``: print the prediction of the flags."""
    hardware = load_profile(args.snake_hardware, "--snake-hardware")
    if not args.snake_auto:
        log(describe(predict(workload_from_args(args, vocab_size), hardware, check=False),
                     hardware))
        return
    choice, prediction, fitting = choose(args, vocab_size, hardware)
    for key, value in vars(choice.apply(args)).items():
        setattr(args, key, value)
    log(f"> snake-auto chose, of {fitting} settings that fit: {choice.flags()}")
    log(describe(prediction, hardware))
