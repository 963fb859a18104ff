"""The kernels a compiled graph runs: inductor's fusion of pointwise chains, as the cost
model prices them (decision ``compile``).

``torch.compile`` (inductor) runs a chain of pointwise ops, and a reduction ending it
(a norm, a softmax, a sum), as one kernel: the chain's intermediates stay in registers,
so the kernel reads the chain's inputs and writes the values read outside it once,
and it launches once.  Matmuls, attention and the other ops it calls out to end a
chain.  :func:`fuse` groups a captured graph's ops so (:class:`Fusion`), and
:class:`~autopar.search.node_prices.CostModel` prices each fused op's memory traffic
by its group's external inputs and outputs only, with the launch floor once per
group; an eager plan has no fusion and is priced op by op.

The grouping follows what inductor does for the graphs this project plans (a
transformer block): ops fuse with their producers within one layer (a layer is what
the stage search sums, so a group never spans two); a reduction that keeps the
reduced dims (a row statistic: a norm's mean, a softmax's max) or a norm / softmax op
may feed more pointwise ops of its group, a reduction to fewer dims ends it.  It is an
approximation: inductor also fuses across layers and may split a long group.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from autopar.capture.annotate import VIEW_OPS, is_noop_cast
from autopar.capture.ir import info, tensor_inputs
from autopar.capture.layers import layer_keys
from autopar.plans.decisions import prices

aten = torch.ops.aten

ROW_OPS = frozenset({
    aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
    aten._softmax.default, aten.softmax.int, aten._safe_softmax.default,
    aten._log_softmax.default, aten.log_softmax.int,
})
"""Ops inductor lowers to a row reduction and a pointwise epilogue: fused with the
pointwise ops before and after them."""

POINTWISE_EXTRA = frozenset({aten._to_copy.default, aten.to.dtype, aten.dropout.default,
                             aten.clone.default})
"""Ops inductor fuses as pointwise that carry no ``torch.Tag.pointwise``: a dtype cast,
a dropout (its random mask generated in the kernel), a copy."""


@dataclass(frozen=True)
class Fused:
    """How one op of a fused group runs inside the group's kernel."""

    group: int
    inputs: tuple[bool, ...]
    """Per tensor input (:func:`~autopar.capture.ir.tensor_inputs` order): whether the
    kernel reads it from memory for this op (made outside the group, and read by no
    earlier op of it)."""
    outputs: tuple[bool, ...]
    """Per output: whether it is written to memory (read outside the group)."""
    launches: bool
    """Whether this op pays the group's launch (its first op)."""

    @property
    def internal(self) -> bool:
        """No output leaves the group: an intermediate that never reaches memory."""
        return not any(self.outputs)


@dataclass(frozen=True)
class Fusion:
    """The fused groups of a graph: each op in a group of two or more, and the count."""

    ops: dict[fx.Node, Fused]
    groups: int

    def of(self, node: fx.Node) -> Fused | None:
        """``node``'s place in its fused group; None when it runs as its own kernel."""
        return self.ops.get(node)


def _transparent(n: fx.Node) -> bool:
    """A node that launches nothing: a view, a no-op cast, a tuple's item."""
    return n.op == "call_function" and (n.target in VIEW_OPS or n.target is operator.getitem
                                        or is_noop_cast(n))


def _kind(n: fx.Node) -> str | None:
    """``"pointwise"``, ``"row"`` (a reduction its group's pointwise ops may read on),
    ``"reduce"`` (a reduction that ends its group) or None (not fused)."""
    if n.op != "call_function" or _transparent(n) or not isinstance(n.target, torch._ops.OpOverload):
        return None
    if info(n).tuple_output or not info(n).outputs:
        return None
    if n.target in ROW_OPS:
        return "row"
    tags = n.target.tags
    if torch.Tag.pointwise in tags or n.target in POINTWISE_EXTRA:
        return "pointwise"
    if torch.Tag.reduction in tags:
        ins = tensor_inputs(n)
        keeps = bool(ins) and len(info(n).out.shape) == len(info(ins[0]).out.shape) > 0
        return "row" if keeps else "reduce"
    return None


def _source(n: fx.Node) -> fx.Node:
    """The op that made ``n``'s value, through views and no-op casts."""
    while _transparent(n) and n.all_input_nodes:
        n = n.all_input_nodes[0]
    return n


def _escapes(n: fx.Node, members: set[fx.Node]) -> bool:
    """Whether ``n``'s value is read outside ``members`` (through views), or returned."""
    stack = list(n.users)
    while stack:
        u = stack.pop()
        if _transparent(u):
            stack.extend(u.users)
        elif u not in members:
            return True
    return False


@prices("compile")
def fuse(gm: fx.GraphModule) -> Fusion:
    """The fused groups inductor forms from ``gm``'s ops (see the module docstring)."""
    members = _groups(gm)
    ops: dict[fx.Node, Fused] = {}
    count = 0
    for group in members:
        if len(group) < 2:
            continue
        inside, read = set(group), set()
        for i, n in enumerate(group):
            ins = []
            for u in tensor_inputs(n):
                src = _source(u)
                ins.append(src not in inside and src not in read)
                read.add(src)
            escapes = _escapes(n, inside)
            ops[n] = Fused(count, tuple(ins), tuple(escapes for _ in info(n).outputs), i == 0)
        count += 1
    return Fusion(ops, count)


def _groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The ops of ``gm`` that fuse, in groups (graph order), each op joining the group of
    a producer in its layer unless another of its inputs depends on that group through
    an op outside it (a residual add after the MLP its norm feeds: one kernel cannot
    both feed the MLP and wait for it); a group ends at a reduction to fewer dims."""
    layer = layer_keys(gm)
    group_of: dict[fx.Node, int] = {}
    groups: list[list[fx.Node]] = []
    closed: set[int] = set()
    after: dict[fx.Node, frozenset[int]] = {}  # the same-layer groups a value depends on
    for n in gm.graph.nodes:
        srcs = [_source(u) for u in tensor_inputs(n)] if n.op == "call_function" else []
        upstream = set().union(*(after.get(s, frozenset()) for s in srcs))
        upstream |= {group_of[s] for s in srcs if s in group_of}
        upstream = {g for g in upstream if layer.get(groups[g][0]) == layer.get(n)}
        kind = _kind(n)
        if kind is not None:
            legal = [group_of[s] for s in srcs if s in group_of and group_of[s] not in closed
                     and layer.get(s) == layer.get(n)
                     and not any(group_of.get(o) != group_of[s] and group_of[s] in after.get(o, ())
                                 for o in srcs)]
            g = legal[0] if legal else len(groups)
            if g == len(groups):
                groups.append([])
            groups[g].append(n)
            group_of[n] = g
            if kind == "reduce":
                closed.add(g)
        after[n] = frozenset(upstream)
    return groups


__all__ = ["Fused", "Fusion", "POINTWISE_EXTRA", "ROW_OPS", "fuse"]
