"""ZenFlow's choice of important gradient columns.

A 2-D weight is stored ``[out, in]`` (torch's and Megatron's layout: Linear weights, the
embedding ``[vocab, hidden]``). A *column* is one index along dim 1: every row's entry for
one input feature. Its score is the sum of ``|g|`` over the column, taken on the step's
gradient (the sum over the step's micro-batches, averaged over data-parallel ranks); the
``k = max(1, round(ratio * in))`` columns with the highest score are important. Parameters
that are not 2-D (biases, norm weights) are small and always important.

Columns (not single elements) are chosen because a column is one contiguous gather per row
and its optimizer state moves as a block; ZenFlow observes that the important columns stay
the same for many steps (temporal locality), which is why re-selecting every few hundred
steps is enough.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def num_selected(num_columns: int, ratio: float) -> int:
    """How many of ``num_columns`` columns a ratio keeps (at least one)."""
    return min(num_columns, max(1, int(round(ratio * num_columns))))


def column_scores(grad: torch.Tensor) -> torch.Tensor:
    """Per-column sum of |g| of a 2-D gradient ``[out, in]``: shape ``[in]``, fp32."""
    return grad.detach().float().abs().sum(dim=0)


def select_columns(grad: torch.Tensor, ratio: float, dp_group=None,
                   dp_size: int = 1) -> torch.Tensor:
    """Sorted indices (int64, on ``grad``'s device) of the important columns of ``grad``.

    Under data parallelism every rank's gradient is already the same all-reduced mean, but
    a tie or a different kernel could still pick different columns on different ranks, and
    then their weights would drift apart: the indices of the first rank of the group are
    broadcast so every rank updates the same columns.
    """
    k = num_selected(grad.shape[1], ratio)
    if k == grad.shape[1]:
        idx = torch.arange(k, device=grad.device)
    else:
        idx = torch.topk(column_scores(grad), k, sorted=False).indices.sort().values
    if dp_size > 1:
        dist.broadcast(idx, src=dist.get_global_rank(dp_group, 0), group=dp_group)
    return idx


def complement(idx: torch.Tensor, num_columns: int) -> torch.Tensor:
    """The columns not in ``idx``, sorted."""
    mask = torch.ones(num_columns, dtype=torch.bool, device=idx.device)
    mask[idx] = False
    return mask.nonzero().flatten()
