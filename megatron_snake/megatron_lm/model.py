"""The model in Megatron-LM's loop: built through the user's ``model_provider`` one layer at
a time into the store, and handed to the loop as one ``SnakeModelChunk``.

``streamed_builder`` makes what ``training.build.build_run`` builds with: it calls the
model provider the way Megatron-LM's ``get_model`` does, while Megatron-Core's
``TransformerBlock`` reports each decoder layer as soon as it is built (so its values go to
the store before the next is made, and the model is never whole in memory), then sets
Megatron-LM's tensor-parallel defaults on every parameter.

``SnakeModelChunk`` stands where Megatron-LM's loop expects its DDP-wrapped chunk: it has
what ``train_step``, ``train`` and ``evaluate`` call (``zero_grad_buffer``,
``force_all_reduce``, ``train``/``eval``, the ``config`` and attributes of the model through
``module``), and no full-size gradient buffers: the snake schedule accumulates each unit's
gradients in the store's per-unit buffers. The model is never called whole: the schedule
runs it unit by unit.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import transformer_block
from megatron.core.transformer.transformer_layer import BaseTransformerLayer

from megatron_snake.errors import UserError
from megatron_snake.training.extra_state import refuse_unsafe_extra_state


@contextlib.contextmanager
def _reporting_built_layers(on_built: Callable[[torch.nn.Module], None]):
    """Meanwhile ``TransformerBlock`` calls ``on_built(layer)`` with each decoder layer
    right after building it (through the ``build_module`` name its ``_build_layers``
    calls)."""
    build_module = transformer_block.build_module

    def reporting(spec, *args, **kwargs):
        module = build_module(spec, *args, **kwargs)
        if isinstance(module, BaseTransformerLayer):
            on_built(module)
        return module

    transformer_block.build_module = reporting
    try:
        yield
    finally:
        transformer_block.build_module = build_module


def provider_of(model_provider_func, cfg_container):
    """The model provider ``setup_model_and_optimizer`` was given; from 0.19, where it is
    given none (pretrain_gpt.py's own case), the one its config container's builder stands
    for: ``builder.build_model(pg_collection, pre_process, post_process)``, which its
    ``build_distributed_models`` calls for each stage. The builder's wrap hooks would run
    around that call, on the whole model: refused, never skipped."""
    if model_provider_func is not None:
        return model_provider_func
    model_config = getattr(cfg_container, "model", None)
    if model_config is None:
        raise UserError("--snake-offload: setup_model_and_optimizer was given neither a model "
                        "provider nor a config container with a model")
    for hooks in ("pre_wrap_hooks", "post_wrap_hooks"):
        if getattr(model_config, hooks, None):
            raise UserError(f"--snake-offload: the model config's {hooks} act on the whole "
                            "model, which the snake never holds; build the model without them")
    builder = model_config.get_builder_cls()(model_config)

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                 pg_collection=None):
        return builder.build_model(pg_collection, pre_process=pre_process,
                                   post_process=post_process, vp_stage=vp_stage)

    return provider


def streamed_builder(model_provider_func, model_type, device: torch.device):
    """``build_model(on_built)`` for ``build_run``: this pipeline stage's GPTModel from the
    user's model provider, as Megatron-LM's ``get_model`` calls it (without virtual
    stages), on ``device``."""
    def build(on_built):
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        with (_reporting_built_layers(on_built) if on_built else contextlib.nullcontext()):
            model = model_provider_func(
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
                config=None, pg_collection=pg_collection)
        model.model_type = model_type
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        refuse_unsafe_extra_state(model)   # TE's pickled FP8 metadata, checked before load
        if on_built is not None:
            on_built(model)
        return model.to(device)

    return build


class SnakeModelChunk(torch.nn.Module):
    """The one model chunk Megatron-LM's loop drives with --snake-offload (see the module
    docstring). ``module``: the GPTModel, or its Float16Module under bf16 / fp16."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.force_all_reduce = False   # Megatron-LM's train_step sets it on each chunk

    @property
    def config(self):
        return self.module.config

    def zero_grad_buffer(self) -> None:
        """Megatron's DDP zeroes its gradient buffers here; the snake's per-unit gradient
        buffers start at zero every step."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("--snake-offload: the model is run unit by unit by the snake "
                           "schedule (get_forward_backward_func), never called whole")

    def sharded_state_dict(self, *args, **kwargs):
        raise RuntimeError("--snake-offload: checkpoints are saved and loaded unit by unit "
                           "(megatron_snake.megatron_lm.checkpoints), not through the "
                           "model's sharded_state_dict")
