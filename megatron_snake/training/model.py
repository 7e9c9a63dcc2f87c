"""Build a Megatron-Core GPTModel (and its DDP wrapper) from the command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from megatron_snake.errors import FlagError
from megatron_snake.training.extra_state import refuse_unsafe_extra_state


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        deterministic_mode=args.deterministic_mode,
        # Fusions need CUDA kernels; the unfused paths are what runs on CPU.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def layer_spec(args: argparse.Namespace):
    if args.transformer_impl == "transformer_engine":
        if not torch.cuda.is_available():
            raise FlagError("--transformer-impl transformer_engine needs a GPU; use local")
        try:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec)
            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError as exc:
            raise FlagError("--transformer-impl transformer_engine: Transformer Engine is not "
                            f"installed ({exc}); pip install megatron_snake[gpu] or use local") \
                from exc
    return get_gpt_layer_local_spec(normalization=args.normalization)


def _calling_after_init(layer_spec, on_built: Callable[[torch.nn.Module], None]):
    """``layer_spec`` whose layer class calls ``on_built(layer)`` once Megatron has built
    and initialised the layer (a subclass: names, state-dict keys and RNG use unchanged)."""
    class Layer(layer_spec.module):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            on_built(self)

    Layer.__name__ = Layer.__qualname__ = layer_spec.module.__name__
    return dataclasses.replace(layer_spec, module=Layer)


def build_gpt_model(args: argparse.Namespace, vocab_size: int, device: torch.device, *,
                    on_built: Callable[[torch.nn.Module], None] | None = None) -> GPTModel:
    """Megatron's GPTModel for this pipeline stage, on ``device``. ``on_built(module)`` is
    called with each decoder layer as soon as it is built and then with the whole model:
    a caller that moves the values out of memory (leaving meta tensors) keeps the build
    to about one layer at a time."""
    config = transformer_config(args)
    spec = layer_spec(args)
    if on_built is not None:
        spec = _calling_after_init(spec, on_built)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    refuse_unsafe_extra_state(model)   # TE's pickled FP8 metadata, checked before TE loads it
    if on_built is not None:
        on_built(model)
    return model.to(device)


def wrap_ddp(model: GPTModel, *, grad_reduce_in_fp32: bool = True,
             use_distributed_optimizer: bool = False) -> DistributedDataParallel:
    """Megatron's DDP: gradients accumulate in ``param.main_grad`` buffers."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
