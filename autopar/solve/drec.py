r"""D-Rec: MindSpore-style double-recursive strategy search, one mesh axis per round.

The exact ILP (:mod:`autopar.solve.ilp`) chooses among the *product* of per-axis
strategies, so its problem grows like ``nodes x strategies^2`` and explodes on meshes
such as ``(4, 4, 8, 8)``.  D-Rec never builds that product.  It decides the mesh axes
one at a time ("rounds"); in each round every op picks ONE 1-D strategy
(:class:`~autopar.rules.AxisStrategy`) for that axis, so the work per round is
``nodes x per-axis strategies`` and the whole search is linear in the graph.

Rounds and mesh axes
    MindSpore halves the device set ``log2(N)`` times; a round here cuts by a whole mesh
    axis (a 2-way axis is exactly one MindSpore halving, so a ``(2, 2, 2)`` mesh is its
    3-round, 8-device search).  Axes are taken slowest link first (lowest bandwidth, i.e.
    the inter-node axis of a hierarchical mesh): the first round sees whole tensors and
    gives its cheapest cut (typically the batch, whose only traffic is the gradient
    all-reduce) to the link where traffic is most expensive.  Local shapes shrink after
    every round: later rounds price and check divisibility on what is left.

One round
    1. *Simplify*: pointwise and view ops ("followers") are removed from the ordering and
       grouped with the op that produces their first input; parameters, inputs and
       buffers are grouped with their first consumer.  A group is decided as a unit.
    2. Every group, in topological order (or reverse, or MindSpore's descending weight),
       tries each valid 1-D strategy of its root op.  Followers then take the strategy
       that matches their producer's output (when that is valid for them; otherwise their
       cheapest valid one) and leaves take the placement their consumer asks for.  The
       group's price is its members' own costs plus the redistribution on every edge to a
       node already decided in this round; the cheapest strategy wins (first on ties, so
       the search is deterministic).
    3. *Refine* (production mode only): a few best-response sweeps re-decide each group
       against all its, now decided, neighbours; this repairs the greedy order's blind
       spot (an op decided early cannot see consumers decided later).

Cost modes (:class:`CostMode`)
    ``model``: :class:`~autopar.costs.CostModel`, the ILP's own prices, on the placements
    decided so far with the undecided axes replicated; plans are comparable with the ILP.
    ``mindspore``: MindSpore's own symbolic formulas (mindspore/ccsrc/frontend/parallel/
    auto_parallel/rec_core: rec_cost.{h,cc}, rec_partition.{h,cc}, rec_parse_graph.h), only
    to reproduce its documented example.  A matmul ``C[i,j] = A[i,k] B[k,j]`` with local
    sizes ``e`` (before this round) pays ``e_j e_k / 2 * 0.25`` to cut ``i``
    (MATMUL_MEM_COEF), ``e_i e_k / 2`` to cut ``j`` and ``e_i e_j / 2`` to cut ``k``; ties
    go to ``i``, then ``j``, then ``k``.  Redistribution is priced per op (CostRedis): for
    each op neighbour already decided this round (through followers; parameters and inputs
    are no nodes) whose cut of the tensor between them differs, ``16 x`` that tensor's
    local size.  MindSpore's eliminated ops (element-wise, bias, reductions, hence MSE/L1
    losses and broadcasting) follow their producer; cross-entropy losses are BatchParallel
    (cut the batch, weight +inf, no redistribution).  ``Order.REVERSE`` is MindSpore's
    TopologyOrder, ``Order.WEIGHT`` its older WeightOrder (GetMaxCostIn, ties later op
    first).  Every op must cut something each round (the device set is always halved).

Pins and memory
    A pinned node only considers 1-D strategies whose output matches the pin on that axis.
    If the finished plan exceeds the memory budget, the search is repeated with memory
    priced in (``cost + lam * bytes``, ``lam`` doubled until the plan fits); if even the
    leanest plan does not fit, :class:`~autopar.errors.PlanError` says by how much.

Example::

    >>> from autopar.solve.drec import DRecOptions, drec_search   # doctest: +SKIP
    >>> result = drec_search(gm, mesh, CostModel(mesh), DRecOptions())  # doctest: +SKIP
    >>> result.choice[node]  # an OpStrategy per node, as the ILP would give  # doctest: +SKIP
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import torch
from torch import fx

from autopar.annotate import VIEW_OPS
from autopar.cost_models import MeshSpec
from autopar.costs import CostModel
from autopar.errors import PlanError
from autopar.grad_flow import dual
from autopar.ir import info, tensor_inputs
from autopar.placement import (
    Placements,
    R,
    Shard,
    fmt_placements,
    is_partial,
    is_shard,
    local_shape,
    valid_for_shape,
)
from autopar.rules import (
    AxisStrategy,
    OpStrategy,
    RuleCtx,
    axis_strategies,
    combine_axes,
    divides,
    replicate_strategy,
)
from autopar.rules.pointwise import LINEAR_UNARY, NONLINEAR_BINARY, NONLINEAR_UNARY
from autopar.solve.problem import format_bytes

aten = torch.ops.aten

__all__ = [
    "CostMode",
    "DRecOptions",
    "DRecResult",
    "Order",
    "Refine",
    "RoundInfo",
    "axis_order",
    "drec_search",
    "resolve_pins",
]

# Ops that only move or transform values element by element: they follow their producer.
_FOLLOWERS = frozenset(VIEW_OPS) | frozenset(NONLINEAR_UNARY + LINEAR_UNARY + NONLINEAR_BINARY) | {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
    aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, operator.add,
    operator.sub, operator.mul, operator.truediv, operator.getitem,
}
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
# Memory pricing: lam starts at (cost scale / memory scale) * this, and doubles.
_LAMBDA_START = 1e-3
_LAMBDA_STEPS = 40


class CostMode(StrEnum):
    """How a round prices a choice."""

    MODEL = "model"
    """autopar's CostModel (seconds), the ILP's prices: use this to plan."""
    MINDSPORE = "mindspore"
    """The symbolic formulas of MindSpore's D-Rec (element counts): reproduces its example."""


class Refine(StrEnum):
    """What follows the greedy pass of each round (production mode only)."""

    NONE = "none"
    """MindSpore's pure greedy."""
    SWEEPS = "sweeps"
    """Best-response sweeps: each group re-decided against all its neighbours."""
    EXACT = "exact"
    """The round's own problem (every node x its 1-D strategies on this axis, edges
    between them) solved exactly by autopar/solve/ilp.py, kept when cheaper than the
    greedy pass.  It is small (1-D strategies, not their product over axes) and
    tree-like graphs are solved by elimination without a MIP."""


class Order(StrEnum):
    """The order in which groups are decided within a round."""

    TOPOLOGICAL = "topological"
    """Producers first."""
    REVERSE = "reverse"
    """Consumers first (the loss end decides first)."""
    WEIGHT = "weight"
    """MindSpore's: heaviest op first, weight = its cheapest cut's own cost this round."""


@dataclass(frozen=True)
class DRecOptions:
    """Knobs of the D-Rec search.

    ``refine`` says what follows each greedy round (:class:`Refine`; the mindspore cost
    mode always runs the pure greedy); ``refine_sweeps`` bounds the best-response sweeps;
    ``axis_order`` overrides the slowest-link-first order of the rounds.
    """

    cost_mode: CostMode = CostMode.MODEL
    order: Order = Order.REVERSE
    refine: Refine = Refine.EXACT
    refine_sweeps: int = 3
    axis_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Validate and normalise the enums (strings are accepted)."""
        object.__setattr__(self, "cost_mode", CostMode(self.cost_mode))
        object.__setattr__(self, "order", Order(self.order))
        object.__setattr__(self, "refine", Refine(self.refine))
        if self.refine_sweeps < 0:
            raise ValueError(f"refine_sweeps must be >= 0, got {self.refine_sweeps}")


@dataclass
class RoundInfo:
    """One round: the mesh axis it decided, how long it took, and how many groups the
    refinement sweeps changed."""

    axis: int
    size: int
    seconds: float
    refined: int = 0


@dataclass
class DRecResult:
    """The chosen strategy of every node, and how the search went.

    ``lam`` is the memory price the accepted plan was found with (0 when the plain plan
    fits the budget); ``memory`` its per-device bytes as the cost model counts them.
    """

    choice: dict[fx.Node, OpStrategy]
    rounds: list[RoundInfo]
    seconds: float
    memory: float
    lam: float = 0.0
    message: str = ""


def axis_order(mesh: MeshSpec) -> list[int]:
    """Mesh axes in round order: slowest link first (lowest bandwidth of any level the
    axis crosses), ties by axis index; axes of size 1 are skipped (nothing to cut)."""
    def slowest(a: int) -> float:
        levels = mesh.links[a].levels(mesh.shape[a])
        return min((link.beta for link, p in levels if p > 1), default=math.inf)
    return sorted((a for a in range(len(mesh.shape)) if mesh.shape[a] > 1),
                  key=lambda a: (slowest(a), a))


# ------------------------------------------------------------------------ the graph view
def _plan_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes the plan holds a strategy for (the same set the ILP enumerates)."""
    out: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        ni = info(n)
        if n.op in ("placeholder", "get_attr") and ni.outputs:
            out.append(n)
        elif n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if src in seen and info(src).tuple_output:
                out.append(n)
        elif n.op == "call_function" and ni.outputs:
            out.append(n)
        else:
            continue
        seen.add(n)
    return out


@dataclass
class _Group:
    """A root op with the followers and leaves decided together with it (members in
    the order they are resolved: root, then each follower after its producer)."""

    root: fx.Node
    members: list[fx.Node] = field(default_factory=list)


class _Graph:
    """Static structure of the search: nodes, edges, groups, 1-D candidates."""

    def __init__(self, gm: fx.GraphModule, mesh_shape: tuple[int, ...],
                 followers: frozenset = _FOLLOWERS) -> None:
        self.followers = followers  # ops that follow their producer (see producer())
        self.nodes = _plan_nodes(gm)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        ctx = RuleCtx(tuple(mesh_shape))
        # in_edges[v]: (producer, input position in tensor_inputs(v)); -1 for getitem
        self.in_edges: dict[fx.Node, list[tuple[fx.Node, int]]] = {n: [] for n in self.nodes}
        self.out_edges: dict[fx.Node, list[tuple[fx.Node, int]]] = {n: [] for n in self.nodes}
        self.to_output: set[fx.Node] = set()
        self.cands: dict[fx.Node, list[AxisStrategy]] = {}
        for v in self.nodes:
            if v.op == "call_function" and v.target is operator.getitem:
                self._edge(v.args[0], v, -1)
                self.cands[v] = []  # forced: the producer's output, see _getitem
            elif v.op == "call_function":
                for i, u in enumerate(tensor_inputs(v)):
                    if u in self.index:
                        self._edge(u, v, i)
                self.cands[v] = axis_strategies(v, ctx)
            elif v.op == "get_attr" and info(v).param is None:
                self.cands[v] = [AxisStrategy((), (R,))]  # buffers and constants
            else:
                nd = info(v).out.ndim
                self.cands[v] = [AxisStrategy((), (R,))] + [AxisStrategy((), (Shard(d),))
                                                             for d in range(nd)]
            if any(u.op == "output" for u in v.users):
                self.to_output.add(v)
        self.owner: dict[fx.Node, _Group] = {}  # every member -> its group (_make_groups)
        self.groups = self._make_groups()

    def _edge(self, u: fx.Node, v: fx.Node, i: int) -> None:
        self.in_edges[v].append((u, i))
        self.out_edges[u].append((v, i))

    def is_leaf(self, n: fx.Node) -> bool:
        """Parameters, inputs, buffers: no rule, they take what their consumer asks."""
        return n.op in ("placeholder", "get_attr")

    def producer(self, n: fx.Node) -> fx.Node | None:
        """The op a follower follows (its first input that is an op), else ``None``."""
        if n.op != "call_function" or n.target not in self.followers:
            return None
        for u, _ in self.in_edges[n]:
            if not self.is_leaf(u):
                return u
        return None

    def _make_groups(self) -> list[_Group]:
        owner: dict[fx.Node, _Group] = {}
        groups: list[_Group] = []
        for n in self.nodes:
            if self.is_leaf(n):
                continue
            p = self.producer(n)
            if p is None:
                g = _Group(n)
                groups.append(g)
            else:
                g = owner[p]
            g.members.append(n)
            owner[n] = g
        for n in self.nodes:
            if not self.is_leaf(n):
                continue
            users = [v for v, _ in self.out_edges[n]]
            if users:  # with its first consumer (graph order), after that consumer
                g = owner[min(users, key=self.index.__getitem__)]
            else:
                g = _Group(n)
                groups.append(g)
            g.members.append(n)
            owner[n] = g
        for g in groups:  # resolve order: ops in graph order, each op's leaves after it
            ops = sorted((m for m in g.members if not self.is_leaf(m)), key=self.index.__getitem__)
            leaves = [m for m in g.members if self.is_leaf(m)]
            first_user = {m: min((v for v, _ in self.out_edges[m]), key=self.index.__getitem__,
                                 default=None) for m in leaves}
            order: list[fx.Node] = []
            for op in ops:
                order.append(op)
                order.extend(m for m in leaves if first_user[m] is op)
            order.extend(m for m in leaves if first_user[m] is None)
            g.members = order
        groups.sort(key=lambda g: self.index[g.root])
        self.owner = {m: g for g in groups for m in g.members}
        return groups


# ------------------------------------------------------------------------------- search
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


class _Search:
    """Mutable state of one D-Rec run: every node's 1-D strategy per mesh axis."""

    def __init__(self, g: _Graph, mesh: MeshSpec, cm: CostModel, opts: DRecOptions,
                 pins: Mapping[fx.Node, Placements], lam: float) -> None:
        self.g, self.mesh, self.cm, self.opts, self.pins, self.lam = g, mesh, cm, opts, pins, lam
        self.shape = tuple(mesh.shape)
        n_axes = len(self.shape)
        self.cur: dict[fx.Node, list[AxisStrategy]] = {}
        for n in g.nodes:
            if n.op == "call_function" and n.target is not operator.getitem:
                base = replicate_strategy(n)
            else:
                base = AxisStrategy((), (R,))
            self.cur[n] = [base] * n_axes
        self.decided: set[fx.Node] = set()
        self._full: dict[tuple, OpStrategy] = {}
        self._own: dict[tuple, float] = {}
        self._fits: dict[tuple, bool] = {}
        self.axis = 0

    # ---------------------------------------------------------------- state
    def full(self, n: fx.Node) -> OpStrategy:
        """The node's mesh strategy now (undecided axes replicated)."""
        key = (n, tuple(self.cur[n]))
        s = self._full.get(key)
        if s is None:
            s = combine_axes(self.cur[n])
            self._full[key] = s
        return s

    def set(self, n: fx.Node, s: AxisStrategy) -> None:
        """Give ``n`` the 1-D strategy ``s`` on the current axis."""
        row = self.cur[n]
        if row[self.axis] is not s:
            row = list(row)
            row[self.axis] = s
            self.cur[n] = row

    def fits(self, n: fx.Node, s: AxisStrategy) -> bool:
        """Divisibility and pins for ``s`` on the current axis (earlier axes as decided)."""
        pin = self.pins.get(n)
        if pin is not None and s.outputs[0] != pin[self.axis]:
            return False
        row = list(self.cur[n])
        row[self.axis] = s
        key = (n, tuple(row))
        ok = self._fits.get(key)
        if ok is None:
            ok = self._fits[key] = divides(n, combine_axes(row), self.shape)
        return ok

    # ---------------------------------------------------------------- prices
    def own(self, n: fx.Node) -> float:
        """The node's own price under its current strategy."""
        # the mindspore price is that of the current axis' cut: the axis is in the key
        key = (n, self.axis if self.opts.cost_mode is CostMode.MINDSPORE else -1, tuple(self.cur[n]))
        c = self._own.get(key)
        if c is None:
            c = self._own_price(n)
            self._own[key] = c
        return c

    def _own_price(self, n: fx.Node) -> float:
        s = self.full(n)
        if self.opts.cost_mode is CostMode.MINDSPORE:
            return self._ms_own(n)
        c = self.cm.node_cost(n, s)
        if n in self.g.to_output:  # outputs end up where the caller gets them, as the ILP prices them
            c += self.cm.output_cost(n, s)
        if self.lam:
            c += self.lam * self.cm.node_memory(n, s)
        return c

    def edge(self, u: fx.Node, v: fx.Node, i: int) -> float:
        """Redistribution price of edge ``u -> v`` (input ``i`` of ``v``)."""
        if i < 0:
            return 0.0  # getitem takes its producer's placement by construction
        if self.opts.cost_mode is CostMode.MINDSPORE:
            return 0.0  # priced per op against its op neighbours: see _ms_redis
        src, dst = self.full(u).outputs[0], self.full(v).inputs[i]
        return self.cm.redistribution(src, dst, info(u).out, dual(u, v))

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

    def node_price(self, n: fx.Node, inside: set[fx.Node] | None = None) -> float:
        """Own price plus edges to decided neighbours (or to ``inside`` members)."""
        total = self.own(n)
        inside = inside or set()
        for u, i in self.g.in_edges[n]:
            if u in self.decided or u in inside:
                total += self.edge(u, n, i)
        for v, i in self.g.out_edges[n]:
            if v in self.decided or v in inside:
                total += self.edge(n, v, i)
        return total

    # ---------------------------------------------------------------- one group
    def _getitem(self, n: fx.Node) -> AxisStrategy:
        src = self.cur[n.args[0]][self.axis]
        return AxisStrategy((), (src.outputs[n.args[1]],))

    def _leaf_choice(self, n: fx.Node, set_now: set[fx.Node]) -> AxisStrategy:
        """What the first decided consumer asks for, if valid (Partial -> Replicate)."""
        a = self.axis
        for v, i in self.g.out_edges[n]:
            if v in set_now or v in self.decided:
                want = self.full(v).inputs[i][a]
                if is_partial(want):
                    want = R
                for c in self.g.cands[n]:
                    if c.outputs[0] == want and self.fits(n, c):
                        return c
                break
        pin = self.pins.get(n)
        for c in self.g.cands[n]:
            if (pin is None or c.outputs[0] == pin[a]) and self.fits(n, c):
                return c
        return self.g.cands[n][0]

    def _follower_choice(self, n: fx.Node, set_now: set[fx.Node]) -> AxisStrategy:
        """The valid candidate matching the producer's output, unless another valid one is
        strictly cheaper against everything decided (the fallback)."""
        if n.target is operator.getitem:
            return self._getitem(n)
        p = self.g.producer(n)
        want = self.cur[p][self.axis].outputs[0] if p is not None else None
        pos = next((i for u, i in self.g.in_edges[n] if u is p), None)
        best, best_cost, best_match = None, math.inf, False
        for c in self.g.cands[n]:
            if not self.fits(n, c):
                continue
            self.set(n, c)
            cost = self.node_price(n, set_now)
            match = pos is not None and c.inputs[pos] == want
            if cost < best_cost or (cost == best_cost and match and not best_match) or best is None:
                best, best_cost, best_match = c, cost, match
        if best is None:  # only a pin can exclude Replicate, which always divides
            raise PlanError(f"D-Rec: no strategy of {n.name} fits mesh axis {self.axis}"
                            + self._pin_hint(n))
        return best

    def _resolve(self, grp: _Group, root_choice: AxisStrategy) -> float:
        """Set every member for ``root_choice`` of the root; return the group's price."""
        set_now: set[fx.Node] = set()
        for m in grp.members:
            if m is grp.root and not self.g.is_leaf(m):
                c = root_choice
            elif self.g.is_leaf(m):
                c = self._leaf_choice(m, set_now) if m is not grp.root else root_choice
            else:
                c = self._follower_choice(m, set_now)
            self.set(m, c)
            set_now.add(m)
        total = 0.0
        if self.opts.cost_mode is CostMode.MINDSPORE:
            return math.fsum(self.own(m) for m in grp.members) + self._ms_redis(grp)
        for m in grp.members:
            total += self.own(m)
            for u, i in self.g.in_edges[m]:
                if u in set_now or u in self.decided:
                    total += self.edge(u, m, i)
            for v, i in self.g.out_edges[m]:
                if v in self.decided and v not in set_now:
                    total += self.edge(m, v, i)
        return total

    def root_options(self, grp: _Group) -> list[AxisStrategy]:
        """Valid 1-D strategies of the group's root on the current axis."""
        if grp.root.target is operator.getitem:
            return [self._getitem(grp.root)]
        opts = [c for c in self.g.cands[grp.root] if self.fits(grp.root, c)]
        if not opts:
            raise PlanError(f"D-Rec: no strategy of {grp.root.name} fits mesh axis {self.axis} "
                            f"(size {self.shape[self.axis]})" + self._pin_hint(grp.root))
        return opts

    def _pin_hint(self, n: fx.Node) -> str:
        pin = self.pins.get(n)
        return "" if pin is None else f" with its pin {fmt_placements(pin)}"

    def decide(self, grp: _Group) -> bool:
        """Pick the group's cheapest root strategy; return whether anything changed."""
        before = {m: self.cur[m][self.axis] for m in grp.members}
        options = self.root_options(grp)
        if self.opts.cost_mode is CostMode.MINDSPORE and grp.root.target in _MATMULS:
            # ChoseStr takes the first minimum of (i, j, k): try them in that order
            options = sorted(options, key=lambda c: _mm_kind(grp.root, c.inputs, c.outputs[0]))
        if grp.root in self.decided:
            # a refinement sweep: the current choice is tried first and kept on ties, so
            # sweeps only ever lower the price and stop
            current = self.cur[grp.root][self.axis]
            options = [current] + [c for c in options if c != current]
        best, best_cost = None, math.inf
        for c in options:
            cost = self._resolve(grp, c)
            if best is None or cost < best_cost * (1 - 1e-12):
                best, best_cost = c, cost
        self._resolve(grp, best)
        self.decided.update(grp.members)
        return any(self.cur[m][self.axis] != before[m] for m in grp.members)

    def weight(self, grp: _Group) -> float:
        """The op weight of :attr:`Order.WEIGHT`.

        Mindspore mode: MindSpore's GetWeights (rec_partition.cc): a matmul's dearest cut
        (CostMatMul::GetMaxCostIn), a loss (BatchParallel) ``+inf``, any other op 0.  Model
        mode: the root's cheapest cut, its own cost only.
        """
        if self.opts.cost_mode is CostMode.MINDSPORE:
            root = grp.root
            if root.target in _MS_BATCH_PARALLEL:
                return math.inf
            if root.target in _MATMULS:
                return max(self._ms_cut_costs(*self._ms_dims(root)))
            return 0.0
        row = self.cur[grp.root]
        costs = []
        for c in self.root_options(grp):
            self.set(grp.root, c)
            costs.append(self.own(grp.root))
        self.cur[grp.root] = row
        finite = [c for c in costs if math.isfinite(c)]
        return min(finite) if finite else 0.0

    def run_round(self, axis: int) -> RoundInfo:
        """Decide every group on ``axis``: greedy pass, then refinement sweeps."""
        t0 = time.perf_counter()
        self.axis = axis
        self.decided = set()
        groups = list(self.g.groups)
        if self.opts.order is Order.REVERSE:
            groups.reverse()
        elif self.opts.order is Order.WEIGHT:
            w = {id(grp): self.weight(grp) for grp in groups}
            if self.opts.cost_mode is CostMode.MINDSPORE:
                # SortByWeight: (weight, index) ascending, read backwards -> on ties the
                # later op first
                groups.sort(key=lambda grp: (-w[id(grp)], -self.g.index[grp.root]))
            else:
                groups.sort(key=lambda grp: -w[id(grp)])  # stable: graph order on ties
        for grp in groups:
            self.decide(grp)
        refined = 0
        refine = self.opts.refine if self.opts.cost_mode is CostMode.MODEL else Refine.NONE
        if refine is Refine.SWEEPS:
            for _ in range(self.opts.refine_sweeps):
                changed = sum(self.decide(grp) for grp in groups)
                refined += changed
                if not changed:
                    break
        elif refine is Refine.EXACT:
            refined = self.exact_round()
        return RoundInfo(axis, self.shape[axis], time.perf_counter() - t0, refined)

    def round_price(self) -> float:
        """Price of the current axis' choices (own costs plus every edge)."""
        total = 0.0
        for n in self.g.nodes:
            total += self.own(n)
            for u, i in self.g.in_edges[n]:
                total += self.edge(u, n, i)
        return total

    def exact_round(self) -> int:
        """Solve this axis' 1-D problem exactly; adopt it when cheaper than the greedy
        choice.  Returns how many nodes changed."""
        from autopar.solve.ilp import solve_ilp
        from autopar.solve.problem import StrategyProblem

        nodes = self.g.nodes
        greedy = {n: self.cur[n][self.axis] for n in nodes}
        cands: dict[fx.Node, list[AxisStrategy]] = {}
        for n in nodes:
            if n.target is operator.getitem:
                src = cands[n.args[0]]
                cands[n] = [AxisStrategy((), (c.outputs[n.args[1]],)) for c in src]
            else:
                cands[n] = [c for c in self.g.cands[n] if self.fits(n, c)]
                if not cands[n]:
                    return 0  # a pin leaves nothing here: keep the greedy answer
        costs, mems = [], []
        for n in nodes:
            row = []
            for c in cands[n]:
                self.set(n, c)
                row.append(self.own(n))
            costs.append(np.array(row))
            mems.append(np.zeros(len(row)))
        index = {n: i for i, n in enumerate(nodes)}
        edges = []
        for v in nodes:
            for u, i in self.g.in_edges[v]:
                if i < 0:
                    m = np.full((len(cands[u]), len(cands[v])), np.inf)
                    np.fill_diagonal(m, 0.0)
                else:
                    m = np.empty((len(cands[u]), len(cands[v])))
                    for a, cu in enumerate(cands[u]):
                        self.set(u, cu)
                        for b, cv in enumerate(cands[v]):
                            self.set(v, cv)
                            m[a, b] = self.edge(u, v, i)
                edges.append((index[u], index[v], m))
        for n in nodes:
            self.set(n, greedy[n])
        before = self.round_price()
        try:
            sol = solve_ilp(StrategyProblem(costs, mems, edges), time_limit=10.0)
        except (ValueError, TimeoutError):
            return 0
        if not sol.objective < before * (1 - 1e-12):
            return 0
        for n, j in zip(nodes, sol.choice):
            self.set(n, cands[n][j])
        return sum(self.cur[n][self.axis] != greedy[n] for n in nodes)

    def memory(self) -> float:
        """Per-device bytes of the current plan, as the cost model counts them."""
        return math.fsum(self.cm.node_memory(n, self.full(n)) for n in self.g.nodes)


# ------------------------------------------------------------------------------- driver
_UNPINNED = OpStrategy((), (("unpinned",),))


def resolve_pins(gm: fx.GraphModule, pins: Mapping, mesh_shape: tuple[int, ...],
                 aliases: Mapping[str, list[str]]) -> dict[fx.Node, Placements]:
    """User pins (names, ``input:i``, globs) -> {node: placements}, with exactly the
    semantics and errors of :func:`autopar.strategies.apply_pins`.

    ``apply_pins`` filters candidate lists; here every node's list holds each pinned value
    plus a sentinel, so a node it pinned is the one whose sentinel is gone.
    """
    from autopar.placement import parse_placements
    from autopar.strategies import apply_pins

    if not pins:
        return {}
    wants = list(dict.fromkeys(parse_placements(v) if isinstance(v, str) else tuple(v)
                               for v in pins.values()))
    lists = {n: [OpStrategy((), (w,)) for w in wants] + [_UNPINNED] for n in _plan_nodes(gm)}
    apply_pins(lists, pins, tuple(mesh_shape), aliases, gm)
    return {n: lst[0].outputs[0] for n, lst in lists.items() if _UNPINNED not in lst}


def _check_pins(g: _Graph, pins: Mapping[fx.Node, Placements], shape: tuple[int, ...]) -> None:
    for n, p in pins.items():
        if len(p) != len(shape):
            raise PlanError(f"pin on {n.name}: {len(p)} placements for a {len(shape)}-axis mesh")
        if n in g.index and not valid_for_shape(p, info(n).outputs[0].shape, shape):
            raise PlanError(f"pin {fmt_placements(p)} is not possible for {n.name} (shape "
                            f"{info(n).outputs[0].shape} on mesh {shape})")


def _one_run(g: _Graph, mesh: MeshSpec, cm: CostModel, opts: DRecOptions,
             pins: Mapping[fx.Node, Placements], lam: float, axes: Iterable[int]) -> tuple[_Search, list[RoundInfo]]:
    s = _Search(g, mesh, cm, opts, pins, lam)
    rounds = [s.run_round(a) for a in axes]
    return s, rounds


def drec_search(gm: fx.GraphModule, mesh: MeshSpec, cm: CostModel, opts: DRecOptions | None = None,
                pins: Mapping[fx.Node, Placements] | None = None,
                memory_budget: float | None = None) -> DRecResult:
    """Run D-Rec on an annotated graph; return an :class:`OpStrategy` per plan node.

    ``pins`` maps nodes to the placements they must output (resolved from user names by
    :func:`autopar.strategies.apply_pins`); ``memory_budget`` is bytes per device.  Raises
    :class:`PlanError` when a pin cannot be met or no plan found fits the budget.
    """
    opts = opts or DRecOptions()
    pins = dict(pins or {})
    t0 = time.perf_counter()
    shape = tuple(mesh.shape)
    followers = _FOLLOWERS | _MS_ELIMINATED if opts.cost_mode is CostMode.MINDSPORE else _FOLLOWERS
    g = _Graph(gm, shape, followers)
    _check_pins(g, pins, shape)
    axes = list(opts.axis_order) if opts.axis_order is not None else axis_order(mesh)
    s, rounds = _one_run(g, mesh, cm, opts, pins, 0.0, axes)
    mem = s.memory()
    lam, message = 0.0, f"D-Rec, {len(rounds)} rounds over mesh axes {axes}"
    if memory_budget is not None and mem > memory_budget and opts.cost_mode is CostMode.MODEL:
        # price memory in: lam converts bytes to seconds; start where memory is a small
        # share of the price and double until the plan fits
        cost = max(math.fsum(s.own(n) for n in g.nodes), 1e-12)
        lam = _LAMBDA_START * cost / max(mem, 1.0)
        best_mem = mem
        for _ in range(_LAMBDA_STEPS):
            s2, rounds2 = _one_run(g, mesh, cm, opts, pins, lam, axes)
            m2 = s2.memory()
            best_mem = min(best_mem, m2)
            if m2 <= memory_budget:
                s, rounds, mem = s2, rounds2, m2
                break
            lam *= 2.0
        else:
            raise PlanError(
                f"D-Rec found no plan within the memory budget {format_bytes(memory_budget)}: "
                f"the plain plan needs {format_bytes(mem)} per device and the leanest one it "
                f"found (memory priced in) {format_bytes(best_mem)}; raise the budget, use "
                f"more devices, or try search='ilp' for an exact answer")
        message += (f"; memory priced in (lam {lam:.3g} s/B) to fit the budget "
                    f"{format_bytes(memory_budget)}")
    choice = {n: s.full(n) for n in g.nodes}
    return DRecResult(choice, rounds, time.perf_counter() - t0, mem, lam, message)
