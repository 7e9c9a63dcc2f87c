"""Drive a Megatron-Core GPTModel unit by unit.

A *unit* is ``checkpoint_interval`` consecutive decoder layers (the last unit may be
shorter). The embedding is fused into unit 0 and the final norm, output layer and loss into
the last unit, so unit 0 recomputes from the tokens and the loss is computed where the
backward sweep starts. Every call below is the same Megatron module call, with the same
arguments, that ``GPTModel.forward`` and ``TransformerBlock.forward`` make: that is what
keeps the vertical schedule's numbers equal to Megatron's.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.utils import make_viewless_tensor

from megatron_snake.errors import FlagError


def unwrap_model(model):
    """Strip Megatron's DistributedDataParallel / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@dataclass
class MicroBatchContext:
    """Per-micro-batch inputs every unit needs (built once, shared by all units), and the
    loss function the forward step returned for it."""

    batch: dict
    rotary_pos_emb: torch.Tensor | None
    loss_func: Callable | None = None


def check_checkpoint_interval(checkpoint_interval) -> None:
    """``--snake-checkpoint-interval``: layers per unit, an integer >= 1 (the flag check
    and ``GPTUnits`` both call this)."""
    if not isinstance(checkpoint_interval, int) or checkpoint_interval < 1:
        raise FlagError("--snake-checkpoint-interval must be an integer >= 1 (layers per "
                        f"unit), got {checkpoint_interval!r}")


class GPTUnits:
    """The unit view of one GPTModel (one pipeline stage)."""

    def __init__(self, model, checkpoint_interval: int = 1):
        check_checkpoint_interval(checkpoint_interval)
        self.gpt = unwrap_model(model)
        config = self.gpt.config
        if getattr(config, "mtp_num_layers", None):
            raise NotImplementedError("megatron_snake: multi-token prediction is not supported")
        if getattr(config, "recompute_granularity", None) is not None:
            raise ValueError(
                "megatron_snake: the vertical schedule already recomputes each unit; "
                "do not combine --snake-offload with --recompute-granularity")
        self.config = config
        layers = list(self.gpt.decoder.layers)
        self.unit_layers = [layers[i:i + checkpoint_interval]
                            for i in range(0, len(layers), checkpoint_interval)] or [[]]
        self.checkpoint_interval = checkpoint_interval

    # --- structure ---------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return len(self.unit_layers)

    def owns_embedding(self, unit: int) -> bool:
        return unit == 0 and self.gpt.pre_process

    def owns_head(self, unit: int) -> bool:
        return unit == self.num_units - 1 and self.gpt.post_process

    def unit_modules(self, unit: int) -> list[torch.nn.Module]:
        """Modules whose parameters unit ``unit`` reads (tied weights appear in two units)."""
        mods: list[torch.nn.Module] = []
        if self.owns_embedding(unit):
            mods.append(self.gpt.embedding)
        mods.extend(self.unit_layers[unit])
        if self.owns_head(unit):
            if self.gpt.decoder.final_layernorm is not None:
                mods.append(self.gpt.decoder.final_layernorm)
            mods.append(self.gpt.output_layer)
        return mods

    def unit_parameters(self, unit: int) -> list[torch.nn.Parameter]:
        seen, params = set(), []
        for mod in self.unit_modules(unit):
            for p in mod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        if self.owns_head(unit) and self.gpt.share_embeddings_and_output_weights:
            w = self.gpt.shared_embedding_or_output_weight()
            if id(w) not in seen:
                params.append(w)
        return params

    # --- per-micro-batch context ---------------------------------------------------------
    def context(self, batch: dict, seq_length: int, loss_func=None) -> MicroBatchContext:
        """``batch``: the model's inputs (None where this stage gets none); ``seq_length``:
        the whole sequence (RoPE's length on every stage, as GPTModel computes it)."""
        rope = None
        if self.gpt.position_embedding_type == "rope":
            rope = self.gpt.rotary_pos_emb(seq_length)
        elif self.gpt.position_embedding_type not in ("learned_absolute", "none"):
            raise NotImplementedError(
                f"megatron_snake: position embedding {self.gpt.position_embedding_type!r} "
                "is not supported by the vertical schedule")
        return MicroBatchContext(batch=batch, rotary_pos_emb=rope, loss_func=loss_func)

    # --- compute -----------------------------------------------------------------------
    def forward_unit(self, unit: int, hidden: torch.Tensor | None, ctx: MicroBatchContext):
        """Run unit ``unit``. ``hidden`` is its input checkpoint (None for unit 0, which
        embeds the tokens). Returns the unit's output hidden state; for the last unit, the
        per-token loss ``[b, s]`` instead."""
        batch = ctx.batch
        if self.owns_embedding(unit):
            hidden = self.gpt.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])
            # TransformerBlock.forward makes its input viewless before the first layer.
            hidden = make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True)
        for layer in self.unit_layers[unit]:
            hidden, _context = layer(
                hidden_states=hidden,
                attention_mask=batch.get("attention_mask"),
                context=None,
                context_mask=None,
                rotary_pos_emb=ctx.rotary_pos_emb,
                rotary_pos_cos=None,
                rotary_pos_sin=None,
                rotary_pos_cos_sin=None,
                attention_bias=None,
                inference_context=None,
                packed_seq_params=None,
                sequence_len_offset=None,
                padding_mask=None,
            )
        if not self.owns_head(unit):
            return hidden
        return self._head_loss(hidden, batch)

    def _head_loss(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        final_norm = self.gpt.decoder.final_layernorm
        if final_norm is not None:
            hidden = final_norm(hidden)
            hidden = make_viewless_tensor(inp=hidden, requires_grad=True, keep_graph=True)
        output_weight = None
        if self.gpt.share_embeddings_and_output_weights:
            output_weight = self.gpt.shared_embedding_or_output_weight()
        logits, _ = self.gpt.output_layer(hidden, weight=output_weight, runtime_gather_output=None)
        return self.gpt.compute_language_model_loss(batch["labels"], logits)

    def autocast(self):
        """The autocast context Megatron's forward_step uses (when the config asks for it)."""
        if getattr(self.config, "enable_autocast", False):
            return torch.autocast("cuda", dtype=self.config.autocast_dtype)
        return nullcontext()
