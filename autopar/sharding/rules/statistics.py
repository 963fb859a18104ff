"""Non-linear reductions over some dims: variance and standard deviation, log-sum-exp,
vector norms, and ``max``/``min`` along a dim (values and indices).

Every dim the op keeps shards (DTensor's strategies for these ops): each rank reduces
whole rows of its own piece.  A reduced dim shards only where a cheap local form
combines the ranks' pieces (:mod:`autopar.runtime.reductions`), the output then whole
over that axis: the 2-norm (an all-reduce of the sum of squares) and the variance and
standard deviation (two passes, each one all-reduce).  Log-sum-exp, the other norms
and ``max``/``min`` with indices gather a split reduced dim first.  None is linear: no
Partial passes.
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import info
from autopar.plans.placement import Placements, R, normalize_dim
from autopar.runtime.reductions import variance, vector_norm2
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


VARIANCES = {aten.var.correction, aten.var.dim, aten.var.default, aten.std.correction,
             aten.std.dim, aten.std.default, aten.var_mean.correction, aten.std_mean.correction}
ROOTED = {aten.std.correction, aten.std.dim, aten.std.default, aten.std_mean.correction}
WITH_MEAN = {aten.var_mean.correction, aten.std_mean.correction}
SPLIT_REDUCTIONS = VARIANCES | {aten.linalg_vector_norm.default}
"""The ops whose reduced dim may be split (see :func:`has_split_form`)."""


def has_split_form(node: fx.Node) -> bool:
    """Whether a reduced dim of ``node`` may be split (a local form combines it): the
    variances of real floats, and the 2-norm of real floats in their own dtype."""
    t, dtype = node.target, info(node.args[0]).out.dtype
    if not dtype.is_floating_point:
        return False
    if t in VARIANCES:
        return True
    a = bound_args(node) if t is aten.linalg_vector_norm.default else {}
    return bool(a) and a.get("ord") == 2 and a.get("dtype") is None


@register(*STATS)
def kept_dims_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every dim the op keeps shards the input and every output alike; with a local
    form (:func:`has_split_form`), a reduced dim too, the outputs whole."""
    x = node.args[0]
    red, keep = _reduced(node)
    nout = len(info(node).outputs)
    result, j = [], 0
    split = has_split_form(node)
    for i in range(ndim(x)):
        if i in red:
            j += keep
            s = assign(node, [(x, Shard(i))], [R] * nout) if split else None
        else:
            s = assign(node, [(x, Shard(i))], [Shard(j)] * nout)
            j += 1
        if s is not None:
            result.append(s)
    return result


def split_axes(node: fx.Node, x_placements: Placements) -> tuple[int, ...]:
    """The mesh axes that split a reduced dim of ``node``'s input."""
    red, _ = _reduced(node)
    return tuple(a for a, p in enumerate(x_placements) if isinstance(p, Shard) and p.dim in red)


def _correction(node: fx.Node) -> float:
    a = bound_args(node)
    if "correction" in a:
        return 1.0 if a["correction"] is None else float(a["correction"])
    return 1.0 if a.get("unbiased", True) else 0.0


def localize_statistics(node: fx.Node, x_placements: Placements) -> None:
    """Rewrite ``node`` to its local form when its input has a reduced dim split."""
    axes = split_axes(node, x_placements)
    if not axes:
        return
    x = node.args[0]
    red, keep = _reduced(node)
    t = node.target
    if t is aten.linalg_vector_norm.default:
        node.target, node.args = vector_norm2, (x, red, keep, axes)
    else:
        count = math.prod(info(x).out.shape[d] for d in red)
        args = (x, red, _correction(node), keep, axes, count, t in ROOTED, t in WITH_MEAN)
        node.target, node.args = variance, args
    node.kwargs = {}


def split_all_reduces(node: fx.Node) -> int:
    """All-reduces per split axis in the forward of the local form: the 2-norm sums
    once, the variance twice (the mean, then the squared deviations)."""
    return 2 if node.target in VARIANCES else 1
