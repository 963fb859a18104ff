"""Exact presolve of a :class:`~autopar.search.solvers.problem.StrategyProblem` (the steps are
listed in :mod:`autopar.search.solvers.ilp`'s docstring): a mutable working graph, pruning,
dominance, single-strategy folding and leaf/chain elimination, with the bookkeeping
(:class:`Reduction`) that recovers the dropped choices.  Shared by the ILP and the
clustered solver (:mod:`autopar.search.solvers.cluster`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autopar.search.solvers.problem import StrategyProblem


class NoPlanError(Exception):
    """Raised by presolve when forbidden pairs leave node ``node`` without any strategy."""

    def __init__(self, node: int) -> None:
        super().__init__(node)
        self.node = node


# --------------------------------------------------------------------------- presolve graph


class Graph:
    """Mutable working copy of a problem used by presolve.

    Strategies are sliced away in place; ``keep[u]`` always maps the current strategy
    positions of ``u`` to the caller's original indices, so recovery records written in
    original indices stay valid whatever is sliced later.
    """

    def __init__(self, problem: StrategyProblem) -> None:
        self.cost = [np.asarray(c, dtype=np.float64).copy() for c in problem.node_costs]
        self.memory = [np.asarray(m, dtype=np.float64).copy() for m in problem.node_memory]
        self.keep = [np.arange(len(c)) for c in self.cost]
        self.orig_k = [len(c) for c in self.cost]
        self.nbrs: list[dict[int, np.ndarray]] = [{} for _ in self.cost]
        self.alive = [True] * len(self.cost)
        for u, v, mat in problem.edges:
            self.add_edge(u, v, np.asarray(mat, dtype=np.float64))

    def add_edge(self, u: int, v: int, mat: np.ndarray) -> None:
        """Add ``mat`` (shape ``(k_u, k_v)``) to the u-v edge, merging parallel edges."""
        if v in self.nbrs[u]:
            mat = self.nbrs[u][v] + mat
        self.set_edge(u, v, mat)

    def set_edge(self, u: int, v: int, mat: np.ndarray) -> None:
        """Store ``mat`` for u-v and its transpose for v-u."""
        self.nbrs[u][v] = mat
        self.nbrs[v][u] = mat.T

    def remove_node(self, v: int) -> None:
        """Detach ``v`` from the graph."""
        for u in self.nbrs[v]:
            del self.nbrs[u][v]
        self.nbrs[v] = {}
        self.alive[v] = False

    def restrict(self, u: int, mask: np.ndarray) -> None:
        """Keep only the strategies of ``u`` where ``mask`` is true."""
        idx = np.flatnonzero(mask)
        self.cost[u] = self.cost[u][idx]
        self.memory[u] = self.memory[u][idx]
        self.keep[u] = self.keep[u][idx]
        for v, mat in list(self.nbrs[u].items()):
            self.set_edge(u, v, mat[idx, :])

    def alive_nodes(self) -> list[int]:
        """Nodes not yet eliminated, in index order."""
        return [i for i, a in enumerate(self.alive) if a]


@dataclass
class Reduction:
    """Residual problem left after presolve, and how to map its plans back.

    ``residual`` node ``r`` is original node ``nodes[r]``; its strategy ``x`` is original
    strategy ``keep[r][x]``. ``records`` replay eliminated nodes in reverse order;
    ``offset`` / ``memory_offset`` are the constant cost / memory of eliminated nodes that
    no residual variable accounts for.
    """

    residual: StrategyProblem
    nodes: list[int]
    keep: list[np.ndarray]
    num_nodes: int
    records: list[tuple[int, int, int, np.ndarray]] = field(default_factory=list)
    offset: float = 0.0
    memory_offset: float = 0.0

    def recover(self, residual_choice: list[int]) -> list[int]:
        """Original-space plan from a residual plan (replaying eliminations backwards)."""
        choice = [-1] * self.num_nodes
        for r, node in enumerate(self.nodes):
            choice[node] = int(self.keep[r][residual_choice[r]])
        for v, a, b, table in reversed(self.records):
            # table is indexed by the neighbours' original strategy indices.
            if a < 0:
                choice[v] = int(table[()])
            elif b < 0:
                choice[v] = int(table[choice[a]])
            else:
                choice[v] = int(table[choice[a], choice[b]])
        return choice

    def to_residual(self, choice: list[int]) -> list[int] | None:
        """Residual indices of an original plan, or ``None`` if it uses a dropped strategy."""
        out = []
        for r, node in enumerate(self.nodes):
            hit = np.flatnonzero(self.keep[r] == choice[node])
            if hit.size == 0:
                return None
            out.append(int(hit[0]))
        return out


def _fold_single_strategy_nodes(g: Graph, red: Reduction) -> None:
    """Fold every node with one strategy into its neighbours (exact, budget or not)."""
    for v in range(len(g.cost)):
        if not g.alive[v] or len(g.cost[v]) != 1:
            continue
        for u, mat in g.nbrs[v].items():
            # mat is (1, k_u): the only v strategy fixes the resharding cost of each u choice.
            g.cost[u] = g.cost[u] + mat[0, :]
        red.offset += float(g.cost[v][0])
        red.memory_offset += float(g.memory[v][0])
        red.records.append((v, -1, -1, np.array(g.keep[v][0])))
        g.remove_node(v)


def _prune_forbidden(g: Graph) -> None:
    """Drop strategies with inf cost or an all-inf row on some edge, to a fixpoint."""
    queue = deque(g.alive_nodes())
    queued = set(queue)
    while queue:
        u = queue.popleft()
        queued.discard(u)
        if not g.alive[u]:
            continue
        mask = np.isfinite(g.cost[u])
        for mat in g.nbrs[u].values():
            mask &= np.isfinite(mat).any(axis=1)
        if not mask.any():
            raise NoPlanError(u)
        if mask.all():
            continue
        g.restrict(u, mask)
        for v in g.nbrs[u]:
            if v not in queued:
                queue.append(v)
                queued.add(v)


def _dominated(cost: np.ndarray, memory: np.ndarray | None, rows: list[np.ndarray]) -> np.ndarray:
    """Mask of strategies dominated by another one (strictly better or equal and lower index).

    "b dominates a" is a strict partial order, so removing every dominated strategy at once
    keeps, for each removed one, an undominated strategy at least as good.
    """
    k = len(cost)
    feats = [cost[:, None]] + ([memory[:, None]] if memory is not None else []) + rows
    table = np.concatenate(feats, axis=1)  # (k, features); inf entries compare fine
    le = np.all(table[:, None, :] <= table[None, :, :], axis=2)  # le[b, a]: b <= a everywhere
    eq = le & le.T
    lower = np.arange(k)[:, None] < np.arange(k)[None, :]
    dominates = le & (~eq | lower)
    np.fill_diagonal(dominates, False)
    return dominates.any(axis=0)


def _drop_dominated(g: Graph, use_memory: bool) -> None:
    """Remove dominated strategies of every alive node (one pass)."""
    for u in g.alive_nodes():
        if len(g.cost[u]) < 2:
            continue
        rows = [mat for _, mat in sorted(g.nbrs[u].items())]
        drop = _dominated(g.cost[u], g.memory[u] if use_memory else None, rows)
        if drop.any():
            g.restrict(u, ~drop)


def _eliminate_leaf(g: Graph, red: Reduction, v: int) -> None:
    """Degree-0/1 node: choose it as a function of its neighbour and fold the min cost."""
    if not g.nbrs[v]:
        j = int(np.argmin(g.cost[v]))
        red.offset += float(g.cost[v][j])
        red.records.append((v, -1, -1, np.array(g.keep[v][j])))
        g.remove_node(v)
        return
    ((u, mat),) = g.nbrs[v].items()
    total = mat.T + g.cost[v][None, :]  # (k_u, k_v): mat.T is the u->v orientation
    best = np.argmin(total, axis=1)
    table = np.full(g.orig_k[u], -1)
    table[g.keep[u]] = g.keep[v][best]
    g.cost[u] = g.cost[u] + total[np.arange(len(best)), best]
    red.records.append((v, u, -1, table))
    g.remove_node(v)


# elements of one block of the (a, b, v) sums below: ~256 KiB, inside a core's cache
_BLOCK = 1 << 15


def _min_over_middle(av: np.ndarray, vb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each (a, b): the ``v`` minimising ``av[a, v] + vb[v, b]`` (the lowest on ties)
    and that sum.  Summed a block of rows of ``a`` at a time with ``v`` last: the whole
    (a, v, b) array of a 3-axis mesh's chain (116 x 330 x 330 strategies: 100 MB) cost
    ~8x as much, reduced across its middle axis out of cache."""
    ka, (kv, kb) = av.shape[0], vb.shape
    bv = np.ascontiguousarray(vb.T)
    best = np.empty((ka, kb), dtype=np.intp)
    merged = np.empty((ka, kb), dtype=np.result_type(av, vb))
    step = max(1, _BLOCK // max(1, kv * kb))
    for r in range(0, ka, step):
        total = av[r:r + step, None, :] + bv[None, :, :]
        pick = np.argmin(total, axis=2)
        best[r:r + step] = pick
        merged[r:r + step] = np.take_along_axis(total, pick[:, :, None], axis=2)[:, :, 0]
    return best, merged


def _eliminate_chain(g: Graph, red: Reduction, v: int) -> None:
    """Degree-2 node between a and b: replace it by an a-b edge of min-over-v costs."""
    (a, r_va), (b, r_vb) = sorted(g.nbrs[v].items())
    best, merged = _min_over_middle(r_va.T + g.cost[v][None, :], r_vb)
    table = np.full((g.orig_k[a], g.orig_k[b]), -1)
    table[np.ix_(g.keep[a], g.keep[b])] = g.keep[v][best]
    red.records.append((v, a, b, table))
    g.remove_node(v)
    g.add_edge(a, b, merged)


def eliminate(g: Graph, red: Reduction, protected: frozenset[int] | set[int] = frozenset()) -> None:
    """Leaf/chain elimination to a fixpoint, never eliminating ``protected`` nodes;
    exact when memory is unconstrained."""
    queue = deque(u for u in g.alive_nodes() if u not in protected and len(g.nbrs[u]) <= 2)
    while queue:
        v = queue.popleft()
        if not g.alive[v] or len(g.nbrs[v]) > 2:
            continue
        touched = list(g.nbrs[v])
        if len(touched) <= 1:
            _eliminate_leaf(g, red, v)
        else:
            _eliminate_chain(g, red, v)
        queue.extend(u for u in touched
                     if g.alive[u] and u not in protected and len(g.nbrs[u]) <= 2)


def reduce_problem(problem: StrategyProblem, elimination: bool, use_memory: bool) -> Reduction:
    """Run the exact presolve pipeline (see the module docstring); ``elimination``
    only without a memory budget, where it is exact."""
    g = Graph(problem)
    red = Reduction(problem, [], [], problem.num_nodes)
    _prune_forbidden(g)
    _fold_single_strategy_nodes(g, red)
    # A fixed neighbour can forbid some of a node's strategies outright.
    _prune_forbidden(g)
    _drop_dominated(g, use_memory)
    if elimination:
        eliminate(g, red)
        # Folding can make strategies infinitely expensive and create new dominance.
        _prune_forbidden(g)
        _drop_dominated(g, use_memory)
    nodes = g.alive_nodes()
    index = {u: r for r, u in enumerate(nodes)}
    edges = [
        (index[u], index[v], mat) for u in nodes for v, mat in sorted(g.nbrs[u].items()) if u < v
    ]
    budget = problem.memory_budget
    red.residual = StrategyProblem(
        node_costs=[g.cost[u] for u in nodes],
        node_memory=[g.memory[u] for u in nodes],
        edges=edges,
        memory_budget=None if budget is None else budget - red.memory_offset,
        names=None if problem.names is None else [problem.names[u] for u in nodes],
    )
    red.nodes = nodes
    red.keep = [g.keep[u] for u in nodes]
    return red
