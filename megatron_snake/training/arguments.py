"""Command-line flags: Megatron-LM's names and defaults, plus the ``--snake-*`` flags.

Model-shape flags default to a tiny GPT so that ``python examples/pretrain_gpt.py
--snake-offload`` runs a demo on any machine; every default is shown by ``--help``.

Each flag rule lives in one place. A rule about one component's value lives beside that
component (``check_alpha``, ``check_checkpoint_interval``, ``snake_groups``,
``ZenFlowSettings``, ``build_tokenizer``, ``data_parallel_size``) and ``validate_args`` calls
it, so the command line and a direct caller get the same message. Rules about how flags
combine live here, and only here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

from megatron_snake.models.gpt_units import check_checkpoint_interval
from megatron_snake.optim.adamw import check_clip_grad
from megatron_snake.optim.offloaded_adamw import check_alpha
from megatron_snake.optim.zenflow import ZenFlowSettings
from megatron_snake.planner.hardware import load_profile
from megatron_snake.schedule.pipeline import default_group_size, snake_groups
from megatron_snake.storage.errors import OffloadError
from megatron_snake.storage.host_pool import (check_host_memory_limit,
                                             physical_memory_bytes)
from megatron_snake.storage.sizes import parse_size
from megatron_snake.training.distributed import data_parallel_size
from megatron_snake.training.tokenizer import (add_tokenizer_args, build_tokenizer,
                                                 tokenizer_flags)
from megatron_snake.training.tracking import check_tracking_args

SNAKE_SCHEDULES = ("vertical", "horizontal")
DEFAULT_SPLIT = "969, 30, 1"  # --split with --data-path unless given (Megatron-LM's)
# Flags of the offloaded state: their defaults apply with --snake-offload, and given
# without it they are an error.
OFFLOAD_ONLY_DEFAULTS = {"--snake-param-tier": "nvme", "--snake-optimizer-tier": "nvme",
                         "--snake-alpha": 0.25, "--snake-gpu-memory-limit": None}
# The settings --snake-auto chooses: given with it, they are an error (not silently ignored).
AUTO_CHOSEN_FLAGS = ("--snake-group-size", "--snake-alpha", "--snake-checkpoint-interval",
                     "--snake-param-tier", "--snake-optimizer-tier", "--snake-activation-tier")
SNAKE_TIERS = ("device", "host", "nvme")
ACTIVATION_TIERS = SNAKE_TIERS + ("auto",)
IO_ENGINES = ("auto", "uring", "threads", "python", "gds")
ZENFLOW_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ZenFlowSettings)}
# Ranges of single flags (a value outside crashed deep inside, or was silently misread).
# A float flag is refused as NaN or infinite too. A flag left out (None) is not checked.
AT_LEAST_ONE = ("--micro-batch-size", "--global-batch-size", "--train-iters", "--log-interval",
                "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups",
                "--seq-length", "--make-vocab-size-divisible-by", "--rotary-base",
                "--hysteresis", "--snake-profile-iters", "--exit-interval", "--save-interval",
                "--ffn-hidden-size", "--kv-channels", "--max-position-embeddings",
                "--lr-decay-iters", "--snake-trace-iteration",
                "--snake-activation-offload-min-bytes")   # SavedTensorOffloader's min_bytes
AT_LEAST_ZERO = ("--eval-interval", "--eval-iters", "--lr-warmup-iters", "--lr", "--min-lr",
                 "--lr-warmup-init", "--weight-decay", "--num-workers", "--init-method-std")
POSITIVE = ("--distributed-timeout-minutes", "--exit-duration-in-mins", "--norm-epsilon",
            "--adam-eps", "--loss-scale", "--initial-loss-scale", "--min-loss-scale",
            "--loss-scale-window")
FRACTIONS = ("--hidden-dropout", "--attention-dropout", "--lr-warmup-fraction")
OPEN_UNIT = ("--adam-beta1", "--adam-beta2")   # torch's and Megatron's rule for Adam's betas
ABOVE_ZERO_TO_ONE = ("--rotary-percent",)
RANGES = ((AT_LEAST_ONE, lambda v: v >= 1, ">= 1"),
          (AT_LEAST_ZERO, lambda v: v >= 0, ">= 0"),
          (POSITIVE, lambda v: v > 0, "> 0"),
          (FRACTIONS, lambda v: 0 <= v <= 1, "between 0 and 1"),
          (OPEN_UNIT, lambda v: 0 <= v < 1, "in [0, 1)"),
          (ABOVE_ZERO_TO_ONE, lambda v: 0 < v <= 1, "in (0, 1]"))
# numpy's seeds are 0 .. 2**32 - 1, and set_seed adds 100 per pipeline stage
SEED_LIMIT = 2 ** 32 - 1
SEED_STAGE_OFFSET = 100
DEFAULT_TRACE_ITERATION = 2   # the first steady iteration
PATHS = ("--save", "--load", "--pretrained-checkpoint", "--snake-offload-dir", "--snake-plan-json", "--data-cache-path",
         "--tensorboard-dir", "--wandb-save-dir")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a Megatron-Core GPT; --snake-offload uses megatron_snake's "
                    "vertical schedule.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False)

    g = p.add_argument_group("model (defaults: a tiny demo GPT)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden-size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default: seq-length")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="layer spec; transformer_engine needs a GPU and Transformer Engine")

    g = p.add_argument_group("batch and training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (saving a checkpoint if --save is given) once the iteration "
                        "is a multiple of this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save (with --save), remove the "
                        "offload files and exit with status 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop the same way once the run has lasted this long")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="go on when the loss or the gradient norm is NaN or Inf (by default "
                        "training stops there, as in Megatron-LM)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="torch.use_deterministic_algorithms(True)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="a collective that waits longer than this (e.g. for a rank that "
                        "died) fails instead of hanging")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split layer norms, dropout and stage-boundary activations along the "
                        "sequence across tensor-parallel ranks (needs TP > 1)")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam"])
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale; default: dynamic loss scaling for fp16")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100,
                   help="iterations per log line; its figures cover those iterations")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars (Megatron-LM's names, plus snake/ bytes "
                        "per tier, I/O wait and overlap) here; needs the tensorboard package")
    g.add_argument("--wandb-project", default=None,
                   help="log the same scalars to Weights & Biases (WANDB_MODE=offline works "
                        "without a network); needs the wandb package")
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run's name")
    g.add_argument("--wandb-save-dir", default=None,
                   help="wandb's local files; default <--save>/wandb, or ./wandb without "
                        "--save")
    g.add_argument("--profile", action="store_true",
                   help="write a torch profiler trace of iterations --profile-step-start to "
                        "--profile-step-end into --tensorboard-dir")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="iterations done before profiling starts (counted from 0)")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="iterations done when profiling stops")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="the global ranks that profile")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--ckpt-format", default=None, choices=["torch", "torch_dist"],
                   help="how --save writes: torch_dist (the default, as in Megatron-LM: "
                        "Megatron-Core's distributed format, which loads into another TP / PP "
                        "/ DP layout, with or without --snake-offload; "
                        "an offloaded run writes it one unit at a time) or torch (this "
                        "project's own: one checksummed file per rank, and with "
                        "--snake-offload one per unit; the same layout only; the default "
                        "with --snake-zenflow). --load reads either")
    g.add_argument("--no-save-optim", action="store_true",
                   help="save the weights without the optimizer state (load such a checkpoint "
                        "with --no-load-optim or --finetune)")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="refuse a --load directory that holds no checkpoint (by default the "
                        "run starts from scratch, as in Megatron-LM)")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load iteration N of --load, whatever its "
                        "latest_checkpointed_iteration.txt says")
    g.add_argument("--finetune", action="store_true",
                   help="load only the weights from --load: iteration, consumed samples, "
                        "optimizer and RNG start afresh")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="a checkpoint directory loaded as with --finetune when --load has no "
                        "checkpoint yet (or is not given)")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, take this run's learning-rate schedule flags over the "
                        "checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler",
                   help="on --load, keep the checkpoint's learning-rate schedule")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic data (the default when no data path is given)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefixes, optionally weighted: [w1] p1 [w2] p2 ...; "
                        "split into train/valid/test by --split")
    g.add_argument("--split", default=None,
                   help="train,valid,test proportions of --data-path's documents; default "
                        f"'{DEFAULT_SPLIT}' with --data-path (Megatron-LM's legacy default)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"an independent {split} dataset, used whole (instead of "
                            "--data-path and --split); same format as --data-path")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="mask the loss on end-of-document tokens")
    g.add_argument("--num-workers", type=int, default=2,
                   help="DataLoader worker processes reading batches ahead (0: read them "
                        "in the training process)")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset index caches go (shared by all ranks); default "
                        "$MEGATRON_SNAKE_DATA_CACHE or ~/.cache/megatron_snake")
    add_tokenizer_args(g)

    g = p.add_argument_group("megatron_snake")
    g.add_argument("--snake-offload", action="store_true",
                   help="train with the vertical (snake) schedule over the tiered store")
    g.add_argument("--snake-checkpoint-interval", type=int, default=1,
                   help="layers per unit: the granularity of weight loading and recompute")
    g.add_argument("--snake-schedule", default="vertical", choices=SNAKE_SCHEDULES,
                   help="micro-batch order over the store: vertical (unit-major, snake) or "
                        "horizontal (Megatron's micro-batch-major order, weights fetched per "
                        "micro-batch: for ablations)")
    g.add_argument("--snake-group-size", type=int, default=None,
                   help="micro-batches per snake group G: a stage sweeps G micro-batches "
                        "through its units before passing them on, so weights are read M/G "
                        "times per sweep and the pipeline bubble is about (p-1)/(M/G+p-1). "
                        "Default: M with one pipeline stage (pure GreedySnake); with p > 1 "
                        "stages the largest divisor of M giving at least 4(p-1) groups")
    g.add_argument("--snake-offload-dir", default=None,
                   help="existing directory for offloaded state (rank<N>/ is made below "
                        "it); may be a template with {node} (this node's index, torchrun's "
                        "GROUP_RANK), {hostname}, {rank} and {local_rank}, e.g. "
                        "/nvme/{node}/{local_rank}; default: a new temporary directory")
    g.add_argument("--snake-activation-tier", default=None, choices=ACTIVATION_TIERS,
                   help="where unit inputs (activation checkpoints) live between the forward "
                        "and backward sweeps; auto: profile, then place each by a "
                        "lifetime-aware plan (the device within --snake-gpu-memory-limit, "
                        "host memory when it fits, else the drive). Default: auto for the "
                        "vertical schedule, nvme otherwise (the horizontal ablation, "
                        "--snake-activation-offload alone)")
    g.add_argument("--snake-profile-iters", type=int, default=2,
                   help="iterations profiled before the activation plan is made (auto tier)")
    g.add_argument("--snake-plan-json", default=None,
                   help="where the activation plan is written (auto tier); default "
                        "<offload-dir>/activation_plan_rank<N>.json with --snake-offload-dir")
    g.add_argument("--snake-activation-offload", action="store_true",
                   help="SSDTrain: tensors autograd saves go to --snake-activation-tier (nvme "
                        "for the vertical schedule unless that tier is host) and come back "
                        "for backward, deduplicated and prefetched; with Megatron's schedule, "
                        "or with --snake-offload inside each unit's recompute")
    g.add_argument("--snake-activation-offload-min-bytes", type=int, default=1 << 20,
                   help="saved tensors smaller than this stay in memory")
    g.add_argument("--snake-param-tier", default=None, choices=("host", "nvme", "auto"),
                   help="where unit working weights live between their uses (default nvme "
                        "with --snake-offload); auto: host when "
                        "they fit in a quarter of --snake-host-memory-limit, else nvme")
    g.add_argument("--snake-optimizer-tier", default=None, choices=("host", "nvme", "auto"),
                   help="where fp32 master weights, Adam moments and gradients live (default "
                        "nvme with --snake-offload); auto: "
                        "host when they fit in what a quarter of --snake-host-memory-limit "
                        "leaves after the weights, else nvme")
    g.add_argument("--snake-alpha", type=float, default=None,
                   help="fraction of each unit's optimizer update deferred from the backward "
                        "sweep to the next forward sweep (0 to 0.5, default "
                        f"{OFFLOAD_ONLY_DEFAULTS['--snake-alpha']}); with --clip-grad the "
                        "whole update waits for the global norm and runs in the forward sweep")
    g.add_argument("--snake-gpu-memory-limit", default=None,
                   help="compute-device memory the offloaded run may use (e.g. 40GiB); checked "
                        "at start against the largest unit's working set; what is left after "
                        "it and the step's checkpoints keeps units' weights on the device "
                        "(pinned: not re-read each sweep). Default: no check, nothing pinned")
    g.add_argument("--snake-host-memory-limit", default="2GiB",
                   help="hard limit of the host buffer pool (e.g. 4GiB)")
    g.add_argument("--snake-auto", action="store_true",
                   help="choose " + ", ".join(AUTO_CHOSEN_FLAGS) + " by the cost model "
                        "(megatron_snake/planner) for --snake-hardware: the least predicted "
                        "step time within the device's memory, --snake-host-memory-limit and "
                        "the drives; prints the choice and its predicted breakdown, then "
                        "trains with it")
    g.add_argument("--snake-hardware", default=None, metavar="PROFILE",
                   help="hardware profile for --snake-auto and --snake-dry-run's prediction: "
                        "a JSON file (tools/calibrate.py) or a shipped profile's name "
                        "(megatron_snake/planner/profiles/)")
    g.add_argument("--snake-dry-run", action="store_true",
                   help="with --snake-offload: print the pre-flight (the bytes each tier "
                        "needs: the device's working set, host memory, drive space), check "
                        "it, and exit before the model is built")
    g.add_argument("--snake-trace", default=None, metavar="FILE",
                   help="write a Chrome trace (chrome://tracing, ui.perfetto.dev, "
                        "tools/plot_timeline.py) of one training iteration to FILE: compute, "
                        "each store worker, the drive, the optimizer worker, collectives and "
                        "waits, one row per thread")
    g.add_argument("--snake-trace-iteration", type=int, default=None,
                   help="the iteration of this run --snake-trace records, counted from 1, at "
                        "most --train-iters (default "
                        f"{DEFAULT_TRACE_ITERATION}: the first steady one; the last if the "
                        "run is shorter)")
    g.add_argument("--snake-io-engine", default="auto", choices=IO_ENGINES,
                   help="how offloaded bytes reach the drive: auto (native io_uring, else "
                        "the native thread pool, else Python), uring, threads (the native "
                        "pthread pool), python (threads + preadv/pwritev), or gds "
                        "(GPUDirect Storage through kvikio for GPU tensors; falls back to "
                        "auto, saying why, where cuFile is not in use)")

    g = p.add_argument_group("ZenFlow (approximate: important columns at once, the rest late)")
    g.add_argument("--snake-zenflow", action="store_true",
                   help="APPROXIMATE optimizer mode (ZenFlow): the top gradient columns of each "
                        "2-D weight and all 1-D parameters are updated at once on the compute "
                        "device, the rest accumulate in host memory and a CPU AdamW applies "
                        "them every update-interval steps; with Megatron's schedule (weights "
                        "on the compute device, optimizer state in host memory)")
    g.add_argument("--snake-zenflow-topk-ratio", type=float, default=None,
                   help=f"fraction of each 2-D weight's columns (by per-column sum of |grad|) "
                        f"updated at once, in (0, 1] (default {ZENFLOW_DEFAULTS['topk_ratio']})")
    g.add_argument("--snake-zenflow-select-interval", type=int, default=None,
                   help="steps between column re-selections, >= the update interval "
                        f"(default {ZENFLOW_DEFAULTS['select_interval']})")
    g.add_argument("--snake-zenflow-update-interval", type=int, default=None,
                   help="steps whose gradients of the other columns are accumulated before "
                        f"the CPU applies them (default {ZENFLOW_DEFAULTS['update_interval']})")
    g.add_argument("--snake-zenflow-full-warmup-steps", type=int, default=None,
                   help="first steps that are exact full AdamW updates on the CPU "
                        f"(default {ZENFLOW_DEFAULTS['full_warmup_steps']})")
    g.add_argument("--snake-zenflow-overlap-step", action="store_true", default=None,
                   help="run the CPU update in the background during the next update "
                        "interval (it lands one interval later) instead of at once")
    return p


def _validate_auto(args, parser) -> None:
    if args.snake_auto and not args.snake_offload:
        _fail(parser, "--snake-auto", "configures --snake-offload's run; add --snake-offload")
    if args.snake_auto and args.snake_schedule != "vertical":
        _fail(parser, "--snake-auto", "plans the vertical schedule; drop --snake-schedule "
              "horizontal")
    if args.snake_hardware is None:
        if args.snake_auto:
            _fail(parser, "--snake-auto", "needs --snake-hardware PROFILE (measure one with "
                  "tools/calibrate.py, or name a shipped one such as h100_4x_gen4)")
        return
    if not (args.snake_auto or args.snake_dry_run):
        _fail(parser, "--snake-hardware", "is read by --snake-auto and --snake-dry-run; add "
              "one of them or drop the flag")
    if args.snake_schedule != "vertical" or args.snake_activation_offload:
        _fail(parser, "--snake-hardware", "the cost model plans the vertical schedule "
              "without --snake-activation-offload; drop one of them")
    _check(parser, load_profile, args.snake_hardware, "--snake-hardware")


def _validate_data(args, parser) -> None:
    """One data source, as Megatron-LM requires: --mock-data, --data-path (with --split),
    or the per-split paths (each used whole, so no --split). Files are checked when the
    datasets are built (data.parse_data_path), as for --data-path."""
    per_split = {f"--{s}-data-path": getattr(args, f"{s}_data_path")
                 for s in ("train", "valid", "test")}
    given = [flag for flag, value in per_split.items() if value is not None]
    for flag, value in [("--data-path", args.data_path), *per_split.items()]:
        if value == []:  # nargs="*" with nothing after it
            _fail(parser, flag, "is empty; give dataset prefixes, or drop the flag")
    if given:
        if args.data_path is not None or args.mock_data:
            other = "--data-path" if args.data_path is not None else "--mock-data"
            _fail(parser, given[0], f"cannot be combined with {other}; give one data source")
        if args.train_data_path is None:
            _fail(parser, given[0], "needs --train-data-path: the run trains on it")
        if args.split is not None:
            _fail(parser, "--split", f"applies to --data-path; {given[0]} is used whole "
                  "(Megatron-LM refuses a split with per-split paths); drop --split")
    elif args.data_path is not None:
        if args.mock_data:
            _fail(parser, "--mock-data", "cannot be combined with --data-path; give one "
                  "data source")
        if args.split is None:
            args.split = DEFAULT_SPLIT
    args.mock_data = not (args.data_path or given)


def _validate_trace(args, parser) -> None:
    given = args.snake_trace_iteration
    if args.snake_trace is None:
        if given is not None:
            _fail(parser, "--snake-trace-iteration", "chooses the iteration --snake-trace "
                  "records; add --snake-trace FILE or drop the flag")
        return
    if given is not None and given > args.train_iters:
        _fail(parser, "--snake-trace-iteration", f"{given} is never reached in a run of "
              f"--train-iters {args.train_iters}; give 1 to {args.train_iters}")
    if given is None:   # the default: the loop takes the last iteration of a shorter run
        args.snake_trace_iteration = DEFAULT_TRACE_ITERATION
    folder = os.path.dirname(os.path.abspath(args.snake_trace))
    if os.path.isdir(args.snake_trace) or not os.path.isdir(folder) or \
            not os.access(folder, os.W_OK):
        _fail(parser, "--snake-trace", f"{args.snake_trace!r} must name a file in an "
              "existing, writable directory (it is written at the traced iteration)")


def _validate_loading(args, parser) -> None:
    """--load, --pretrained-checkpoint and how much of a checkpoint is taken."""
    if args.pretrained_checkpoint is not None:
        if not os.path.isdir(args.pretrained_checkpoint):
            _fail(parser, "--pretrained-checkpoint", f"directory {args.pretrained_checkpoint!r} "
                  "does not exist; give the --save directory of an earlier run")
    elif args.load is not None and not os.path.isdir(args.load):
        # with --pretrained-checkpoint, --load may be the --save directory not made yet
        _fail(parser, "--load", f"directory {args.load!r} does not exist; give the --save "
              "directory of an earlier run, or drop --load to start from scratch")
    if args.ckpt_step is not None:
        if args.load is None:
            _fail(parser, "--ckpt-step", "names an iteration of --load; add --load")
        if args.ckpt_step < 0:
            _fail(parser, "--ckpt-step", f"must be >= 0, got {args.ckpt_step}")
    if args.finetune and args.load is None and args.pretrained_checkpoint is None:
        _fail(parser, "--finetune", "loads the weights of --load or --pretrained-checkpoint; "
              "add one of them")
    if args.ckpt_format == "torch_dist" and args.snake_zenflow:
        _fail(parser, "--ckpt-format", "torch_dist is not written by --snake-zenflow runs (its "
              "split optimizer has no sharded state); use --ckpt-format torch")
    if args.ckpt_format is None:   # Megatron-LM's default, where the optimizer has one
        args.ckpt_format = "torch" if args.snake_zenflow else "torch_dist"
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail(parser, "--override-opt_param-scheduler", "and --use-checkpoint-opt_param-"
              "scheduler ask for opposite schedules; drop one")


def _validate_tracking(args, parser) -> None:
    """TensorBoard, wandb, --profile and the early-exit clock."""
    _check(parser, check_tracking_args, args)
    if not args.profile:
        return
    if not args.tensorboard_dir:
        _fail(parser, "--profile", "writes its trace into --tensorboard-dir; add it")
    if not 0 <= args.profile_step_start < args.profile_step_end:
        _fail(parser, "--profile-step-end", f"{args.profile_step_end} must be larger than "
              f"--profile-step-start {args.profile_step_start} (which must be >= 0)")
    world = args.data_parallel_size * args.tensor_model_parallel_size * \
        args.pipeline_model_parallel_size
    if not all(0 <= r < world for r in args.profile_ranks):
        _fail(parser, "--profile-ranks", f"{args.profile_ranks}: ranks are 0..{world - 1} in "
              f"this world of {world}")
    if args.profile_step_start >= args.train_iters:
        _fail(parser, "--profile-step-start", f"{args.profile_step_start} iterations are never "
              f"done before profiling in a run of --train-iters {args.train_iters}")


def _fail(parser: argparse.ArgumentParser, flag: str, message: str):
    parser.error(f"{flag}: {message}")


def _check(parser: argparse.ArgumentParser, rule, *values):
    """Apply a component's own rule to flag values; its ValueError (which names the flag)
    becomes the usage error."""
    try:
        return rule(*values)
    except (ValueError, OffloadError) as exc:
        parser.error(str(exc))


def _validate_ranges(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Each flag's own range, before anything divides by it. The checks are written
    ``not (finite and in range)``: NaN compares False with everything, so ``nan < 0`` would
    let it through."""
    for flags, in_range, accepted in RANGES:
        for flag in flags:
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                _fail(parser, flag, f"must be a finite number {accepted}, got {value}")
            if not in_range(value):
                _fail(parser, flag, f"must be {accepted}, got {value}")
    highest = SEED_LIMIT - SEED_STAGE_OFFSET * (args.pipeline_model_parallel_size - 1)
    if not 0 <= args.seed <= highest:
        _fail(parser, "--seed", f"must be between 0 and {highest} (numpy takes seeds below "
              f"2**32, and each pipeline stage adds {SEED_STAGE_OFFSET}), got {args.seed}")
    for flag in PATHS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value.strip():
            _fail(parser, flag, "is an empty path; give a directory, or drop the flag")
    _check(parser, check_clip_grad, args.clip_grad)


def _validate_pipeline(args, parser) -> None:
    """Pipeline stages and snake groups."""
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        _fail(parser, "--pipeline-model-parallel-size", f"--num-layers {args.num_layers} is "
              f"not divisible by {pp} stages; choose layers that split evenly")
    if args.snake_offload and args.snake_checkpoint_interval > args.num_layers // pp:
        _fail(parser, "--snake-checkpoint-interval", f"{args.snake_checkpoint_interval} layers "
              f"per unit is more than the {args.num_layers // pp} layers of a pipeline stage; "
              f"use at most {args.num_layers // pp} (one unit per stage)")
    if args.snake_group_size is not None:
        if not args.snake_offload:
            _fail(parser, "--snake-group-size", "applies to the vertical schedule; add "
                  "--snake-offload or drop the flag")
        if args.snake_schedule == "horizontal":
            _fail(parser, "--snake-group-size", "the horizontal schedule runs micro-batch by "
                  "micro-batch; drop --snake-group-size or use --snake-schedule vertical")
        _check(parser, snake_groups, args.num_microbatches, args.snake_group_size)
    elif args.snake_offload:
        args.snake_group_size = default_group_size(args.num_microbatches, pp)
    if args.snake_offload and args.sequence_parallel:
        _fail(parser, "--sequence-parallel", "is not supported with --snake-offload yet: the "
              "offloaded optimizer does not all-reduce the sequence-parallel layer-norm "
              "gradients across tensor-parallel ranks; drop one of the two flags")
    if args.snake_activation_offload and not args.snake_offload and pp > 1:
        _fail(parser, "--snake-activation-offload", "without --snake-offload wraps Megatron's "
              "no-pipelining schedule; with --pipeline-model-parallel-size > 1 add "
              "--snake-offload (offload inside each unit's recompute) or drop it")
    if args.snake_offload and pp > 1:
        if args.snake_schedule == "horizontal":
            _fail(parser, "--snake-schedule", "horizontal is a one-stage ablation; use "
                  "vertical with --pipeline-model-parallel-size > 1")


def parse_args(argv=None, world_size: int | None = None) -> argparse.Namespace:
    """``world_size``: the ranks the flags are for (default torchrun's WORLD_SIZE, or 1);
    the planner passes the world it plans."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.snake_auto:
        given = sys.argv[1:] if argv is None else argv
        for flag in AUTO_CHOSEN_FLAGS:
            if any(a == flag or a.startswith(flag + "=") for a in given):
                _fail(parser, flag, "is chosen by --snake-auto; drop one of the two")
    validate_args(args, parser, world_size)
    return args


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None,
                  world_size: int | None = None):
    """Fill derived defaults and reject inconsistent flags, naming the flag at fault."""
    parser = parser or build_parser()
    _validate_ranges(args, parser)
    planned_world = world_size
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.data_parallel_size = _check(
        parser, data_parallel_size, world_size,
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        _fail(parser, "--sequence-parallel", "needs --tensor-model-parallel-size > 1 "
              "(Megatron would silently drop it); remove the flag or raise TP")
    if args.sequence_parallel and args.transformer_impl != "transformer_engine":
        _fail(parser, "--sequence-parallel", "needs --transformer-impl transformer_engine: "
              "the local layer spec's torch norms do not support sequence parallelism")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        _fail(parser, "--global-batch-size",
              f"{args.global_batch_size} is not divisible by --micro-batch-size "
              f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} "
              f"(= {per_step}); choose a multiple of {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    _check(parser, check_checkpoint_interval, args.snake_checkpoint_interval)
    for flag in ("--snake-host-memory-limit", "--snake-gpu-memory-limit"):
        attr = flag[2:].replace("-", "_")
        if getattr(args, attr) is not None:
            try:
                setattr(args, attr, parse_size(getattr(args, attr)))
            except ValueError as exc:
                _fail(parser, flag, str(exc))
    if args.snake_offload or args.snake_activation_offload:   # the store's host pool
        # a world given by the caller is one being planned (tools/plan.py), perhaps for
        # another machine, whose memory is its hardware profile's, not this one's
        here = physical_memory_bytes() if planned_world is None else None
        _check(parser, lambda: check_host_memory_limit(args.snake_host_memory_limit,
                                                       physical_bytes=here))
    if args.snake_activation_tier is None:   # placed by the plan where there is one to make
        args.snake_activation_tier = "auto" if args.snake_offload and \
            args.snake_schedule == "vertical" else "nvme"
    if args.snake_activation_offload and not args.snake_offload and \
            args.snake_activation_tier == "device":
        _fail(parser, "--snake-activation-tier", "use host or nvme with "
              "--snake-activation-offload")
    if args.snake_activation_tier == "auto" and args.snake_schedule == "horizontal":
        _fail(parser, "--snake-activation-tier", "auto plans the vertical schedule's "
              "checkpoints; the horizontal ablation has none to plan: use host or nvme")
    if args.snake_activation_offload and not args.snake_offload and \
            args.snake_activation_tier == "auto":
        _fail(parser, "--snake-activation-tier", "auto applies to the vertical schedule's "
              "checkpoints (--snake-offload); use host or nvme with --snake-activation-offload")
    for flag, default in OFFLOAD_ONLY_DEFAULTS.items():  # nothing is silently ignored
        attr = flag[2:].replace("-", "_")
        if not args.snake_offload and getattr(args, attr) is not None:
            _fail(parser, flag, "configures --snake-offload's offloaded state; add "
                  "--snake-offload or drop the flag")
        if args.snake_offload and getattr(args, attr) is None:
            setattr(args, attr, default)
    if args.snake_dry_run and not args.snake_offload:
        _fail(parser, "--snake-dry-run", "estimates --snake-offload's run; add "
              "--snake-offload or drop the flag")
    _validate_io_engine(args, parser)
    _validate_trace(args, parser)
    _validate_tracking(args, parser)
    _validate_auto(args, parser)
    if args.snake_offload:
        _check(parser, check_alpha, args.snake_alpha)
    _validate_pipeline(args, parser)
    if args.bf16 and args.fp16:
        _fail(parser, "--bf16", "--bf16 and --fp16 are mutually exclusive")
    _validate_zenflow(args, parser)
    if args.hidden_size % args.num_attention_heads:
        _fail(parser, "--num-attention-heads", f"--hidden-size {args.hidden_size} is not "
              f"divisible by --num-attention-heads {args.num_attention_heads}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups:
        _fail(parser, "--num-query-groups", f"--num-attention-heads {args.num_attention_heads} "
              f"is not divisible by --num-query-groups {args.num_query_groups}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and \
            args.seq_length > args.max_position_embeddings:
        _fail(parser, "--max-position-embeddings", f"{args.max_position_embeddings} is smaller "
              f"than --seq-length {args.seq_length}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    warmup = args.lr_warmup_iters if args.lr_warmup_fraction is None \
        else int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_decay_iters < 1 or warmup >= args.lr_decay_iters:
        _fail(parser, "--lr-warmup-iters", f"warm-up ({warmup} iterations) must be shorter "
              f"than --lr-decay-iters ({args.lr_decay_iters}, default --train-iters)")
    if args.min_lr > args.lr:
        _fail(parser, "--min-lr", f"{args.min_lr} is larger than --lr {args.lr}")
    if args.lr_warmup_init > args.lr:
        _fail(parser, "--lr-warmup-init", f"{args.lr_warmup_init} is larger than --lr {args.lr}")
    if args.fp16 and args.loss_scale is None and args.min_loss_scale > args.initial_loss_scale:
        _fail(parser, "--min-loss-scale", f"{args.min_loss_scale} is larger than "
              f"--initial-loss-scale {args.initial_loss_scale}")
    _validate_loading(args, parser)
    if args.save_interval is not None and args.save is None:
        _fail(parser, "--save-interval", "needs --save DIR")
    _validate_data(args, parser)
    _check(parser, lambda: build_tokenizer(**tokenizer_flags(args)))
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 \
        else torch.float32
    return args


def _validate_io_engine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--snake-io-engine needs a store to drive, and the native engines need their build."""
    if args.snake_io_engine == "auto":
        return
    if not (args.snake_offload or args.snake_activation_offload):
        _fail(parser, "--snake-io-engine", "configures the offload store; add --snake-offload "
              "or --snake-activation-offload, or drop the flag")
    from megatron_snake.storage.engine import native_available

    if args.snake_io_engine in ("uring", "threads") and not native_available():
        _fail(parser, "--snake-io-engine", f"{args.snake_io_engine} is a native engine and "
              "megatron_snake._snake_aio is not built here; install liburing-dev and a C "
              "compiler and reinstall (bash tools/install.sh), or use python")


def _validate_zenflow(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """ZenFlow's knobs need --snake-zenflow (a knob is never silently ignored) and build
    ``args.zenflow``, which checks their values; refuse what ZenFlow does not combine with."""
    given = {key: getattr(args, f"snake_zenflow_{key}") for key in ZENFLOW_DEFAULTS}
    given = {key: value for key, value in given.items() if value is not None}
    args.zenflow = None
    if not args.snake_zenflow:
        for key in given:
            _fail(parser, "--snake-zenflow-" + key.replace("_", "-"), "needs --snake-zenflow")
        return
    if args.snake_offload:
        _fail(parser, "--snake-zenflow", "cannot be combined with --snake-offload: ZenFlow "
              "keeps the working weights on the compute device (ZeRO-Offload style) while "
              "--snake-offload moves them unit by unit; drop one of the two flags")
    if args.fp16:
        _fail(parser, "--fp16", "--snake-zenflow has no loss scaler yet; use --bf16 or fp32")
    if args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1:
        _fail(parser, "--tensor-model-parallel-size", "--snake-zenflow supports data "
              "parallelism only (tensor and pipeline parallel size 1)")
    args.zenflow = _check(parser, lambda: ZenFlowSettings(**given))
