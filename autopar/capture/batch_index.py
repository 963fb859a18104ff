"""Indexing every row by its own number becomes a plain slice of the rows.

Hugging Face builds a padding mask from the user's ``attention_mask`` as
``mask[batch_idx, kv_idx]`` with ``batch_idx = arange(batch)`` shaped ``[batch, 1, 1, 1]``
(transformers' ``padding_mask_function`` under ``sdpa_mask``).  The index values are
global row numbers, so a plan that splits the batch had to gather the whole mask on
every rank and slice it back: a collective per step whose shape depends on every rank's
rows (ranks holding different rows or lengths under ``batch="local"`` could not run it).
``x[arange(B).view(B, 1, .., 1), i1, ...]`` equals ``x[:, i1', ...]`` (each ``i`` with its
leading dim of one dropped): the rows pass through as a sliced dim, which
:func:`autopar.sharding.rules.moe.index_rule` splits like any batch dim.

Only an index computed from no input, parameter or buffer (shapes and constants, the
same on every call) and equal to the row numbers is rewritten; the others, where every
index has a leading dim of one.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.capture.causal_mask import constant_ancestors, drop_unused, evaluate_constant

aten = torch.ops.aten


def _constant(node: fx.Node) -> torch.Tensor | None:
    """The value of ``node`` when it is computed from shapes and literals alone, on the
    CPU (:func:`~autopar.capture.causal_mask.evaluate_constant`), else ``None``."""
    nodes = constant_ancestors(node)
    return evaluate_constant(nodes) if nodes is not None else None


def _is_rows(v: object, batch: int, ndim: int) -> bool:
    return (isinstance(v, torch.Tensor) and v.device.type != "meta" and v.dim() == ndim
            and v.shape[0] == batch and v.numel() == batch
            and bool((v.reshape(-1) == torch.arange(batch, device=v.device)).all()))


def rows_as_slices(gm: fx.GraphModule) -> int:
    """Rewrite ``x[rows, i1, ..]`` as ``x[:, i1', ..]`` in place (see the module
    docstring); returns how many index ops changed (the caller recompiles)."""
    g = gm.graph
    changed = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.index.Tensor:
            continue
        x, idx = n.args[0], list(n.args[1])
        xv = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(xv, torch.Tensor) or len(idx) < 2 or not isinstance(idx[0], fx.Node) \
                or not all(isinstance(i, fx.Node) for i in idx[1:]):
            continue
        vals = [i.meta.get("val") for i in idx]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            continue
        k = vals[0].dim()
        batch = xv.shape[0]
        if not isinstance(batch, int) or any(v.dim() != k or v.shape[0] != 1 for v in vals[1:]):
            continue
        if not _is_rows(_constant(idx[0]), batch, k):
            continue
        rest = []
        with g.inserting_before(n):
            for i, v in zip(idx[1:], vals[1:]):
                s = g.call_function(aten.squeeze.dim, (i, 0))
                s.meta["val"] = v.squeeze(0)
                rest.append(s)
        n.args = (x, [None, *rest], *n.args[2:])
        changed += 1
        drop_unused(g, [idx[0]])
    return changed


__all__ = ["rows_as_slices"]
