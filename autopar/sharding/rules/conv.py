"""Convolution and pooling on NCHW tensors.

conv2d shards the batch (weight replicated), the output channels (weight and bias
dim 0) or the input channels (a Partial sum, bias Partial so it is added once).
Pooling shards batch or channels.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.capture.ir import arg
from autopar.plan.placement import P, R, Shard
from autopar.sharding.rules import AxisStrategy, RuleCtx, assign, register

aten = torch.ops.aten


@register(aten.conv2d.default, aten.conv1d.default)
def conv_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Batch, output-channel and (groups == 1) input-channel sharding."""
    x, w = node.args[0], node.args[1]
    b = arg(node, 2, "bias")
    groups = arg(node, 6, "groups", 1)
    result = [
        assign(node, [(x, Shard(0)), (w, R), (b, R)], [Shard(0)]),
    ]
    if groups == 1:
        result.append(assign(node, [(x, R), (w, Shard(0)), (b, Shard(0))], [Shard(1)]))
        result.append(assign(node, [(x, Shard(1)), (w, Shard(1)), (b, P)], [P]))
    return [s for s in result if s is not None]


@register(aten.avg_pool2d.default, aten.max_pool2d.default, aten.adaptive_avg_pool2d.default,
          aten.avg_pool1d.default, aten.max_pool1d.default)
def pool_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Batch or channel dim; average pooling is linear, so Partial passes through."""
    x = node.args[0]
    result = [assign(node, [(x, Shard(d))], [Shard(d)]) for d in (0, 1)]
    if node.target in (aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
                       aten.avg_pool1d.default):
        result.append(assign(node, [(x, P)], [P]))
    return [s for s in result if s is not None]
