"""pretrain_gpt's forward step and loss, and the per-micro-batch losses its reports give.

``pretrain_gpt_forward_step`` is Megatron-LM pretrain_gpt's ``forward_step`` over a data
iterator of batch dicts: every schedule here (Megatron's, and the snake's through
``forward_step``) runs it the way Megatron-LM's training loop runs the user's own.
"""

from __future__ import annotations

import torch


def masked_loss_sum(per_token_loss: torch.Tensor, loss_mask: torch.Tensor):
    """Megatron-LM pretrain_gpt ``loss_func``: (sum of masked token losses, token count)."""
    losses = per_token_loss.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens


def pretrain_gpt_forward_step(data_iterator, model):
    """Megatron-LM pretrain_gpt's ``forward_step``: the model's per-token loss, and a loss
    function returning (loss sum, token count, {"lm loss": [sum, count]})."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(output_tensor):
        loss, num_tokens = masked_loss_sum(output_tensor, batch["loss_mask"])
        report = torch.cat([loss.detach().view(1), num_tokens.view(1).to(loss.dtype)])
        return loss, num_tokens, {"lm loss": report}

    return output, loss_func


def microbatch_call(model, microbatches: list[dict]) -> dict:
    """The keyword arguments a ``forward_backward_func`` takes to run ``microbatches`` (a
    list of batch dicts, the same on every pipeline stage) with pretrain_gpt's forward
    step."""
    if not isinstance(microbatches, (list, tuple)) or not microbatches:
        raise ValueError("microbatches must be a non-empty list of batch dicts")
    batch, seq = microbatches[0]["tokens"].shape
    return dict(forward_step_func=pretrain_gpt_forward_step,
                data_iterator=iter(microbatches), model=model,
                num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=batch)


def report_losses(reports: list[dict], key: str = "lm loss") -> list[torch.Tensor]:
    """Each micro-batch's masked-mean loss from the (sum, count) its loss function
    reported."""
    return [(r[key][0] / r[key][1].clamp(min=1)).detach() for r in reports]
