"""Reductions: a kept dim keeps its shard; a reduced sharded dim leaves a Partial
sum (for ``mean`` the lowering scales the local mean by local/global count)."""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg, info
from autopar.plans.placement import P, normalize_dim
from autopar.sharding.rules import AxisStrategy, RuleCtx, assign, linear_cast, ndim, register

aten = torch.ops.aten

SUM_LIKE = [aten.sum.dim_IntList, aten.mean.dim, aten.sum.default, aten.mean.default]
MAX_LIKE = [aten.amax.default, aten.amin.default, aten.argmax.default, aten.argmin.default,
            aten.cumsum.default, aten.any.dim, aten.all.dim]


def reduced_dims(node: fx.Node) -> tuple[list[int], bool]:
    """(reduced dims, keepdim) of a reduction node (none for a 0-d input, which
    ``x.sum(0)`` and ``x.cumsum(-1)`` accept)."""
    n = ndim(node.args[0])
    t = node.target
    if t in (aten.sum.default, aten.mean.default):
        return list(range(n)), False
    if t is aten.cumsum.default:
        return [normalize_dim(node.args[1], n)] if n else [], True
    if n == 0:
        return [], bool(arg(node, 2, "keepdim", False))
    dims = arg(node, 1, "dim", None)
    if dims is None or dims == []:
        return list(range(n)), bool(arg(node, 2, "keepdim", False))
    if isinstance(dims, int):
        dims = [dims]
    return [normalize_dim(d, n) for d in dims], bool(arg(node, 2, "keepdim", False))


def _kept_map(n: int, red: list[int], keepdim: bool) -> dict[int, int]:
    out, j = {}, 0
    for i in range(n):
        if i in red:
            j += keepdim
            continue
        out[i] = j
        j += 1
    return out


@register(*SUM_LIKE)
def sum_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Sum/mean: kept dims shard through; reduced dims give Partial; Partial passes."""
    x = node.args[0]
    red, keep = reduced_dims(node)
    result = []
    for i, o in _kept_map(ndim(x), red, keep).items():
        s = assign(node, [(x, Shard(i))], [Shard(o)])
        if s is not None:
            result.append(s)
    for d in red:
        s = assign(node, [(x, Shard(d))], [P])
        if s is not None:
            result.append(s)
    # ``sum(x, dtype=torch.int64)`` of floats casts each element first: a Partial
    # input's pieces would be truncated one by one
    if linear_cast(info(x).out.dtype, info(node).out.dtype):
        s = assign(node, [(x, P)], [P])
        if s is not None:
            result.append(s)
    return result


@register(*MAX_LIKE)
def max_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Non-linear reductions: only kept dims shard."""
    x = node.args[0]
    red, keep = reduced_dims(node)
    nout = len(info(node).outputs)
    return [s for i, o in _kept_map(ndim(x), red, keep).items()
            for s in [assign(node, [(x, Shard(i))], [Shard(o)] * nout)] if s is not None]
