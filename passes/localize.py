"""Localize: rewrite ops whose local (per-rank) form differs from the global op.

Before: a graph whose edges already carry planned placements (after redistribution).
After: literal shape arguments are local sizes (``view(x, [8, 32, 64])`` on a batch
split in two becomes ``view(x, [4, 32, 64])``); means over sharded dims are rescaled
to Partial sums; vocabulary-sharded embeddings and cross-entropies call the
vocab-parallel forms in :mod:`autopar.runtime.ops`; row-sharded cross-entropy divides
by the global count of non-ignored targets; dropout draws the global mask and keeps
this rank's slice (:mod:`autopar.runtime.rng`); a 2-norm or variance over a split
dim all-reduces its sums (:mod:`autopar.runtime.reductions`); attention with its
sequence split calls the row, Ulysses or ring form (:mod:`autopar.runtime.context`,
:func:`autopar.sharding.rules.attention.context_layout`).
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import info
from autopar.plans.data import Plan
from autopar.plans.decisions import applies
from autopar.plans.placement import Placements, fmt_placements, local_shape, parse_placements
from autopar.runtime import context as CP
from autopar.runtime import ops as O
from autopar.runtime.experts import MOE_EXPERTS
from autopar.runtime.ring_attention import ring_attention
from autopar.runtime.rng import sharded_dropout
from autopar.sharding.rules.attention import SDPA, CPImpl, context_layout, sdpa_args
from autopar.sharding.rules.channel_norms import localize_batch_norm, localize_group_norm
from autopar.sharding.rules.conv import CONVS, conv_groups, local_groups
from autopar.sharding.rules.moe_experts import localize_experts
from autopar.sharding.rules.reductions import reduced_dims
from autopar.sharding.rules.statistics import SPLIT_REDUCTIONS, localize_statistics

aten = torch.ops.aten

SHAPE_ARG_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                 aten.expand.default}
MEAN_OPS = {aten.mean.dim, aten.mean.default}
ELEMENTWISE_LOSSES = {aten.mse_loss.default, aten.l1_loss.default}
SCALED_FROM = "autopar_scaled_from"  # meta key: the planned node a rescale stands for


def _places(plan: Plan, node: fx.Node) -> tuple[list[Placements], list[Placements]]:
    np_ = plan.nodes[node.name]
    return ([parse_placements(p) for p in np_.in_placements],
            [parse_placements(p) for p in np_.out_placements])


def _scale_after(g: fx.Graph, node: fx.Node, factor: float) -> None:
    if factor == 1.0:
        return
    users = list(node.users)
    with g.inserting_after(node):
        y = g.call_function(aten.mul.Tensor, (node, factor))
    # the rescaled value stands for ``node`` from here on: same shapes and placement, so
    # later local forms (a mean of it) and the output's reduction (a Partial loss must
    # still be all-reduced) read ``node``'s annotation and plan entry through it
    y.meta.update({k: v for k, v in node.meta.items() if k in ("autopar", "val")})
    y.meta[SCALED_FROM] = node
    for u in users:
        u.replace_input_with(node, y)


@applies("context_parallel")
def localize(gm: fx.GraphModule, plan: Plan) -> None:
    """Rewrite ``gm`` in place (see the module docstring)."""
    g = gm.graph
    mesh = plan.mesh.shape
    for node in list(g.nodes):
        if node.op != "call_function" or node.name not in plan.nodes:
            continue
        t = node.target
        ins, outs = _places(plan, node)
        if t in SHAPE_ARG_OPS:
            local = list(local_shape(info(node).out.shape, outs[0], mesh))
            node.args = (node.args[0], local, *node.args[2:])
        elif t in MEAN_OPS:
            x = info(node.args[0]).out
            red, _ = reduced_dims(node)
            loc = local_shape(x.shape, ins[0], mesh)
            _scale_after(g, node, math.prod(loc[d] for d in red) / math.prod(x.shape[d] for d in red))
        elif t in ELEMENTWISE_LOSSES:
            reduction = node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)
            if reduction == 1:
                x = info(node.args[0]).out
                _scale_after(g, node, math.prod(local_shape(x.shape, ins[0], mesh)) / x.numel)
        elif t is aten.cross_entropy_loss.default:
            xp = ins[0]
            rows = tuple(a for a, p in enumerate(xp) if isinstance(p, Shard) and p.dim == 0)
            classes = tuple(a for a, p in enumerate(xp) if isinstance(p, Shard) and p.dim == 1)
            if rows or classes:
                reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
                ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
                node.target = O.cross_entropy
                node.args = (node.args[0], node.args[1], ignore, reduction, rows, classes)
                node.kwargs = {}
                # class indices only: probability targets count rows, not labels, and
                # a view of them may not keep the class dim the count divides out
                soft = info(node.args[1]).out.dtype.is_floating_point
                if rows and reduction == 1 and plan.decisions.pipeline_stages <= 1 and not soft:
                    node.args = (*node.args, _hoist_count(g, node.args[1], ignore, rows))
        elif t is aten.dropout.default:
            # the global mask, sliced: independent per batch shard, equal across
            # tensor-parallel peers, the single process's mask (autopar/runtime/rng.py)
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
            node.target = sharded_dropout
            node.args = (node.args[0], node.args[1], train, tuple(info(node).out.shape),
                         fmt_placements(ins[0]))
            node.kwargs = {}
        elif t is aten.embedding.default:
            vocab = tuple(a for a, p in enumerate(ins[0]) if isinstance(p, Shard) and p.dim == 0)
            if vocab:
                pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
                node.target = O.vocab_embedding
                node.args = (node.args[0], node.args[1], vocab, pad)
                node.kwargs = {}
        elif t is SDPA:
            _localize_attention(node, ins, mesh)
        elif t is MOE_EXPERTS:  # routed experts: expert parallel / Partial local forms
            localize_experts(node, ins, mesh)
        elif t in SPLIT_REDUCTIONS:  # norm / variance over a split dim: all-reduced sums
            localize_statistics(node, ins[0])
        elif t in CONVS and conv_groups(node) > 1:  # channels split by whole groups
            _set_arg(node, 6, "groups", local_groups(node, ins, mesh))
        elif t is aten.batch_norm.default:  # statistics synced over the batch (SyncBatchNorm)
            localize_batch_norm(node, ins, mesh)
        elif t in (aten.group_norm.default, aten.native_group_norm.default):
            localize_group_norm(node, ins, mesh)


def _set_arg(node: fx.Node, idx: int, name: str, value: object) -> None:
    """Replace argument ``idx`` (or keyword ``name``) of ``node`` with ``value``."""
    if len(node.args) > idx:
        node.args = (*node.args[:idx], value, *node.args[idx + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


# ops that move or reshape a tensor's elements without dropping or changing any: the
# count of non-ignored targets is the same before and after them
_SAME_COUNT = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.flatten.using_ints, aten.clone.default, aten.alias.default,
               aten.detach.default, aten.permute.default, aten.transpose.int, aten.t.default,
               aten.squeeze.dim, aten.unsqueeze.default, aten.contiguous.default}
HOISTED = "autopar_hoisted"  # meta key: emitted next to its input (takes the input's layer)


def _hoist_count(g: fx.Graph, target: fx.Node, ignore: int, rows: tuple[int, ...]) -> fx.Node:
    """Start the all-reduce of the global count of non-ignored targets right where the
    targets' elements first exist on this rank (the local slice of the labels, at the
    top of the graph), not at the loss: a collective in the forward waits for the
    slowest rank to reach it, and the labels are there long before the logits."""
    root = target
    while root.op == "call_function" and root.target in _SAME_COUNT:
        root = root.args[0]
    with g.inserting_after(root):
        start = g.call_function(O.start_count, (root, ignore, rows))
    start.meta[HOISTED] = True
    return start


def _localize_attention(node: fx.Node, ins: list[Placements], mesh: tuple[int, ...]) -> None:
    layout = context_layout(node, ins, mesh)
    if layout is None:
        raise ValueError(f"{node.name}: no lowering for attention placements "
                         f"{[fmt_placements(p) for p in ins]} on mesh {mesh}")
    if not layout.sharded:
        return
    a = sdpa_args(node)
    if layout.impl is CPImpl.RING:
        node.target = ring_attention
        node.args = (a.q, a.k, a.v, a.mask, a.is_causal, a.scale, layout.cp_axes)
    else:
        axes = layout.cp_axes or layout.row_axes
        node.target = CP.ulysses_attention if layout.impl is CPImpl.ULYSSES else CP.row_attention
        node.args = (a.q, a.k, a.v, a.mask, a.is_causal, a.scale, a.enable_gqa, axes)
    node.kwargs = {}
