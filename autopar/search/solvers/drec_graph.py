"""D-Rec's static view of the graph: plan nodes, edges, groups and 1-D candidates.

Everything here is fixed for a whole search (it does not depend on the mesh axis being
decided nor on the choices made so far), so it is built once per
:func:`autopar.search.solvers.drec.drec_search` and kept apart from the mutable search state
(:mod:`autopar.search.solvers.drec_round`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.annotate import VIEW_OPS
from autopar.capture.ir import info, tensor_inputs
from autopar.plans.placement import R
from autopar.sharding.rules import AxisStrategy, RuleCtx, axis_strategies
from autopar.sharding.rules.pointwise import LINEAR_UNARY, NONLINEAR_BINARY, NONLINEAR_UNARY

aten = torch.ops.aten

# Ops that only move or transform values element by element: they follow their producer.
_FOLLOWERS = frozenset(VIEW_OPS) | frozenset(NONLINEAR_UNARY + LINEAR_UNARY + NONLINEAR_BINARY) | {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
    aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, operator.add,
    operator.sub, operator.mul, operator.truediv, operator.getitem,
}


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

