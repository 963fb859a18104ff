"""Batch, group and instance norm over ``(N, C, *spatial)`` inputs.

batch norm: any dim except the channel shards, with the statistics all-reduced over
those ranks in training (SyncBatchNorm's semantics, :mod:`autopar.runtime.norms`);
the channels shard with the weight and bias (each channel's statistics are its own).
The running statistics are buffers, whole on every rank, updated in place by the local
form.  The placements do not depend on the ``training`` flag, which
``passes/train_mode.py`` flips after planning: every strategy is right in both modes.

group norm: the batch (statistics per sample) and the channels by whole groups (the
local op runs ``groups / n`` of them).  instance norm without running statistics: the
batch and the channels (statistics per sample and channel); with running statistics
(averaged over the batch) it stays replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg, info
from autopar.plans.placement import Placements, R
from autopar.runtime.norms import batch_norm as sync_batch_norm
from autopar.sharding.rules import AxisStrategy, OpStrategy, RuleCtx, assign, ndim, register

aten = torch.ops.aten


@register(aten.batch_norm.default)
def batch_norm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``batch_norm(x, w, b, running_mean, running_var, training, ...)``: every
    non-channel dim (statistics synced), or the channels (weight and bias alike)."""
    x, w, b, rm, rv = (arg(node, i, n) for i, n in enumerate(
        ("input", "weight", "bias", "running_mean", "running_var")))
    if ndim(x) < 2:  # no channel dim (aten takes a 1-D input): stays whole
        return []
    stats = [(rm, R), (rv, R)]
    result = [assign(node, [(x, Shard(d)), (w, R), (b, R), *stats], [Shard(d)])
              for d in range(ndim(x)) if d != 1]
    result.append(assign(node, [(x, Shard(1)), (w, Shard(0)), (b, Shard(0)), *stats], [Shard(1)]))
    return [s for s in result if s is not None]


def batch_norm_axes(xp: Placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(axes sharding a non-channel dim: statistics all-reduced over them, axes sharding
    the channels) of a batch norm whose input is placed ``xp``."""
    return (tuple(a for a, q in enumerate(xp) if isinstance(q, Shard) and q.dim != 1),
            tuple(a for a, q in enumerate(xp) if isinstance(q, Shard) and q.dim == 1))


def batch_norm_training(node: fx.Node) -> bool:
    """The captured ``training`` flag of a ``batch_norm`` node."""
    return bool(arg(node, 5, "training", True))


def localize_batch_norm(node: fx.Node, ins: Sequence[Placements], mesh: Sequence[int]) -> None:
    """Rewrite a sharded ``batch_norm`` node into :func:`autopar.runtime.norms.batch_norm`."""
    stat_axes, channel_axes = batch_norm_axes(ins[0])
    if not stat_axes and not channel_axes:
        return
    shape = info(node.args[0]).out.shape
    vals = [arg(node, i, n, dflt) for i, (n, dflt) in enumerate(
        (("input", None), ("weight", None), ("bias", None), ("running_mean", None),
         ("running_var", None), ("training", True), ("momentum", 0.1), ("eps", 1e-5)))]
    node.target = sync_batch_norm
    node.args = (*vals, stat_axes, channel_axes, math.prod(shape) // shape[1])
    node.kwargs = {}


def _group_split(node: fx.Node, s: OpStrategy, mesh_shape: Sequence[int]) -> bool:
    """Channels split only by whole groups."""
    n = math.prod(k for p, k in zip(s.inputs[0], mesh_shape) if p == Shard(1))
    return norm_groups(node) % n == 0


def norm_groups(node: fx.Node) -> int:
    """The number of groups of a ``group_norm`` / ``native_group_norm`` node."""
    if node.target is aten.native_group_norm.default:
        return int(node.args[6])
    return int(arg(node, 1, "num_groups"))


@register(aten.group_norm.default, aten.native_group_norm.default, mesh_check=_group_split)
def group_norm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """The batch (weight replicated) or the channels by whole groups (weight alike);
    ``native_group_norm``'s mean and rstd ``(N, groups)`` shard alike."""
    x = node.args[0]
    native = node.target is aten.native_group_norm.default
    w, b = (node.args[1], node.args[2]) if native else (arg(node, 2, "weight"), arg(node, 3, "bias"))
    extra = 2 if native else 0
    return [s for s in (
        assign(node, [(x, Shard(0)), (w, R), (b, R)], [Shard(0)] * (1 + extra)),
        assign(node, [(x, Shard(1)), (w, Shard(0)), (b, Shard(0))], [Shard(1)] * (1 + extra)),
    ) if s is not None]


def localize_group_norm(node: fx.Node, ins: Sequence[Placements], mesh: Sequence[int]) -> None:
    """A rank's group norm runs on its samples and its groups: ``num_groups`` (and
    ``native_group_norm``'s N and C) become local."""
    xp = ins[0]
    nb = math.prod(k for p, k in zip(xp, mesh) if p == Shard(0))
    nc = math.prod(k for p, k in zip(xp, mesh) if p == Shard(1))
    g = norm_groups(node) // nc
    if node.target is aten.native_group_norm.default:
        a = list(node.args)
        a[3], a[4], a[6] = a[3] // nb, a[4] // nc, g
        node.args = tuple(a)
    elif len(node.args) > 1:
        node.args = (node.args[0], g, *node.args[2:])
    else:
        node.kwargs = {**node.kwargs, "num_groups": g}


@register(aten.instance_norm.default)
def instance_norm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Without running statistics: the batch (weight replicated) or the channels."""
    x = node.args[0]
    if arg(node, 3, "running_mean") is not None or arg(node, 4, "running_var") is not None:
        return []
    w, b = arg(node, 1, "weight"), arg(node, 2, "bias")
    return [s for s in (
        assign(node, [(x, Shard(0)), (w, R), (b, R)], [Shard(0)]),
        assign(node, [(x, Shard(1)), (w, Shard(0)), (b, Shard(0))], [Shard(1)]),
    ) if s is not None]
