"""D-Rec's ``mindspore`` cost mode: MindSpore's own symbolic cost formulas.

These prices exist only to reproduce MindSpore's documented D-Rec example (see the
module docstring of :mod:`autopar.search.solvers.drec`); planning uses the cost model.  They are
kept apart from the search state (:mod:`autopar.search.solvers.drec_round`) as a mixin so the
search reads as the mode-independent algorithm.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import info, tensor_inputs
from autopar.plans.placement import Placements, R, is_partial, is_shard, local_shape
from autopar.search.solvers.drec_graph import _Graph, _Group
from autopar.sharding.rules import OpStrategy

aten = torch.ops.aten

# Matrix products and their two factors' argument positions (the mindspore formulas).
_MATMULS = {aten.linear.default: (0, 1), aten.mm.default: (0, 1), aten.bmm.default: (0, 1),
            aten.matmul.default: (0, 1), aten.addmm.default: (1, 2)}
# The mindspore cost mode's constants (MindSpore rec_core/rec_cost.h): the I-cut of a
# MatMul is scaled by MATMUL_MEM_COEF, a mismatched neighbour costs REDIS_COEF x a tensor.
_MS_MATMUL_MEM_COEF = 0.25
_MS_REDIS_COEF = 16.0
# Cross-entropy losses are MindSpore "BatchParallel" ops (SoftmaxCrossEntropyWithLogits):
# they cut the batch every round, decide first (weight +inf), ignore their neighbours.
_MS_BATCH_PARALLEL = frozenset(
    getattr(aten, name).default for name in (
        "cross_entropy_loss", "nll_loss_forward", "nll_loss2d_forward") if hasattr(aten, name))
# Ops MindSpore's parser eliminates before partitioning (rec_parse_graph.h
# ElementWiseOpType: element-wise ops, BiasAdd, Reduce, Reshape...) beyond our followers:
# an MSE/L1 loss is Sub + Square/Abs + ReduceMean there, broadcasting is implicit.  In the
# mindspore mode they follow their producer like the followers.
_MS_ELIMINATED = frozenset(
    getattr(aten, name).default for name in (
        "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "broadcast_tensors",
        "expand", "sum", "mean") if hasattr(aten, name)) | {
    aten.sum.dim_IntList, aten.mean.dim}


def _mm_kind(n: fx.Node, ins: tuple, out: object) -> int:
    """Which MindSpore MatMul cut a 1-D placement of the product ``n`` is: 0 ``i`` (a row
    or batch dim of ``A`` and ``C``), 1 ``j`` (``B``'s and ``C``'s column), 2 ``k`` (the
    contraction: ``C`` Partial), 3 anything else (no cut, Partial inputs)."""
    pa, pb = (ins[tensor_inputs(n).index(n.args[p])] for p in _MATMULS[n.target])
    last = info(n).outputs[0].ndim - 1
    if is_shard(out) and not is_shard(out, last) and is_shard(pa) and not is_shard(pb):
        return 0
    if is_shard(out, last) and not is_shard(pa) and is_shard(pb):
        return 1
    if is_partial(out) and is_shard(pa) and is_shard(pb):
        return 2
    return 3


class _MindSporePrices:
    """The mindspore cost mode's prices, mixed into :class:`~autopar.search.solvers.drec_round._Search`
    (which provides the attributes annotated here)."""

    g: _Graph
    shape: tuple[int, ...]
    axis: int
    decided: set[fx.Node]
    full: Callable[[fx.Node], OpStrategy]

    def _before(self, p: Placements) -> Placements:
        """``p`` with the current axis replicated: the cut of the earlier rounds only."""
        return tuple(q if j != self.axis else R for j, q in enumerate(p))

    def _ms_dims(self, n: fx.Node) -> tuple[int, int, int]:
        """Local ``(e_i, e_j, e_k)`` of the matrix product ``n`` before this round's cut
        (``e_i`` is every output dim but the last: batch and rows)."""
        s = self.full(n)
        a_node = n.args[_MATMULS[n.target][0]]
        a_pos = tensor_inputs(n).index(a_node)
        a_loc = local_shape(info(a_node).out.shape, self._before(s.inputs[a_pos]), self.shape)
        o_loc = local_shape(info(n).outputs[0].shape, self._before(s.outputs[0]), self.shape)
        return math.prod(a_loc[:-1]), o_loc[-1], a_loc[-1]

    @staticmethod
    def _ms_cut_costs(e_i: int, e_j: int, e_k: int) -> tuple[float, float, float]:
        """MindSpore's CostMatMul (rec_cost.h StrConcatDimI/J, StrReduceDimK): cutting
        ``i`` keeps ``B`` whole (``e_j e_k / 2``, scaled by MATMUL_MEM_COEF), cutting ``j``
        keeps ``A`` whole (``e_i e_k / 2``), cutting ``k`` reduces ``C`` (``e_i e_j / 2``)."""
        return (e_j * e_k / 2.0 * _MS_MATMUL_MEM_COEF, e_i * e_k / 2.0, e_i * e_j / 2.0)

    def _ms_own(self, n: fx.Node) -> float:
        """MindSpore's own cost of the current axis' cut (see module docstring)."""
        if self.g.is_leaf(n) or n.target in self.g.followers:
            return 0.0
        a = self.axis
        s = self.full(n)
        if n.target in _MS_BATCH_PARALLEL:  # cuts the batch, nothing else
            return 0.0 if is_shard(s.inputs[0][a], 0) else math.inf
        out = s.outputs[0][a] if s.outputs else R
        pos = _MATMULS.get(n.target)
        if pos is None:
            # other ops: any cut is free (CostCommon), no cut or a pass-through Partial is
            # not allowed (the device set is always halved)
            return 0.0 if is_shard(out) else math.inf
        kind = _mm_kind(n, tuple(p[a] for p in s.inputs), out)
        return math.inf if kind > 2 else self._ms_cut_costs(*self._ms_dims(n))[kind]

    @staticmethod
    def _cut(p: object) -> int | None:
        """The dim a 1-D placement cuts (``None`` for Replicate and Partial alike, as
        MindSpore's strategies only record cuts)."""
        return p.dim if isinstance(p, Shard) else None

    def _ms_redis(self, grp: _Group) -> float:
        """MindSpore's CostRedis for the group's root op: for every op neighbour decided
        earlier in this round (through followers; parameters and inputs are no graph nodes
        there), ``REDIS_COEF x`` the local size of the tensor between them when their cuts
        of it differ.  Losses (BatchParallel) ignore their neighbours."""
        v = grp.root
        if self.g.is_leaf(v) or v.target in _MS_BATCH_PARALLEL:
            return 0.0
        a, s, total = self.axis, self.full(v), 0.0
        for x, i in self.g.in_edges[v]:  # producer ops (through followers): their output
            if i < 0 or self.g.is_leaf(x) or self.g.owner[x] is grp or x not in self.decided:
                continue
            u = self.g.owner[x].root
            if self._cut(self.full(u).outputs[0][a]) != self._cut(s.inputs[i][a]):
                total += _MS_REDIS_COEF * math.prod(
                    local_shape(info(x).out.shape, self._before(s.inputs[i]), self.shape))
        if not s.outputs:
            return total
        out_size = math.prod(local_shape(info(v).outputs[0].shape, self._before(s.outputs[0]),
                                         self.shape))
        mine = self._cut(s.outputs[0][a])
        for m in grp.members:  # consumers of the root and of its followers
            if self.g.is_leaf(m):
                continue
            for w, q in self.g.out_edges[m]:
                if q < 0 or self.g.owner[w] is grp or w not in self.decided:
                    continue
                if self._cut(self.full(w).inputs[q][a]) != mine:
                    total += _MS_REDIS_COEF * out_size
        return total
