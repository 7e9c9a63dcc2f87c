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
import importlib.util
import math
import os
import sys
import textwrap

import torch

from megatron_snake.optim.adamw import check_clip_grad
from megatron_snake.optim.precision import check_precision_args, map_precision_args
from megatron_snake.training.distributed import data_parallel_size
from megatron_snake.training.optimizer import check_cpu_offload_device
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
FRACTIONS = ("--hidden-dropout", "--attention-dropout", "--lr-warmup-fraction",
             "--optimizer-offload-fraction")
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


class OneLineHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default once: argparse's ``(default: X)`` follows the
    help unless the help says its default itself (it contains the word "default": a None
    that means something, e.g. "default: 4 x --hidden-size", or a --snake-* flag, whose help
    must show its default in Megatron-LM's parser too), or the default says nothing (None,
    or a switch: a flag that takes no value)."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if "default" in help_text.lower() or action.nargs == 0 or action.default is None \
                or action.default is argparse.SUPPRESS:
            return help_text
        return help_text + " (default: %(default)s)"

    def _split_lines(self, text, width):
        """Wrapped at spaces only: a flag name such as --snake-offload-dir stays whole."""
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="pretrain_gpt.py",
        usage="%(prog)s [-h] [FLAG ...]",
        description="Pretrain a Megatron-Core GPT with Megatron-LM's flags; --snake-offload "
                    "trains it with megatron_snake's vertical schedule.",
        epilog="docs/usage.md explains each flag.",
        formatter_class=OneLineHelpFormatter,
        allow_abbrev=False)

    g = p.add_argument_group("model (defaults: a tiny demo GPT)")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=128, help="transformer hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size (default: 4 x --hidden-size)")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head dimension (default: --hidden-size / heads)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention, with --num-query-groups")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="query groups with --group-query-attention")
    g.add_argument("--seq-length", type=int, default=128, help="sequence length in tokens")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="position embedding size (default: --seq-length)")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"], help="position embedding")
    g.add_argument("--rotary-base", type=int, default=10000, help="base of the RoPE frequencies")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="share of head dimensions RoPE rotates")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="output layer with its own weights, not the embedding's")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="dropout probability of the hidden state")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="dropout probability after attention")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                   help="normalization layers")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of the norms")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP instead of GeLU")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no bias in the linear layers")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal weight init")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of it")
    g.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="layer spec; transformer_engine needs Transformer Engine (a GPU)")

    g = p.add_argument_group("batch and training")
    g.add_argument("--micro-batch-size", type=int, default=2,
                   help="samples per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=8,
                   help="samples per iteration over all ranks")
    g.add_argument("--train-iters", type=int, default=20, help="iterations to train")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (and --save) at an iteration divisible by this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM: finish the step, save (--save), exit 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (and --save) after this many minutes")
    g.add_argument("--seed", type=int, default=1234, help="random seed")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="go on when the loss or grad norm is NaN or Inf")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="torch.use_deterministic_algorithms(True)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="compute device; auto: a GPU if any")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel size (ranks per layer)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages the layers are split into")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="a collective waiting longer fails")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms and dropout along the sequence (TP > 1)")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam"],
                   help="AdamW (Megatron's adam)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate the decay ends at")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"],
                   help="learning-rate decay after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations to decay over (default: --train-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="iterations of linear warm-up")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate the warm-up starts at")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the gradient norm to this; 0: off")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    # Megatron-LM's distributed optimizer and optimizer CPU offload (names and defaults of
    # its core_v0.16.1 arguments.py), for the run without --snake-offload
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's optimizer state sharded over the data-parallel ranks")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="Megatron's optimizer state and update on the host (a GPU run)")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="share of the state --optimizer-cpu-offload puts on the host")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="overlap the host update with its copies to and from the GPU")

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    g.add_argument("--fp16", action="store_true", help="fp16 mixed precision, loss-scaled")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static fp16 loss scale (default: dynamic scaling)")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32,
                   help="dynamic loss scale at the start")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="lowest dynamic loss scale")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="iterations before the loss scale grows")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="overflows before the loss scale shrinks")
    # Megatron-LM's precision-aware optimizer flags (names, choices and defaults of its
    # core_v0.16.1 arguments.py); the offloaded AdamW honours them (optim/precision.py)
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="store optimizer states in the dtypes below (--snake-offload, or "
                        "--optimizer-cpu-offload)")
    for flag, (choices, what) in {
            "--main-grads-dtype": (("fp32", "bf16"), "gradients' dtype for the update "
                                   "(bf16: with --bf16)"),
            "--main-params-dtype": (("fp32", "fp16"), "master weights' dtype "
                                    "(fp16: approximate)"),
            "--exp-avg-dtype": (("fp32", "fp16", "bf16", "fp8"), "Adam first moment's dtype "
                                "(not fp32: approximate)"),
            "--exp-avg-sq-dtype": (("fp32", "fp16", "bf16", "fp8"), "Adam second moment's "
                                   "dtype (not fp32: approximate)")}.items():
        g.add_argument(flag, default="fp32", choices=list(choices), help=what)

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="iterations per log line")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="iterations between validations")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="batches per validation and test")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write TensorBoard scalars here (needs tensorboard)")
    g.add_argument("--wandb-project", default=None,
                   help="log to this Weights & Biases project (needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run's name")
    g.add_argument("--wandb-save-dir", default=None,
                   help="wandb's files (default: <--save>/wandb, or ./wandb)")
    g.add_argument("--profile", action="store_true",
                   help="torch profiler trace into --tensorboard-dir")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="iterations done when profiling starts")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="iterations done when profiling stops")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="global ranks that profile (default: 0)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory checkpoints are saved in")
    g.add_argument("--load", default=None, help="directory to resume from")
    g.add_argument("--save-interval", type=int, default=None,
                   help="iterations between saves (default: at the end only)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="do not load the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG state")
    g.add_argument("--ckpt-format", default=None, choices=["torch", "torch_dist"],
                   help="--save's format (default: torch_dist; torch with --snake-zenflow)")
    g.add_argument("--no-save-optim", action="store_true",
                   help="do not save the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="do not save the RNG state")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="refuse a --load directory with no checkpoint")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration of --load, not the latest")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only, from iteration 0")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="weights loaded as --finetune while --load has none")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, take the LR schedule from the flags")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler",
                   help="on --load, keep the checkpoint's LR schedule")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic data (used when no data path is given)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="[weight] prefix ... of datasets split by --split")
    g.add_argument("--split", default=None,
                   help=f"train,valid,test weights (default: '{DEFAULT_SPLIT}' with --data-path)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"{split} datasets used whole, as --data-path gives them")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="mask the loss on end-of-document tokens")
    g.add_argument("--num-workers", type=int, default=2,
                   help="DataLoader worker processes (0: none)")
    g.add_argument("--data-cache-path", default=None,
                   help="dataset index caches (default: $MEGATRON_SNAKE_DATA_CACHE or "
                        "~/.cache/megatron_snake)")
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
    _validate_precision(args, parser)
    return args


def _validate_precision(args, parser) -> None:
    """Megatron-LM's precision-aware optimizer flags: Megatron-Core's rules
    (``check_precision_args``), then the dtype names become torch dtypes, as Megatron-LM's
    ``validate_args`` makes them. With --snake-offload the offloaded AdamW honours them;
    without it they are Megatron's optimizer's (``_validate_megatron_optimizer``)."""
    _check(parser, check_precision_args, args)
    _validate_megatron_optimizer(args, parser)
    map_precision_args(args)


def _validate_megatron_optimizer(args, parser) -> None:
    """The run without --snake-offload builds Megatron-Core's optimizer from these flags, so
    it takes Megatron-LM's rules (core_v0.16.1): --optimizer-cpu-offload needs
    --use-precision-aware-optimizer (Megatron-LM's validate_args), which needs the
    distributed optimizer (OptimizerConfig) and, without the offload, Transformer Engine's
    FusedAdam. Megatron-Core's hybrid optimizer keeps the master weights and moments in fp32
    on the host whatever the dtype flags say, so other dtypes are refused there rather than
    ignored; gradients in bf16 are its DDP's buffer (Megatron-LM's fp32 accumulation off).
    With --snake-offload the offloaded AdamW is Megatron's CPU offload's counterpart and
    is sharded over the data-parallel ranks already (--use-distributed-optimizer is
    accepted, as the Megatron-LM plug-in absorbs it)."""
    if args.snake_offload:
        for flag in ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"):
            if getattr(args, flag[2:].replace("-", "_")):
                _fail(parser, flag, "--snake-offload already keeps the optimizer state off "
                      "the GPU (--snake-optimizer-tier): drop the flag")
        return
    if args.snake_zenflow:
        for flag in ("--use-distributed-optimizer", "--optimizer-cpu-offload",
                     "--use-precision-aware-optimizer"):
            if getattr(args, flag[2:].replace("-", "_")):
                _fail(parser, flag, "configures Megatron's optimizer, which --snake-zenflow "
                      "replaces with its own split AdamW; drop one of the two")
    if args.overlap_cpu_optimizer_d2h_h2d and not args.optimizer_cpu_offload:
        _fail(parser, "--overlap-cpu-optimizer-d2h-h2d", "overlaps the copies of "
              "--optimizer-cpu-offload; add it or drop the flag")
    if args.optimizer_cpu_offload and not args.use_precision_aware_optimizer:
        _fail(parser, "--optimizer-cpu-offload", "Megatron-LM runs it only with "
              "--use-precision-aware-optimizer (its hybrid optimizer reuses that code path); "
              "add it")
    if args.use_precision_aware_optimizer and not args.use_distributed_optimizer:
        _fail(parser, "--use-precision-aware-optimizer", "Megatron-Core runs it only with its "
              "distributed optimizer; add --use-distributed-optimizer (or --snake-offload, "
              "whose offloaded AdamW honours it)")
    if args.use_precision_aware_optimizer and not args.optimizer_cpu_offload and \
            importlib.util.find_spec("transformer_engine") is None:
        _fail(parser, "--use-precision-aware-optimizer", "without --optimizer-cpu-offload "
              "Megatron-Core runs it with Transformer Engine's FusedAdam, which is not "
              "installed; add --optimizer-cpu-offload or --snake-offload (the offloaded AdamW "
              "honours it on the CPU), or drop it")
    if not args.optimizer_cpu_offload:
        return
    for flag in ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value != "fp32":
            _fail(parser, flag, f"{value} would be ignored: Megatron's --optimizer-cpu-offload "
                  "keeps the master weights and Adam's moments in fp32 on the host; drop the "
                  "flag, or use --snake-offload, which honours it")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    _check(parser, check_cpu_offload_device, "cuda" if cuda else "cpu")
