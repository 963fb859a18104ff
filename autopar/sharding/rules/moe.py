"""Routing and indexing ops of mixture-of-experts layers: top-k, sort, one-hot,
gather, scatter-add, scatter-reduce and index-select; ``diff``, which also works along
one dim; and ``index`` with every dim indexed.

Each of them works along one dim (``dim``: where it selects, sorts or scatters) and
acts row by row on every other dim, so any other dim shards alike on every tensor
and the local op computes exactly the rows of the global one; index *values* refer
only to positions along ``dim``, which stays whole.  A dim shards only where every
operand has the output's full size on it (an index may be smaller than its source;
chunks of unequal-sized dims would not line up).  Partial passes through the ops
linear in a float input when the index stays replicated (gather, index-select,
scatter-add of a Partial base and a Partial source).  None needs a local form.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.capture.ir import arg, info
from autopar.plans.placement import P, R, normalize_dim
from autopar.sharding.rules import (
    AxisStrategy,
    RuleCtx,
    assign,
    ndim,
    pointwise_axis,
    register,
    shape,
)

aten = torch.ops.aten


def _rowwise(node: fx.Node, tensors: list[object], dim: int) -> list[AxisStrategy]:
    """``Shard(d)`` on every tensor and every output for each ``d != dim`` on which all
    of them have the output's size."""
    outs = info(node).outputs
    result = []
    for d in range(outs[0].ndim):
        if d == dim:
            continue
        size = outs[0].shape[d]
        xs = [x for x in tensors if isinstance(x, fx.Node)]
        if any(ndim(x) != outs[0].ndim or shape(x)[d] != size for x in xs):
            continue
        s = assign(node, [(x, Shard(d)) for x in xs], [Shard(d)] * len(outs))
        if s is not None:
            result.append(s)
    return result


@register(aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default,
          aten.argsort.stable)
def select_along_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``topk``/``sort``/``argsort`` along ``dim``: every other dim shards (values and
    indices alike); not linear, so no Partial."""
    x = node.args[0]
    n = ndim(x)
    t = node.target
    if t is aten.topk.default:
        d = arg(node, 2, "dim", -1)
    elif t in (aten.sort.stable, aten.argsort.stable):
        d = node.kwargs.get("dim", -1)
    else:
        d = arg(node, 1, "dim", -1)
    return _rowwise(node, [x], normalize_dim(d, n))


@register(aten.one_hot.default)
def one_hot_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``one_hot(idx, classes)`` is pointwise on idx's dims (the class dim is new and
    stays whole).  ``classes=-1`` reads the global maximum: not shardable."""
    x = node.args[0]
    if arg(node, 1, "num_classes", -1) <= 0:
        return []
    return [s for d in range(ndim(x)) for s in [assign(node, [(x, Shard(d))], [Shard(d)])]
            if s is not None]


@register(aten.gather.default)
def gather_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``gather(x, dim, index)``: rows other than ``dim`` shard x, index and output
    alike; linear in x (x Partial, index replicated)."""
    x, index = node.args[0], node.args[2]
    d = normalize_dim(node.args[1], ndim(x))
    result = _rowwise(node, [x, index], d)
    s = assign(node, [(x, P), (index, R)], [P])
    return [*result, *([s] if s is not None else [])]


@register(aten.scatter_add.default)
def scatter_add_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``scatter_add(base, dim, index, src)``: rows other than ``dim`` shard all three
    and the output alike; linear in (base, src) together (both Partial, index
    replicated: each rank scatters its summand, and the sums add up)."""
    base, index, src = node.args[0], node.args[2], node.args[3]
    d = normalize_dim(node.args[1], ndim(base))
    result = _rowwise(node, [base, index, src], d)
    mapping: list[tuple[object, Placement]] = [(base, P), (src, P), (index, R)]
    s = assign(node, mapping, [P])
    return [*result, *([s] if s is not None else [])]


@register(aten.scatter_reduce.two)
def scatter_reduce_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``scatter_reduce(base, dim, index, src, reduce)``: rows other than ``dim`` shard
    all three and the output alike.  ``sum`` (and ``mean`` of floats: the count per
    target depends on the index alone) is linear in (base, src) together, as for
    ``scatter_add``; ``prod``/``amax``/``amin`` are not."""
    base, index, src = node.args[0], node.args[2], node.args[3]
    d = normalize_dim(node.args[1], ndim(base))
    result = _rowwise(node, [base, index, src], d)
    reduce, dtype = node.args[4], info(node).out.dtype
    if (reduce == "sum" and dtype is not torch.bool) or (reduce == "mean" and dtype.is_floating_point):
        s = assign(node, [(base, P), (src, P), (index, R)], [P])
        result.extend([s] if s is not None else [])
    return result


@register(aten.index_select.default)
def index_select_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``index_select(x, dim, index)``: any other dim of x shards the output alike;
    the index (1-D) sharded gives the output sharded on ``dim`` (each rank picks its
    part of the rows from the whole x); linear in x."""
    x, index = node.args[0], node.args[2]
    n = ndim(x)
    d = normalize_dim(node.args[1], n)
    result = [assign(node, [(x, Shard(i)), (index, R)], [Shard(i)]) for i in range(n) if i != d]
    result.append(assign(node, [(x, R), (index, Shard(0))], [Shard(d)]))
    result.append(assign(node, [(x, P), (index, R)], [P]))
    return [s for s in result if s is not None]


@register(aten.diff.default)
def diff_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``diff`` along ``dim`` (Hugging Face masks compare neighbouring positions): every
    other dim shards, on the input and on ``prepend``/``append`` alike."""
    x = node.args[0]
    n = ndim(x)
    d = normalize_dim(arg(node, 2, "dim", -1), n)
    tensors = [x] + [t for t in (arg(node, 3, "prepend"), arg(node, 4, "append"))
                     if isinstance(t, fx.Node)]
    return _rowwise(node, tensors, d)


@register(aten.index.Tensor)
def index_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``x[i0, i1, ...]`` with every dim of ``x`` indexed by a tensor (Hugging Face's mask
    construction): the output has the indices' broadcast shape and each element depends
    on the indices at its position only, so the indices shard like a pointwise op's
    inputs while ``x`` stays whole (the index values are global positions).
    ``x[:, i1, ...]`` (a leading ``None``, every other dim indexed: the rows of a padding
    mask, :mod:`autopar.capture.batch_index`): x's dim 0 passes through as the output's
    dim 0 and shards alike, the indices whole.  Other forms have no rule."""
    x, idx = node.args[0], node.args[1]
    tensors = [i for i in idx if isinstance(i, fx.Node)]
    if len(idx) == ndim(x) and idx[0] is None and len(tensors) == len(idx) - 1:
        return [s for s in (assign(node, [(x, Shard(0)), *((i, R) for i in tensors)], [Shard(0)]),)
                if s is not None]
    if any(i is None for i in idx) or len(idx) != ndim(x):
        return []
    return pointwise_axis(node, tensors)
