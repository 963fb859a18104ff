"""Finding repeated layers: the :class:`Block` and :class:`Clustering` records and the
fingerprints that group identical layers (:func:`find_clusters`, :func:`shared_pricing`).

Detection only reads the graph and the problem's shape; it is separate from the solver
(:mod:`autopar.search.solvers.cluster`) because :func:`shared_pricing` is used while the problem
is still being built, before anything is solved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import fx

from autopar.capture.ir import info, tensor_inputs
from autopar.capture.layers import Layer, layers
from autopar.search.solvers.problem import StrategyProblem
from autopar.sharding.rules import OpStrategy

__all__ = ["MAX_SIDE_LAYOUTS", "Block", "Clustering", "find_clusters", "shared_pricing"]

MAX_SIDE_LAYOUTS = 256
"""Most joint layouts of the shared side inputs the clustered solver conditions on (each
costs one transfer per class and one chain solve; 25-100 is typical of a mask on a 2-D mesh)."""


@dataclass(frozen=True)
class Block:
    """One repeated layer in problem-index space.

    ``nodes`` are the problem indices of the layer's nodes in graph order (so the ``j``-th
    node of two blocks of one class plays the same role); ``entry`` is the problem index of
    the single node outside the block that feeds it; ``exit`` is the position in ``nodes``
    of the single node used outside the block; ``edges`` are the problem's edge indices
    that belong to the block (inside it or from ``entry`` into it); ``cls`` is its class.
    """

    key: str
    nodes: tuple[int, ...]
    entry: int
    exit: int
    edges: tuple[int, ...]
    cls: int

    @property
    def exit_node(self) -> int:
        """Problem index of the exit node."""
        return self.nodes[self.exit]


@dataclass
class Clustering:
    """Blocks of a problem that the clustered solver treats as repeated layers.

    ``kept`` are the problem nodes outside every block (they stay as they are in the
    reduced problem); ``classes`` counts distinct block classes.
    """

    blocks: list[Block]
    kept: list[int]
    classes: int
    sides: tuple[int, ...] = ()

    def describe(self) -> str:
        """One line for ``plan.solver.message``."""
        shared = ""
        if self.sides:
            shared = f", {len(self.sides)} shared input{'s' if len(self.sides) != 1 else ''}"
        return (f"clustered {len(self.blocks)} repeated layers into {self.classes} layer class"
                f"{'es' if self.classes != 1 else ''} ({len(self.blocks[0].nodes)} nodes each"
                f"{shared}), reduced problem {len(self.kept) + len(self.blocks)} nodes")


def _node_fingerprint(n: fx.Node, strategies: list[OpStrategy]) -> tuple:
    """What decides a node's prices: op, output tensors, FLOPs, bytes, param-ness, strategies."""
    ni = info(n)
    target = str(n.target) if n.op == "call_function" else ""
    to_output = any(u.op == "output" for u in n.users)
    return (n.op, target, ni.outputs, ni.flops, ni.bytes_moved, ni.param is not None,
            ni.buffer is not None, to_output, tuple((s.inputs, s.outputs) for s in strategies))


def shared_pricing(gm: fx.GraphModule, strategies: dict[fx.Node, list[OpStrategy]],
                   lays: list[Layer] | None = None) -> dict[fx.Node, fx.Node]:
    """Map each node of a repeated layer to its twin in the first identical layer.

    Two layers are identical when their nodes match position by position in op, output
    and input tensors, FLOPs, bytes, strategy lists and wiring; a node's prices (and those
    of the edges into it) are then the twin's, so :func:`autopar.search.op_placement.build_problem`
    prices one layer per class instead of every layer. Nodes without a twin are absent.
    ``lays`` is ``layers(gm)`` when the caller already has it.
    """
    first: dict[tuple, list[fx.Node]] = {}
    share: dict[fx.Node, fx.Node] = {}
    for lay in layers(gm) if lays is None else lays:
        if not lay.repeated:
            continue
        local = [n for n in lay.nodes if n in strategies]
        pos = {n: j for j, n in enumerate(local)}
        fp = tuple(
            (_node_fingerprint(n, strategies[n]),
             tuple((pos.get(u, -1), info(u).outputs) for u in tensor_inputs(n)))
            for n in local)
        rep = first.setdefault(fp, local)
        if rep is not local:
            share.update(zip(local, rep))
    return share


def find_clusters(gm: fx.GraphModule, nodes: Sequence[fx.Node],
                  strategies: dict[fx.Node, list[OpStrategy]],
                  problem: StrategyProblem, lays: list[Layer] | None = None) -> Clustering | None:
    """Find repeated layers of ``gm`` in ``problem`` (whose node ``i`` is ``nodes[i]``).

    A layer qualifies when exactly one outside node feeds it and exactly one of its nodes
    is used outside it; qualifying layers with equal fingerprints form a class. Returns
    ``None`` when no class has two or more members (the flat solve is then just as good).
    ``lays`` is ``layers(gm)`` when the caller already has it.
    """
    index = {n: i for i, n in enumerate(nodes)}
    layer_of = np.full(len(nodes), -1)
    members: list[tuple[str, list[int]]] = []
    for lay in layers(gm) if lays is None else lays:
        if not lay.repeated:
            continue
        local = [index[n] for n in lay.nodes if n in index]
        if not local:
            continue
        layer_of[local] = len(members)
        members.append((lay.key, local))
    if len(members) < 2:
        return None
    sources: list[set[int]] = [set() for _ in members]
    exported: list[set[int]] = [set() for _ in members]
    owned: list[list[int]] = [[] for _ in members]
    for e, (u, v, _) in enumerate(problem.edges):
        lu, lv = layer_of[u], layer_of[v]
        if lv >= 0:
            owned[lv].append(e)
            if lu != lv:
                sources[lv].add(u)
        if lu >= 0 and lu != lv:
            exported[lu].add(u)
    sides = _side_inputs(sources, problem)
    side_pos = {u: -2 - j for j, u in enumerate(sides)}
    side_set = set(sides)
    classes: dict[tuple, int] = {}
    blocks: list[Block] = []
    for m, (key, local) in enumerate(members):
        chain = sources[m] - side_set
        if len(chain) != 1 or len(exported[m]) != 1 or not side_set.isdisjoint(local):
            # not a chain link (or it computes a side input other layers read, like T5's
            # position bias in block 0): stays in the reduced problem as it is
            continue
        (entry,) = chain
        pos = {u: j for j, u in enumerate(local)} | side_pos
        pos[entry] = -1
        wiring = tuple((pos[problem.edges[e][0]], pos[problem.edges[e][1]]) for e in owned[m])
        (out,) = exported[m]
        fp = (tuple(_node_fingerprint(nodes[u], strategies[nodes[u]]) for u in local),
              wiring, pos[out])
        cls = classes.setdefault(fp, len(classes))
        blocks.append(Block(key, tuple(local), entry, pos[out], tuple(owned[m]), cls))
    counts = np.bincount([b.cls for b in blocks], minlength=len(classes)) if blocks else []
    if not blocks or max(counts) < 2:
        return None
    in_block = np.zeros(len(nodes), dtype=bool)
    for b in blocks:
        in_block[list(b.nodes)] = True
    kept = [int(i) for i in np.flatnonzero(~in_block)]
    used = {problem.edges[e][0] for b in blocks for e in b.edges} & set(sides)
    return Clustering(blocks, kept, len(classes), tuple(u for u in sides if u in used))


def _side_inputs(sources: list[set[int]], problem: StrategyProblem) -> list[int]:
    """Nodes that feed two or more layers other than their own (rotary tables, masks,
    position embeddings, an encoder's output, a bias one layer computes for the rest), in
    problem order. The solver conditions on their joint strategy, so their layouts
    multiply: none are taken (no clustering of the layers they feed) when the product
    passes :data:`MAX_SIDE_LAYOUTS`."""
    feeds: dict[int, int] = {}
    for src in sources:
        for u in src:
            feeds[u] = feeds.get(u, 0) + 1
    sides = sorted(u for u, k in feeds.items() if k >= 2)
    layouts = math.prod(len(problem.node_costs[u]) for u in sides)
    return sides if layouts <= MAX_SIDE_LAYOUTS else []

