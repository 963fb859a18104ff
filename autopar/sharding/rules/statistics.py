"""Non-linear reductions over some dims: variance and standard deviation, log-sum-exp,
vector norms, and ``max``/``min`` along a dim (values and indices).

Only the dims the op keeps shard (DTensor's strategies for these ops, less its
Partial norm reductions): each rank reduces whole rows of its own piece.  A reduced
dim sharded would need a local form that combines the ranks' pieces (a two-pass
variance, an all-reduce of the sum of squares for the 2-norm); none is offered, so the
planner gathers such a dim before the op.  None is linear: no Partial passes.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.capture.ir import info
from autopar.plan.placement import Shard, normalize_dim
from autopar.sharding.rules import AxisStrategy, RuleCtx, assign, ndim, register

aten = torch.ops.aten

STATS = [
    aten.var.correction, aten.var.dim, aten.var.default, aten.std.correction, aten.std.dim,
    aten.std.default, aten.var_mean.correction, aten.std_mean.correction,
    aten.logsumexp.default, aten.linalg_vector_norm.default, aten.norm.Scalar,
    aten.norm.ScalarOpt_dim, aten.max.dim, aten.min.dim,
]


def bound_args(node: fx.Node) -> dict[str, object]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    out: dict[str, object] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _reduced(node: fx.Node) -> tuple[list[int], bool]:
    """(reduced dims, keepdim): ``dim`` None or empty reduces every dim (for all of
    these ops, logsumexp included)."""
    a = bound_args(node)
    n = ndim(node.args[0])
    dims = a.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    if not dims or not n:
        return list(range(n)), bool(a.get("keepdim", False))
    return sorted({normalize_dim(d, n) for d in dims}), bool(a.get("keepdim", False))


@register(*STATS)
def kept_dims_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every dim the op keeps shards the input and every output alike."""
    x = node.args[0]
    red, keep = _reduced(node)
    nout = len(info(node).outputs)
    result, j = [], 0
    for i in range(ndim(x)):
        if i in red:
            j += keep
            continue
        s = assign(node, [(x, Shard(i))], [Shard(j)] * nout)
        if s is not None:
            result.append(s)
        j += 1
    return result
