"""Normalisations and softmax: shard any dim the op does not normalise over."""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg
from autopar.plans.placement import R, normalize_dim
from autopar.sharding.rules import AxisStrategy, RuleCtx, assign, ndim, register

aten = torch.ops.aten


@register(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``layer_norm(x, normalized_shape, w, b)``: the leading (batch) dims shard; the
    weight and bias stay replicated."""
    x = node.args[0]
    n = ndim(x)
    k = len(node.args[1])
    w = arg(node, 2, "weight")
    b = arg(node, 3, "bias") if node.target is aten.layer_norm.default else None
    result = []
    for d in range(n - k):
        s = assign(node, [(x, Shard(d)), (w, R), (b, R)], [Shard(d)])
        if s is not None:
            result.append(s)
    return result


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
          aten._log_softmax.default)
def softmax_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every dim except the softmax dim."""
    x = node.args[0]
    n = ndim(x)
    d = normalize_dim(node.args[1], n)
    return [s for i in range(n) if i != d
            for s in [assign(node, [(x, Shard(i))], [Shard(i)])] if s is not None]
