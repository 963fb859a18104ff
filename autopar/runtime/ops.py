"""Local forms of ops whose sharded version needs more than the plain op: the
vocabulary-parallel embedding and cross-entropy (Megatron's), and cross-entropy over
sharded rows whose mean divides by the global count of non-ignored targets."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.collectives import all_reduce, all_reduce_nograd_async
from autopar.runtime.mesh import current


def shard_offset(axes: tuple[int, ...], local: int) -> int:
    """Start index of this rank's chunk of a dim sharded over ``axes`` (in order)."""
    m = current()
    idx = 0
    for a in axes:
        idx = idx * m.shape[a] + m.coord[a]
    return idx * local


def vocab_embedding(weight: torch.Tensor, idx: torch.Tensor, axes: tuple[int, ...],
                    padding_idx: int = -1) -> torch.Tensor:
    """Embedding with the vocabulary (weight dim 0) sharded over ``axes``: look up the
    rows this rank owns, zeros elsewhere; the result is a Partial sum.  ``padding_idx``
    (global row, -1 for none, as aten takes it): the rank owning that row keeps its
    gradient zero, as ``nn.Embedding(padding_idx=...)`` does."""
    vl = weight.shape[0]
    off = shard_offset(axes, vl)
    mine = (idx >= off) & (idx < off + vl)
    local = torch.where(mine, idx - off, torch.zeros_like(idx))
    pad = padding_idx - off if 0 <= padding_idx - off < vl else -1
    return torch.ops.aten.embedding(weight, local, pad) * mine.unsqueeze(-1).to(weight.dtype)


def start_count(target: torch.Tensor, ignore_index: int, row_axes: tuple[int, ...]):
    """Start summing the count of targets that are not ``ignore_index`` over
    ``row_axes``; returns the function that waits for it (what :func:`cross_entropy`
    takes as ``count``).  Probability targets (floating, shaped like the input
    ``[rows, classes, ...]``) ignore nothing: the mean divides by the number of rows
    (times any trailing dims), not by the number of probabilities."""
    if target.is_floating_point():
        n = torch.tensor(target.numel() // target.shape[1], device=target.device)
    else:
        n = (target != ignore_index).sum()
    return all_reduce_nograd_async(n, row_axes)


def cross_entropy(x: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int,
                  row_axes: tuple[int, ...], class_axes: tuple[int, ...],
                  count=None) -> torch.Tensor:
    """Cross-entropy with rows sharded over ``row_axes`` and/or classes over ``class_axes``.

    Rows: the mean divides the local sum by the global count of non-ignored targets
    (output Partial over ``row_axes``); probability targets (floating) count every
    row.  Classes (``x`` is 2-D ``[rows, classes]``, class-index targets only):
    max, sum of exponentials and the target logit are all-reduced over ``class_axes``
    (output replicated there).  ``reduction`` uses aten's enum (0 none, 1 mean, 2 sum).
    ``count``: the wait of a :func:`start_count` issued earlier in the forward (the
    lowering starts it where the labels appear); else it starts here.
    """
    valid = target != ignore_index
    # the global count of targets is known before any of the work below: start its
    # all-reduce now (if not already) and wait at the division (mean only)
    if count is None and reduction == 1:
        count = start_count(target, ignore_index, row_axes)
    if class_axes:
        cl = x.shape[1]
        off = shard_offset(class_axes, cl)
        with torch.no_grad():
            m = x.max(dim=1).values
            for a in class_axes:
                g = current().group(a)
                torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=g)
        e = torch.exp(x - m.unsqueeze(1))
        s = e.sum(dim=1)
        mine = (target >= off) & (target < off + cl) & valid
        local_t = torch.where(mine, target - off, torch.zeros_like(target))
        picked = x.gather(1, local_t.unsqueeze(1)).squeeze(1) * mine.to(x.dtype)
        for a in class_axes:
            s = all_reduce(s, a)
            picked = all_reduce(picked, a)
        per_row = (torch.log(s) + m - picked) * valid.to(x.dtype)
    else:
        per_row = F.cross_entropy(x, target, ignore_index=ignore_index, reduction="none")
    if reduction == 0:
        return per_row
    total = per_row.sum()
    if reduction == 2:
        return total
    return total / count().to(total.dtype)
