"""Scaled dot-product attention over ``[batch, heads, seq, head_dim]``: batch and
heads shard every operand alike (a mask broadcasts and follows where it has the dim)."""

from __future__ import annotations

import torch
from torch import fx

from autopar.placement import Placement, Shard
from autopar.rules import AxisStrategy, RuleCtx, arg, assign, register, shape

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Shard batch (dim 0) or heads (dim 1)."""
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    result = []
    for d in (0, 1):
        if shape(k)[d] != shape(q)[d]:
            continue  # grouped-query attention: k/v heads differ; keep replicated
        mapping: list[tuple[object, Placement]] = [(q, Shard(d)), (k, Shard(d)), (v, Shard(d))]
        if isinstance(mask, fx.Node):
            ms = shape(mask)
            off = 4 - len(ms)
            if d - off >= 0 and ms[d - off] == shape(q)[d]:
                mapping.append((mask, Shard(d - off)))
        s = assign(node, mapping, [Shard(d)])
        if s is not None:
            result.append(s)
    return result
