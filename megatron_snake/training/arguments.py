"""The command line of this project's own entry point (``examples/pretrain_gpt.py``):
Megatron-LM's flags, with Megatron-LM's names and defaults, for what this loop runs, plus
the ``--snake-*`` flags (``snake_args``, shared with the Megatron-LM plug-in).

Model-shape flags default to a tiny GPT so that ``python examples/pretrain_gpt.py
--snake-offload`` runs a demo on any machine; every default is shown by ``--help``.

Each flag rule lives in one place. A rule about one component's value lives beside that
component (``check_alpha``, ``check_checkpoint_interval``, ``snake_groups``,
``ZenFlowSettings``, ``build_tokenizer``, ``data_parallel_size``) and ``validate_args`` calls
it, so the command line and a direct caller get the same message. Rules about how the
Megatron flags combine live here; those about the --snake-* flags in ``snake_args``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from megatron_snake.optim.adamw import check_clip_grad
from megatron_snake.training.distributed import data_parallel_size
from megatron_snake.training.snake_args import add_snake_args
from megatron_snake.training.snake_args import check_rule as _check
from megatron_snake.training.snake_args import fail as _fail
from megatron_snake.training.snake_args import (refuse_flags_snake_auto_chooses,
                                                validate_snake_args)
from megatron_snake.training.tokenizer import (add_tokenizer_args, build_tokenizer,
                                                 tokenizer_flags)
from megatron_snake.training.tracking import check_tracking_args

DEFAULT_SPLIT = "969, 30, 1"  # --split with --data-path unless given (Megatron-LM's)
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
PATHS = ("--save", "--load", "--pretrained-checkpoint", "--snake-offload-dir", "--snake-plan-json", "--data-cache-path",
         "--tensorboard-dir", "--wandb-save-dir")


class OneLineParser(argparse.ArgumentParser):
    """A refused flag is one line, ``prog: error: --flag: why``, without the usage dump
    argparse prints before it, and on one rank: every rank parses the same command line
    (torchrun's RANK; exit status 2 on all of them)."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
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

    add_snake_args(p)
    return p


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
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        _fail(parser, "--pipeline-model-parallel-size", f"--num-layers {args.num_layers} is "
              f"not divisible by {pp} stages; choose layers that split evenly")


def parse_args(argv=None, world_size: int | None = None) -> argparse.Namespace:
    """``world_size``: the ranks the flags are for (default torchrun's WORLD_SIZE, or 1);
    the planner passes the world it plans."""
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_flags_snake_auto_chooses(args, parser, sys.argv[1:] if argv is None else argv)
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
    _validate_pipeline(args, parser)
    _validate_tracking(args, parser)
    validate_snake_args(args, parser, planned=planned_world is not None)
    if args.bf16 and args.fp16:
        _fail(parser, "--bf16", "--bf16 and --fp16 are mutually exclusive")
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
