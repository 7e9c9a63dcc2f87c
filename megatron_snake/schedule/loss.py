"""pretrain_gpt's loss, reduced exactly the way Megatron-Core's schedule reduces it."""

from __future__ import annotations

import torch


def masked_loss_sum(per_token_loss: torch.Tensor, loss_mask: torch.Tensor):
    """Megatron-LM pretrain_gpt ``loss_func``: (sum of masked token losses, token count)."""
    losses = per_token_loss.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens


def scale_for_backward(loss: torch.Tensor, num_tokens: torch.Tensor, num_microbatches: int,
                       config) -> torch.Tensor:
    """What ``forward_step_calc_loss`` and ``backward_step`` make of the loss before
    ``backward``: the masked mean over the micro-batch, divided by the number of
    micro-batches (unless per-token loss is on), then the loss scale (fp16)."""
    output = loss
    if not getattr(config, "calculate_per_token_loss", False):
        output = output / torch.clamp(num_tokens, min=1)
        output = output / num_microbatches
    if getattr(config, "grad_scale_func", None) is not None:
        output = config.grad_scale_func(output)
    return output


def reported_loss(loss: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """The per-micro-batch loss a log line shows: masked mean of token losses, detached."""
    return (loss.detach() / torch.clamp(num_tokens, min=1)).float()
