"""The planner's workload (megatron_snake/planner/workload.py) of pretrain_gpt.py's flags:
parameter counts per unit and stage as Megatron-Core builds them (preflight.py), FLOPs as
Megatron counts them, and the tiers resolved as the run resolves them."""

from __future__ import annotations

from megatron_snake.errors import FlagError
from megatron_snake.optim.precision import Precision
from megatron_snake.planner.workload import Stage, Workload, layer_flops_per_token
from megatron_snake.training import preflight
from megatron_snake.training.train_log import model_flops_per_iteration


def output_layer_flops(args, vocab_size: int) -> float:
    """Forward FLOPs of the output layer on one micro-batch (one tensor-parallel rank's
    share): its matmul, as Megatron counts it."""
    tokens = args.micro_batch_size * args.seq_length
    return 2 * args.hidden_size * vocab_size / args.tensor_model_parallel_size * tokens


def layer_flops_of(args) -> float:
    """Forward FLOPs of one decoder layer per token, on one tensor-parallel rank, for the
    flags' shape."""
    return layer_flops_per_token(
        hidden=args.hidden_size, heads=args.num_attention_heads,
        kv_channels=args.kv_channels or args.hidden_size // args.num_attention_heads,
        query_groups=args.num_query_groups or args.num_attention_heads,
        ffn=args.ffn_hidden_size, gated=args.swiglu, seq_length=args.seq_length,
        tp=args.tensor_model_parallel_size)


def workload_from_args(args, vocab_size: int) -> Workload:
    """The workload pretrain_gpt.py's validated ``args`` describe (``--snake-offload``)."""
    if not args.snake_offload:
        raise ValueError("the planner models --snake-offload runs: add --snake-offload")
    if args.snake_schedule != "vertical":
        raise FlagError("--snake-schedule horizontal is an ablation the planner does not "
                        "model: use the vertical schedule")
    if args.snake_activation_offload:
        raise FlagError("--snake-activation-offload: the planner does not model it yet; "
                        "plan without it")
    # --snake-param-tier / --snake-optimizer-tier auto resolve as the run resolves them
    tiers = preflight.estimate(args, vocab_size).tiers

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    per_token = layer_flops_of(args)
    tokens = args.micro_batch_size * args.seq_length
    head = output_layer_flops(args, vocab_size)
    layers = args.num_layers // pp
    interval = args.snake_checkpoint_interval
    stages = []
    for stage in range(pp):
        counts = preflight.gpt_parameter_counts(args, vocab_size, pp_rank=stage)
        unit_layers = tuple(min(interval, layers - s) for s in range(0, layers, interval))
        flops = [n * per_token * tokens for n in unit_layers]
        stages.append(Stage(tuple(counts.units), unit_layers, tuple(flops), counts.shared,
                            head_flops=head if stage == pp - 1 else 0.0))
    elem = 4 if not (args.bf16 or args.fp16) else 2
    precision = Precision.from_args(args)   # each optimizer state in its dtype
    return Workload(
        stages=tuple(stages), tp=tp, dp=args.data_parallel_size,
        micro_batches=args.num_microbatches, group_size=args.snake_group_size,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        hidden_size=args.hidden_size, heads=args.num_attention_heads, elem_bytes=elem, alpha=args.snake_alpha,
        update_in_forward=args.clip_grad > 0 or args.fp16,
        param_tier=tiers.params, optimizer_tier=tiers.optimizer,
        activation_tier=args.snake_activation_tier,
        host_pool_bytes=args.snake_host_memory_limit,
        model_flops=model_flops_per_iteration(args, vocab_size),
        global_batch=args.global_batch_size, sequence_parallel=args.sequence_parallel,
        optimizer_record_bytes=tuple(precision.nbytes(n) for n in
                                     ("master", "exp_avg", "exp_avg_sq", "grad")),
        update_reads_weights=precision.remainders,
        update_rate_share=precision.update_rate_share)
