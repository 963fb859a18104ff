"""What an op's local form does when it communicates by itself, in words.

Most ops compute on their local shards and every collective sits on an edge (a
redistribution that ``plan.explain`` lists).  A few lower to a form that exchanges
data inside the op: attention on sequence chunks (Ulysses, ring, query rows), the
experts of a mixture of experts (the token dispatch), the distributed cross-entropy,
a 2-norm or variance over a split dim and batch norm's synced statistics.
:func:`describe` says which form a strategy lowers to, read from the placements alone,
just as ``passes/localize.py`` decides it, so ``explain`` and the generated code agree.
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import info
from autopar.cost_models import MeshSpec
from autopar.plans.placement import local_shape
from autopar.runtime.experts import MOE_EXPERTS
from autopar.runtime.ring_attention import ring_balanced
from autopar.sharding.rules import OpStrategy
from autopar.sharding.rules.attention import SDPA, CPImpl, context_layout, sdpa_args
from autopar.sharding.rules.channel_norms import batch_norm_axes
from autopar.sharding.rules.moe_experts import expert_axes
from autopar.sharding.rules.statistics import SPLIT_REDUCTIONS, split_axes

aten = torch.ops.aten


def _axes(mesh: MeshSpec, axes: tuple[int, ...]) -> str:
    return " x ".join(f"{mesh.axis_names[a]} ({mesh.shape[a]})" for a in axes)


def _attention(node: fx.Node, s: OpStrategy, mesh: MeshSpec) -> str:
    layout = context_layout(node, s.inputs, mesh.shape)
    if layout is None or not layout.sharded:
        return ""
    if layout.impl is None:
        return (f"query rows split over {_axes(mesh, layout.row_axes)}: keys and values "
                "come whole on its input edges, a causal mask is offset by each rank's "
                "first row")
    where = _axes(mesh, layout.cp_axes)
    if layout.impl is CPImpl.ULYSSES:
        return (f"context parallel over {where}, Ulysses: per axis one all-to-all each of "
                "q, k, v and the output turns sequence chunks into whole sequences of fewer "
                "heads and back (the same again in backward)")
    n = math.prod(mesh.shape[a] for a in layout.cp_axes)
    causal = sdpa_args(node).is_causal
    q = info(node.args[0]).out
    zigzag = causal and ring_balanced(q.shape[2] // n)
    how = ("zigzag chunks balance the causal work" if zigzag else
           "causal, chunks in order (each rank's chunk does not halve: no zigzag)" if causal
           else "not causal")
    shifts = f"{n - 1} shift{'s' if n > 2 else ''}"
    return (f"ring attention over {where}: {shifts} of key/value blocks to the next rank, "
            f"merged by log-sum-exp; {how} (the heads per rank do not divide by {n}, so "
            "no Ulysses)")


def _experts(s: OpStrategy, mesh: MeshSpec) -> str:
    ep, only = expert_axes(s.inputs)
    if ep:
        return (f"expert parallel over {_axes(mesh, ep)}: each routed (token, slot) row goes "
                "to its expert's rank and back by uneven all-to-alls (counts first), priced "
                "at even routing")
    if only:
        return (f"experts split over {_axes(mesh, only)} with the tokens whole: each rank "
                "adds its experts' share, the output is a partial sum")
    return ""


def _cross_entropy(node: fx.Node, s: OpStrategy, mesh: MeshSpec) -> str:
    x = info(node.args[0]).out
    parts = []
    for a, p in enumerate(s.inputs[0]):
        if mesh.shape[a] == 1 or not isinstance(p, Shard):
            continue
        if p.dim == 1:
            parts.append(f"vocabulary split over {_axes(mesh, (a,))}: the row maximum, the "
                         "sum of exponentials and the target logit are all-reduced")
        elif p.dim == 0 and local_shape(x.shape, s.inputs[0], mesh.shape)[0]:
            parts.append(f"rows split over {_axes(mesh, (a,))}: the count of counted targets "
                         "is all-reduced asynchronously behind the op's own work")
    return "; ".join(parts)


def _batch_norm(node: fx.Node, s: OpStrategy, mesh: MeshSpec) -> str:
    stat, chan = batch_norm_axes(s.inputs[0])
    stat = tuple(a for a in stat if mesh.shape[a] > 1)
    chan = tuple(a for a in chan if mesh.shape[a] > 1)
    parts = []
    if stat:
        parts.append(f"batch statistics over {_axes(mesh, stat)} (SyncBatchNorm): in training "
                     "the per-channel sums are all-reduced, their gradients too in backward")
    if chan and len(s.inputs) == 5:
        parts.append(f"channels split over {_axes(mesh, chan)}: each rank's running-statistics "
                     "update is summed into the whole buffers")
    return "; ".join(parts)


def describe(node: fx.Node, s: OpStrategy, mesh: MeshSpec) -> str:
    """What ``node``'s local form under ``s`` exchanges by itself, or ``""``."""
    if node.op != "call_function":
        return ""
    if node.target is SDPA:
        return _attention(node, s, mesh)
    if node.target is MOE_EXPERTS:
        return _experts(s, mesh)
    if node.target is aten.cross_entropy_loss.default:
        return _cross_entropy(node, s, mesh)
    if node.target in SPLIT_REDUCTIONS and split_axes(node, s.inputs[0]):
        what = "sum of squares" if node.target is aten.linalg_vector_norm.default else \
            "sum, then the sum of squared deviations,"
        return (f"reduced dim split over {_axes(mesh, split_axes(node, s.inputs[0]))}: the "
                f"{what} all-reduced; the result whole")
    if node.target is aten.batch_norm.default:
        return _batch_norm(node, s, mesh)
    return ""


__all__ = ["describe"]
