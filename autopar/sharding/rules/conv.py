"""Convolution, pooling and upsampling: the layout comes from the input's rank.

A ``convNd`` takes ``(N, C, *spatial)`` or, unbatched, ``(C, *spatial)``; its weight is
``(C_out, C_in / groups, *kernel)``, so the input is batched exactly when it has as
many dims as the weight.  A pooling or upsampling op over ``k`` spatial dims treats
every dim before the last ``k`` as independent (batch and channel, or channel alone).

Spatial dims never shard: a window that crosses a shard boundary needs the
neighbour's rows (a halo exchange), which no local form here implements.

conv: the batch (weight replicated); the output channels (weight and bias dim 0; with
``groups > 1`` the input channels too, by whole groups, ``groups`` localized); the
input channels (``groups == 1``: a Partial sum, bias Partial so it is added once); and
Partial through the input or the weight (conv is linear in each, the bias Partial).
Average pooling and upsampling are linear, so Partial passes through them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg, info
from autopar.plans.placement import P, Placements, R
from autopar.sharding.rules import AxisStrategy, OpStrategy, RuleCtx, assign, ndim, register

aten = torch.ops.aten

CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
         aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)

# op -> number of trailing spatial dims it windows over
POOLS = {
    aten.avg_pool1d.default: 1, aten.max_pool1d.default: 1,
    aten.max_pool1d_with_indices.default: 1, aten.adaptive_avg_pool1d.default: 1,
    aten.adaptive_max_pool1d.default: 1,
    aten.avg_pool2d.default: 2, aten.max_pool2d.default: 2,
    aten.max_pool2d_with_indices.default: 2, aten.adaptive_avg_pool2d.default: 2,
    aten.adaptive_max_pool2d.default: 2,
    aten.avg_pool3d.default: 3, aten.max_pool3d.default: 3,
    aten.adaptive_avg_pool3d.default: 3,
}
LINEAR_POOLS = {aten.avg_pool1d.default, aten.adaptive_avg_pool1d.default,
                aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
                aten.avg_pool3d.default, aten.adaptive_avg_pool3d.default}

# upsampling (every mode F.interpolate lowers to is linear in the input)
UPSAMPLES = {
    aten.upsample_nearest1d.vec: 1, aten.upsample_nearest1d.default: 1,
    aten.upsample_linear1d.vec: 1, aten.upsample_linear1d.default: 1,
    aten._upsample_nearest_exact1d.vec: 1, aten._upsample_nearest_exact1d.default: 1,
    aten.upsample_nearest2d.vec: 2, aten.upsample_nearest2d.default: 2,
    aten.upsample_bilinear2d.vec: 2, aten.upsample_bilinear2d.default: 2,
    aten.upsample_bicubic2d.vec: 2, aten.upsample_bicubic2d.default: 2,
    aten._upsample_nearest_exact2d.vec: 2, aten._upsample_nearest_exact2d.default: 2,
    aten.upsample_nearest3d.vec: 3, aten.upsample_nearest3d.default: 3,
    aten.upsample_trilinear3d.vec: 3, aten.upsample_trilinear3d.default: 3,
}


def conv_channel_dim(node: fx.Node) -> int:
    """The channel dim of a conv's input and output: 1 when batched, 0 unbatched."""
    return ndim(node.args[0]) - (ndim(node.args[1]) - 1)


def conv_groups(node: fx.Node) -> int:
    """The ``groups`` argument of a conv node."""
    return int(arg(node, 6, "groups", 1))


def _out_channel_split(w: Placements, mesh_shape: Sequence[int]) -> int:
    """How many ranks share a conv's output channels when its weight is placed ``w``."""
    return math.prod(n for p, n in zip(w, mesh_shape) if isinstance(p, Shard) and p.dim == 0)


def _whole_groups(node: fx.Node, s: OpStrategy, mesh_shape: Sequence[int]) -> bool:
    """A grouped conv's channels split only by whole groups (each rank convolves
    ``groups / n`` of them with the localized ``groups``)."""
    g = conv_groups(node)
    return g == 1 or g % _out_channel_split(s.inputs[1], mesh_shape) == 0


@register(*CONVS, mesh_check=_whole_groups)
def conv_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Batch, output-channel, input-channel (``groups == 1``) and Partial strategies."""
    x, w = node.args[0], node.args[1]
    b = arg(node, 2, "bias")
    c = conv_channel_dim(node)
    result = []
    if c == 1:
        result.append(assign(node, [(x, Shard(0)), (w, R), (b, R)], [Shard(0)]))
    if conv_groups(node) == 1:
        result.append(assign(node, [(x, R), (w, Shard(0)), (b, Shard(0))], [Shard(c)]))
        result.append(assign(node, [(x, Shard(c)), (w, Shard(1)), (b, P)], [P]))
    else:
        result.append(assign(node, [(x, Shard(c)), (w, Shard(0)), (b, Shard(0))], [Shard(c)]))
    result.append(assign(node, [(x, P), (w, R), (b, P)], [P]))
    result.append(assign(node, [(x, R), (w, P), (b, P)], [P]))
    return [s for s in result if s is not None]


def local_groups(node: fx.Node, ins: Sequence[Placements], mesh: Sequence[int]) -> int:
    """The ``groups`` a rank's conv runs with: the global groups over the ranks that
    share the output channels (the registry's mesh check keeps this whole)."""
    return conv_groups(node) // _out_channel_split(ins[1], mesh)


@register(*POOLS)
def pool_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every dim before the spatial ones (batch and channel, or channel unbatched);
    average pooling of floats is linear, so Partial passes through.  Max pooling's indices
    count within each (batch, channel) plane, so they shard alike."""
    x = node.args[0]
    lead = ndim(x) - POOLS[node.target]
    nout = 2 if node.target in (aten.max_pool1d_with_indices.default,
                                aten.max_pool2d_with_indices.default,
                                aten.adaptive_max_pool1d.default,
                                aten.adaptive_max_pool2d.default) else 1
    result = [assign(node, [(x, Shard(d))], [Shard(d)] * nout) for d in range(lead)]
    # an integer average rounds each rank's part: not linear
    if node.target in LINEAR_POOLS and info(x).out.dtype.is_floating_point:
        result.append(assign(node, [(x, P)], [P]))
    return [s for s in result if s is not None]


@register(*UPSAMPLES)
def upsample_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Batch and channel dims (the output size names spatial dims only); every mode is
    a fixed weighted sum of input pixels, so Partial passes through."""
    x = node.args[0]
    lead = ndim(x) - UPSAMPLES[node.target]
    result = [assign(node, [(x, Shard(d))], [Shard(d)]) for d in range(lead)]
    result.append(assign(node, [(x, P)], [P]))
    return [s for s in result if s is not None]
