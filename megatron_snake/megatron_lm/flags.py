"""The ``--snake-*`` flags in Megatron-LM's parser, and what ``--snake-offload`` does with
Megatron-LM's own flags.

The flags are this project's (``training.snake_args``: the same names, defaults and rules as
``examples/pretrain_gpt.py``). With ``--snake-offload``, each Megatron-LM flag either works,
is absorbed (it asks for something the snake does its own way: said once in the log), or is
refused with the reason and what to pass instead (docs/megatron_lm.md lists them all).
Without ``--snake-offload`` nothing of Megatron-LM's changes, and a ``--snake-*`` flag is
refused (it would be ignored).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from megatron_snake.optim.precision import check_precision_args
from megatron_snake.training.arguments import OneLineParser
from megatron_snake.training.snake_args import (add_snake_args, check_rule, fail,
                                                refuse_flags_snake_auto_chooses,
                                                validate_snake_args)


@dataclass(frozen=True)
class Refused:
    """A Megatron-LM flag --snake-offload refuses: ``given(args)`` says it is in use."""

    flag: str
    given: Callable[[argparse.Namespace], bool]
    reason: str


@dataclass(frozen=True)
class Absorbed:
    """A Megatron-LM flag --snake-offload accepts and does its own way: the attribute is
    turned off (Megatron-LM's loop would otherwise drive DDP machinery the snake does not
    use) and ``note`` is logged."""

    flag: str
    attr: str
    note: str


def _get(args, name, default=None):
    """A Megatron-LM flag's value (``validate_args`` deletes a few after using them)."""
    return getattr(args, name, default)


def _on(name):
    return lambda args: bool(_get(args, name))


REFUSED = (
    Refused("--recompute-granularity", lambda a: _get(a, "recompute_granularity") is not None
            or _get(a, "recompute_activations"), "the snake recomputes every unit from its "
            "input already (--snake-checkpoint-interval layers per unit); drop --recompute-*"),
    Refused("--num-layers-per-virtual-pipeline-stage",
            lambda a: _get(a, "num_layers_per_virtual_pipeline_stage") is not None
            or _get(a, "num_virtual_stages_per_pipeline_rank") is not None,
            "virtual pipeline stages are not run by the snake; --snake-group-size cuts "
            "the pipeline bubble instead"),
    Refused("--fp8-format", _on("fp8"), "FP8 is not supported with --snake-offload (a "
            "unit's recompute would update the FP8 scaling history twice); use --bf16"),
    Refused("--fp4-format", _on("fp4"), "FP4 is not supported with --snake-offload; use "
            "--bf16"),
    Refused("--context-parallel-size", lambda a: (_get(a, "context_parallel_size") or 1) > 1,
            "context parallelism is not supported with --snake-offload; use tensor or "
            "pipeline parallelism"),
    Refused("--num-experts", _on("num_experts"), "mixture-of-experts layers are not run "
            "by the snake yet"),
    Refused("--mtp-num-layers", _on("mtp_num_layers"), "multi-token prediction is not run "
            "by the snake"),
    Refused("--multi-latent-attention", _on("multi_latent_attention"), "multi-latent "
            "attention is not run by the snake yet"),
    Refused("--hybrid-override-pattern", _on("is_hybrid_model"), "the snake runs GPT "
            "models (pretrain_gpt.py), not hybrid ones"),
    Refused("--use-torch-fsdp2", _on("use_torch_fsdp2"), "FSDP shards the model another "
            "way; the snake offloads it unit by unit: drop one of the two"),
    Refused("--use-megatron-fsdp", _on("use_megatron_fsdp"), "FSDP shards the model another "
            "way; the snake offloads it unit by unit: drop one of the two"),
    Refused("--cuda-graph-impl", lambda a: _get(a, "cuda_graph_impl") not in (None, "none")
            or _get(a, "enable_cuda_graph") or _get(a, "external_cuda_graph"),
            "CUDA graphs capture a fixed schedule; the snake's is not one: drop the flag"),
    Refused("--tp-comm-overlap", _on("tp_comm_overlap"), "Transformer Engine's "
            "userbuffers overlap is not supported with --snake-offload"),
    Refused("--optimizer", lambda a: _get(a, "optimizer", "adam") != "adam",
            "the offloaded optimizer is AdamW (--optimizer adam, the default)"),
    Refused("--optimizer-cpu-offload", _on("optimizer_cpu_offload"), "--snake-offload "
            "already keeps the optimizer state off the GPU (--snake-optimizer-tier): drop "
            "--optimizer-cpu-offload"),
    Refused("--decoupled-lr", lambda a: _get(a, "decoupled_lr") is not None,
            "the offloaded AdamW has one learning rate for every parameter"),
    Refused("--calculate-per-token-loss", _on("calculate_per_token_loss"), "the offloaded "
            "AdamW does not divide the gradients by the step's token count (Megatron's "
            "finalize_model_grads does, which the store's gradients bypass): the gradients "
            "and the clipping would be off by that count; drop the flag"),
    Refused("--rampup-batch-size", _on("rampup_batch_size"), "the snake plans its groups "
            "for a fixed number of micro-batches per step; use a fixed --global-batch-size"),
    Refused("--train-samples", lambda a: _get(a, "train_samples") is not None,
            "give --train-iters (the snake's runs count iterations)"),
    Refused("--ckpt-format", lambda a: _get(a, "ckpt_format", "torch_dist") != "torch_dist",
            "--snake-offload saves Megatron's torch_dist format, one unit at a time (the "
            "torch format would gather the whole model): use --ckpt-format torch_dist"),
    Refused("--async-save", _on("async_save"), "the offloaded state is written unit by unit "
            "from the store while training waits; drop --async-save"),
    Refused("--non-persistent-save-interval", _on("non_persistent_save_interval"),
            "non-persistent checkpoints are not written with --snake-offload"),
    Refused("--log-params-norm", _on("log_params_norm"), "the parameters live in the "
            "store: the norm would read every unit at each log line"),
    Refused("--log-num-zeros-in-grad", _on("log_num_zeros_in_grad"), "the gradients live "
            "in the store and are not counted"),
    Refused("--check-weight-hash-across-dp-replicas-interval",
            _on("check_weight_hash_across_dp_replicas_interval"), "the weights live in the "
            "store, not in the model's parameters"),
    Refused("--save-wgrads-interval", lambda a: _get(a, "save_wgrads_interval") is not None
            or _get(a, "save_dgrads_interval") is not None, "the gradients live in the store"),
    Refused("--data-parallel-random-init", _on("data_parallel_random_init"),
            "every data-parallel rank starts from the same weights with --snake-offload"),
    Refused("--check-for-large-grads", _on("check_for_large_grads"), "Megatron checks for "
            "large gradients in its DDP gradient buffers, which --snake-offload does not build "
            "(each unit's gradients go to the store); drop the flag"),
    # Megatron-LM 0.17's
    Refused("--optimizer-cuda-graph", _on("optimizer_cuda_graph"), "the offloaded AdamW runs "
            "on the CPU, not in a CUDA graph; drop the flag"),
    Refused("--use-mup", _on("use_mup"), "MuP scales the learning rate per parameter; the "
            "offloaded AdamW has one learning rate for every parameter"),
    Refused("--ddp-param-name-patterns-for-fp32-local-accumulation",
            _on("ddp_param_name_patterns_for_fp32_local_accumulation"), "it configures "
            "Megatron's DDP gradient buffers, which --snake-offload does not build (the store "
            "accumulates every gradient in fp32); drop the flag"),
    # Megatron-LM 0.18's
    Refused("--save-params-interval", lambda a: _get(a, "save_params_interval") is not None,
            "the parameters live in the store, not in the model's"),
    Refused("--save-activations-interval",
            lambda a: _get(a, "save_activations_interval") is not None, "the snake runs the "
            "model unit by unit, recomputing each unit: its hooks would log the recompute too"),
    Refused("--step-batch-size-schedule",
            lambda a: _get(a, "step_batch_size_schedule") is not None, "the snake plans its "
            "groups for a fixed number of micro-batches per step; use a fixed "
            "--global-batch-size"),
    Refused("--verify-integrity", _on("verify_integrity"), "the plug-in writes and reads "
            "torch_dist checkpoints unit by unit, without Megatron-LM's hash manifest"),
    # Megatron-LM 0.19's
    Refused("--freeze-all-layers", _on("freeze_all_layers"), "the offloaded AdamW updates "
            "every parameter"),
    Refused("--logits-save-dir", lambda a: _get(a, "logits_save_dir") is not None,
            "its hooks are attached to the whole model, which the snake never holds"),
    Refused("--logits-load-dir", lambda a: _get(a, "logits_load_dir") is not None,
            "its hooks are attached to the whole model, which the snake never holds"),
    Refused("--override-ckpt-iteration", lambda a: _get(a, "override_ckpt_iteration") is not None,
            "the plug-in loads a checkpoint at the iteration it saved; drop the flag"),
    Refused("--tensor-parallel-num-weight-shards", lambda a: (_get(a, "gtp_weight_remat_size")
                                                             or 1) > 1,
            "weight sharding beyond tensor parallelism (GTP) is not run by the snake"),
)

# Megatron-LM's own checks of these are AssertionErrors (a traceback) in its validate_args,
# or before it: with --snake-offload they are said in one line first, as soon as the flags
# are parsed (parse_args). (given(args), flag, what to do)
BEFORE_MEGATRON_LM = (
    (lambda a: _get(a, "save") is not None and not (_get(a, "save_interval") or 0) > 0,
     "--save", "needs --save-interval N > 0 (the iterations between two saves)"),
    (_on("use_legacy_models"), "--use-legacy-models", "cannot be combined with --snake-offload: "
     "the snake runs Megatron-Core's GPTModel, not the legacy model; drop the flag"),
    (lambda a: _get(a, "ckpt_convert_format") is not None, "--ckpt-convert-format",
     "cannot be combined with --snake-offload: a conversion saves the whole model through "
     "Megatron-LM's own save; run it without --snake-offload"),
)

ABSORBED = (
    Absorbed("--use-distributed-optimizer", "use_distributed_optimizer", "the offloaded "
             "AdamW is sharded over the data-parallel ranks already"),
    Absorbed("--overlap-grad-reduce", "overlap_grad_reduce", "the snake reduces each unit's "
             "gradients as soon as they are final, while the next unit computes"),
    Absorbed("--overlap-param-gather", "overlap_param_gather", "each unit's weights are "
             "read ahead from the store while the unit before computes"),
)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the --snake-* flags."""
    return add_snake_args(parser)


def check_parsed(args: argparse.Namespace, prog: str) -> None:
    """Right after Megatron-LM's ``parse_args``, with --snake-offload: the refusals that
    Megatron-LM's own checks would make as tracebacks (``BEFORE_MEGATRON_LM``)."""
    if not getattr(args, "snake_offload", False):
        return
    parser = OneLineParser(prog=prog)
    for given, flag, what in BEFORE_MEGATRON_LM:
        if given(args):
            fail(parser, flag, what)


def check_args(args: argparse.Namespace, prog: str, argv: list[str]) -> list[str]:
    """After Megatron-LM's own ``validate_args``: refuse what --snake-offload does not run
    (or a --snake-* flag without it), absorb what it does its own way, and apply the
    --snake-* rules. Returns the notes to log."""
    parser = OneLineParser(prog=prog)
    given = [a.split("=")[0] for a in argv if a.startswith("--snake-")]
    if not args.snake_offload:
        if given:
            fail(parser, given[0], "configures --snake-offload; add --snake-offload or drop "
                 "the flag (without it Megatron-LM runs unchanged)")
        return []
    for rule in REFUSED:
        if rule.given(args):
            fail(parser, rule.flag, f"cannot be combined with --snake-offload: {rule.reason}")
    for flag in ("--snake-zenflow", "--snake-activation-offload"):
        if flag in given:
            fail(parser, flag, "is not available through the Megatron-LM plug-in yet; use "
                 "examples/pretrain_gpt.py, or drop the flag")
    notes = []
    for rule in ABSORBED:
        if getattr(args, rule.attr):
            setattr(args, rule.attr, False)
            notes.append(f"> {rule.flag} with --snake-offload: {rule.note}")
    if args.fp16 and not _get(args, "accumulate_allreduce_grads_in_fp32", True):
        args.accumulate_allreduce_grads_in_fp32 = True   # what the store's gradients do
        notes.append("> --fp16 with --snake-offload: gradients are accumulated and reduced in "
                     "fp32, as with --accumulate-allreduce-grads-in-fp32 (not in fp16 "
                     "buffers), so the loss scale may overflow, and iterations be skipped, "
                     "later than in a plain run")
    if args.transformer_impl == "transformer_engine" and not _transformer_engine_usable():
        fail(parser, "--transformer-impl", "transformer_engine (Megatron-LM's default) needs a "
             "GPU and Transformer Engine, which this machine lacks; pass --transformer-impl "
             "local (the layer spec of Megatron-Core's own modules)")
    if _get(args, "use_precision_aware_optimizer"):
        # Megatron-LM's flags, read by the offloaded AdamW (optim/precision.py) instead of
        # Transformer Engine's FusedAdam: the same rules, the dtypes Megatron-LM mapped
        check_rule(parser, check_precision_args, args)
        notes.append("> --use-precision-aware-optimizer with --snake-offload: the offloaded "
                     "AdamW stores each state in the dtype asked for and computes in fp32 "
                     "on the CPU (no Transformer Engine needed; docs/precision.md)")
    _derive(args)
    refuse_flags_snake_auto_chooses(args, parser, argv)
    validate_snake_args(args, parser)
    return notes


def _transformer_engine_usable() -> bool:
    """A GPU, and Transformer Engine as megatron-core imported it (without it megatron-core
    builds the TE layer spec anyway, and its first layer raises in the middle of the
    model's build)."""
    import torch
    from megatron.core.extensions import transformer_engine

    return torch.cuda.is_available() and bool(getattr(transformer_engine, "HAVE_TE", False))


def _derive(args: argparse.Namespace) -> None:
    """What this project's components read under names Megatron-LM's flags do not give."""
    per_step = args.micro_batch_size * args.data_parallel_size
    args.num_microbatches = args.global_batch_size // per_step   # Megatron-LM checked it
    args.disable_bias_linear = not args.add_bias_linear
    if not _get(args, "group_query_attention"):
        # Megatron-LM's --num-query-groups defaults to 1 and counts only with
        # --group-query-attention (the model then has one key/value group per head, and
        # Megatron-LM's own FLOPs count sets it so); the pre-flight and the planner read it.
        args.num_query_groups = args.num_attention_heads
