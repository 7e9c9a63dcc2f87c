"""Command-line flags: Megatron-LM's names and defaults, plus the ``--snake-*`` flags.

Model-shape flags default to a tiny GPT so that ``python examples/pretrain_gpt.py
--snake-offload`` runs a demo on any machine; every default is shown by ``--help``.
"""

from __future__ import annotations

import argparse
import os

import torch

SNAKE_SCHEDULES = ("vertical", "horizontal")
SNAKE_TIERS = ("device", "host", "nvme")
ACTIVATION_TIERS = SNAKE_TIERS + ("auto",)


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
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="torch.use_deterministic_algorithms(True)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)

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
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic data (the default when --data-path is not given)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefixes, optionally weighted: [w1] p1 [w2] p2 ...")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset index caches go (shared by all ranks); default "
                        "$MEGATRON_SNAKE_DATA_CACHE or ~/.cache/megatron_snake")
    g.add_argument("--tokenizer-type", default="ByteTokenizer",
                   choices=["ByteTokenizer", "NullTokenizer"])
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size for NullTokenizer / mock data")

    g = p.add_argument_group("megatron_snake")
    g.add_argument("--snake-offload", action="store_true",
                   help="train with the vertical (snake) schedule over the tiered store")
    g.add_argument("--snake-checkpoint-interval", type=int, default=1,
                   help="layers per unit: the granularity of weight loading and recompute")
    g.add_argument("--snake-schedule", default="vertical",
                   help="micro-batch order over the store: vertical (unit-major, snake) or "
                        "horizontal (Megatron's micro-batch-major order, weights fetched per "
                        "micro-batch: for ablations)")
    g.add_argument("--snake-offload-dir", default=None,
                   help="existing directory for offloaded state (rank<N>/ is made below "
                        "it); default: a new temporary directory")
    g.add_argument("--snake-activation-tier", default="nvme", choices=ACTIVATION_TIERS,
                   help="where unit checkpoints live between the forward and backward sweeps; "
                        "auto: profile, then place each by a lifetime-aware plan")
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
    g.add_argument("--snake-param-tier", default="nvme", choices=SNAKE_TIERS[1:],
                   help="where unit working weights live between their uses")
    g.add_argument("--snake-optimizer-tier", default="nvme", choices=SNAKE_TIERS[1:],
                   help="where fp32 master weights and Adam moments live")
    g.add_argument("--snake-alpha", type=float, default=0.25,
                   help="fraction of each unit's optimizer update deferred from the backward "
                        "sweep to the next forward sweep (0 to 0.5); with --clip-grad the "
                        "whole update waits for the global norm and runs in the forward sweep")
    g.add_argument("--snake-gpu-memory-limit", default=None,
                   help="compute-device memory the offloaded run may use (e.g. 40GiB); checked "
                        "at start against the largest unit's working set (default: no check)")
    g.add_argument("--snake-host-memory-limit", default="2GiB",
                   help="hard limit of the host buffer pool (e.g. 4GiB)")
    return p


def _fail(parser: argparse.ArgumentParser, flag: str, message: str):
    parser.error(f"{flag}: {message}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_args(args, parser)
    return args


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None):
    """Fill derived defaults and reject inconsistent flags, naming the flag at fault."""
    parser = parser or build_parser()
    world = int(os.environ.get("WORLD_SIZE", 1))
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world % model_parallel:
        _fail(parser, "--tensor-model-parallel-size", f"world size {world} is not divisible by "
              f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size}")
    args.data_parallel_size = world // model_parallel
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.micro_batch_size < 1:
        _fail(parser, "--micro-batch-size", "must be >= 1")
    if args.global_batch_size % per_step:
        _fail(parser, "--global-batch-size",
              f"{args.global_batch_size} is not divisible by --micro-batch-size "
              f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} "
              f"(= {per_step}); choose a multiple of {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    if args.snake_checkpoint_interval < 1:
        _fail(parser, "--snake-checkpoint-interval",
              f"must be >= 1 (layers per unit), got {args.snake_checkpoint_interval}")
    if args.snake_schedule not in SNAKE_SCHEDULES:
        _fail(parser, "--snake-schedule", f"unknown value {args.snake_schedule!r}; "
              f"choose one of {', '.join(SNAKE_SCHEDULES)}")
    from megatron_snake.training.offload import parse_size

    for flag in ("--snake-host-memory-limit", "--snake-gpu-memory-limit"):
        attr = flag[2:].replace("-", "_")
        if getattr(args, attr) is not None:
            try:
                setattr(args, attr, parse_size(getattr(args, attr)))
            except argparse.ArgumentTypeError as exc:
                _fail(parser, flag, str(exc))
    if args.snake_activation_offload and not args.snake_offload and \
            args.snake_activation_tier == "device":
        _fail(parser, "--snake-activation-tier", "use host or nvme with "
              "--snake-activation-offload")
    if args.snake_activation_tier == "auto" and args.snake_profile_iters < 1:
        _fail(parser, "--snake-profile-iters", "must be >= 1 with --snake-activation-tier auto")
    if args.snake_activation_offload and not args.snake_offload and \
            args.snake_activation_tier == "auto":
        _fail(parser, "--snake-activation-tier", "auto applies to the vertical schedule's "
              "checkpoints (--snake-offload); use host or nvme with --snake-activation-offload")
    if not 0.0 <= args.snake_alpha <= 0.5:
        _fail(parser, "--snake-alpha", f"must be between 0 and 0.5, got {args.snake_alpha}")
    if args.snake_offload and args.pipeline_model_parallel_size > 1:
        _fail(parser, "--pipeline-model-parallel-size",
              "pipeline parallelism with --snake-offload is not supported yet; use 1")
    if args.bf16 and args.fp16:
        _fail(parser, "--bf16", "--bf16 and --fp16 are mutually exclusive")
    if args.num_layers < 1 or args.hidden_size < 1 or args.num_attention_heads < 1:
        _fail(parser, "--num-layers", "--num-layers, --hidden-size and --num-attention-heads "
              "must be >= 1")
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
    if args.load is not None and not os.path.isdir(args.load):
        _fail(parser, "--load", f"directory {args.load!r} does not exist; give the --save "
              "directory of an earlier run, or drop --load to start from scratch")
    if args.save_interval is not None and args.save is None:
        _fail(parser, "--save-interval", "needs --save DIR")
    if args.save_interval is not None and args.save_interval < 1:
        _fail(parser, "--save-interval", "must be >= 1")
    if args.data_path:
        args.mock_data = False
    else:
        args.mock_data = True
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        _fail(parser, "--vocab-size", "NullTokenizer needs --vocab-size")
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 \
        else torch.float32
    return args
