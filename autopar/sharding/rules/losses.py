"""Losses.  Cross-entropy shards its rows (Partial output: the lowering divides the
local sum by the global count of non-ignored targets) or its class dim (vocab-parallel
cross-entropy, replicated output: the lowering all-reduces max, sum-exp and the target
logit).  MSE shards any dim (Partial; mean rescaled by the lowering)."""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg, info
from autopar.plans.placement import P, R
from autopar.sharding.rules import AxisStrategy, RuleCtx, assign, ndim, register

aten = torch.ops.aten

# reduction enum of aten losses
NONE, MEAN, SUM = 0, 1, 2


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``cross_entropy_loss(input[N, C, ...], target, weight, reduction, ignore, smoothing)``
    with class-index targets ``[N, ...]`` or probability targets (floating, shaped like
    the input).  Rows split either; the class split (vocab-parallel) takes class
    indices only.  An unbatched input ``[C]`` has no row dim: its dim 0 is the classes.
    Class weights and label smoothing run replicated (their local forms would need the
    weights' sum over the rows, or the smoothing term over all classes)."""
    x, tgt = node.args[0], node.args[1]
    weight = arg(node, 2, "weight")
    reduction = arg(node, 3, "reduction", MEAN)
    smoothing = arg(node, 5, "label_smoothing", 0.0)
    if weight is not None or smoothing or ndim(x) < 2:
        return []
    soft = info(tgt).out.dtype.is_floating_point
    result = []
    if reduction != NONE:
        result.append(assign(node, [(x, Shard(0)), (tgt, Shard(0))], [P]))
        if ndim(x) == 2 and not soft:
            result.append(assign(node, [(x, Shard(1)), (tgt, R)], [R]))
    else:
        result.append(assign(node, [(x, Shard(0)), (tgt, Shard(0))], [Shard(0)]))
    return [s for s in result if s is not None]


def count_axes(node: fx.Node, placements, mesh_shape) -> tuple[int, ...]:
    """Mesh axes (of more than one rank) over which a mean cross-entropy whose input is
    placed ``placements`` sums its count of non-ignored targets (one all-reduce over
    the group spanning them, :mod:`autopar.passes.localize`); empty for other nodes and
    reductions.  The reduction is the op's fourth argument: ``torch.export`` writes
    ``(x, target, None, 1, ignore)`` positionally once a caller passes ``ignore_index``,
    where reading the third (the weight) missed the count."""
    if node.target is not aten.cross_entropy_loss.default or arg(node, 3, "reduction", MEAN) != MEAN:
        return ()
    return tuple(a for a, p in enumerate(placements)
                 if mesh_shape[a] > 1 and isinstance(p, Shard) and p.dim == 0)


@register(aten.mse_loss.default, aten.l1_loss.default)
def mse_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Elementwise loss then a reduction: any dim shards (both inputs alike)."""
    a, b = node.args[0], node.args[1]
    reduction = arg(node, 2, "reduction", MEAN)
    out = []
    for d in range(ndim(a)):
        s = assign(node, [(a, Shard(d)), (b, Shard(d))], [Shard(d) if reduction == NONE else P])
        if s is not None:
            out.append(s)
    return out
