"""The clustered solver's reduced problem: each block's transfer table between its entry
and exit, and the reduced chain problem built from them for one side-input layout.

This is the exact elimination part of the clustered solve; it is separate from the
Lagrangian driver (:mod:`autopar.search.solvers.cluster`), which calls it once per weight and
side-input layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.search.solvers.cluster_detect import Block, Clustering
from autopar.search.solvers.presolve import Graph, Reduction, eliminate
from autopar.search.solvers.problem import StrategyProblem


@dataclass
class _Transfer:
    """``table[a, b]``: least cost of a block's internals with entry ``a`` and exit ``b``;
    ``reduction`` replays the eliminations to recover the internal choices."""

    table: np.ndarray
    reduction: Reduction
    exit_local: int


def _local_problem(problem: StrategyProblem, block: Block, cost: list[np.ndarray],
                   fixed: dict[int, int]) -> StrategyProblem:
    """The block with its entry as local node 0 (zero cost: it belongs elsewhere); an edge
    from a side input, whose strategy ``fixed`` gives, becomes a cost on its consumer."""
    pos = {u: j + 1 for j, u in enumerate(block.nodes)}
    pos[block.entry] = 0
    k0 = len(problem.node_costs[block.entry])
    costs = [np.zeros(k0)] + [cost[u] for u in block.nodes]
    edges = []
    for e in block.edges:
        u, v, m = problem.edges[e]
        if u in fixed:
            costs[pos[v]] = costs[pos[v]] + m[fixed[u]]
        else:
            edges.append((pos[u], pos[v], m))
    mems = [np.zeros(len(c)) for c in costs]
    return StrategyProblem(costs, mems, edges)


def _same(problem: StrategyProblem, a: Block, b: Block) -> bool:
    """Numeric identity of two blocks of one class (costs, memory, edges, entry width):
    then they have the same transfer at every weight and side-input layout."""
    if len(problem.node_costs[a.entry]) != len(problem.node_costs[b.entry]):
        return False
    for table in (problem.node_costs, problem.node_memory):
        for u, v in zip(a.nodes, b.nodes):
            if table[u] is not table[v] and not np.array_equal(table[u], table[v]):
                return False
    for e, f in zip(a.edges, b.edges):
        ma, mb = problem.edges[e][2], problem.edges[f][2]
        if ma is not mb and not np.array_equal(ma, mb):
            return False
    return True


def _transfer(local: StrategyProblem, exit_local: int) -> _Transfer | None:
    """Eliminate every node but the entry (0) and ``exit_local``; None if that gets stuck."""
    g = Graph(local)
    red = Reduction(local, [], [], local.num_nodes)
    protected = {0, exit_local}
    eliminate(g, red, protected)
    if set(g.alive_nodes()) != protected:
        return None  # not series-parallel between entry and exit: no 2-terminal transfer
    table = g.cost[0][:, None] + g.cost[exit_local][None, :] + red.offset
    if exit_local in g.nbrs[0]:
        table = table + g.nbrs[0][exit_local]
    red.nodes = [0, exit_local]
    red.keep = [g.keep[0], g.keep[exit_local]]
    return _Transfer(table, red, exit_local)


def _twins(problem: StrategyProblem, cl: Clustering) -> list[int]:
    """For each block, the first block numerically identical to it (itself if none):
    one transfer is computed per distinct block, checked once per solve."""
    reps: dict[int, list[int]] = {}
    out = []
    for i, b in enumerate(cl.blocks):
        same = [r for r in reps.get(b.cls, []) if _same(problem, cl.blocks[r], b)]
        if same:
            out.append(same[0])
        else:
            reps.setdefault(b.cls, []).append(i)
            out.append(i)
    return out


class _NotClusterable(Exception):
    """A block is not series-parallel between its entry and exit."""


def _side_layouts(problem: StrategyProblem, sides: tuple[int, ...],
                  cost: list[np.ndarray]) -> list[list[int]]:
    """Per side input, the strategies worth conditioning on: a strategy is dropped when
    another one costs no more (weighted cost) and no more on every edge it is part of,
    since swapping it in never makes a plan worse. Exact only for sides not joined by an
    edge to another side; those keep every strategy."""
    side_set = set(sides)
    rows: dict[int, list[np.ndarray]] = {u: [cost[u][:, None]] for u in sides}
    joined: set[int] = set()
    for u, v, m in problem.edges:
        if u in side_set and v in side_set:
            joined.update((u, v))
        elif u in side_set:
            rows[u].append(m)
        elif v in side_set:
            rows[v].append(m.T)
    out = []
    for u in sides:
        k = len(cost[u])
        if u in joined or k == 1:
            out.append(list(range(k)))
            continue
        profile = np.concatenate(rows[u], axis=1)  # (k, everything strategy k pays)
        keep = []
        for i in range(k):
            dominated = False
            for j in range(k):
                if j == i or not np.all(profile[j] <= profile[i]):
                    continue
                # strictly better somewhere, or equal and earlier: one of twins survives
                if np.any(profile[j] < profile[i]) or j < i:
                    dominated = True
                    break
            if not dominated:
                keep.append(i)
        out.append(keep)
    return out


def _reduced_problem(problem: StrategyProblem, cl: Clustering, twins: list[int],
                     cost: list[np.ndarray], fixed: dict[int, int]
                     ) -> tuple[StrategyProblem, list[_Transfer]]:
    """The reduced problem with the side inputs' strategies ``fixed`` (each distinct block
    a transfer table between its entry and exit), and each block's transfer."""
    distinct: dict[int, _Transfer] = {}
    for i, b in enumerate(cl.blocks):
        if twins[i] == i:
            tr = _transfer(_local_problem(problem, b, cost, fixed), b.exit + 1)
            if tr is None:
                raise _NotClusterable(b.key)
            distinct[i] = tr
    transfers = [distinct[twins[i]] for i in range(len(cl.blocks))]
    red_index = _reduced_index(cl)

    def width(u: int) -> slice:
        """The strategies node ``u`` may take: one when it is a fixed side input."""
        return slice(fixed[u], fixed[u] + 1) if u in fixed else slice(None)

    costs = [cost[u][width(u)] for u in cl.kept] + [np.zeros(len(cost[b.exit_node]))
                                                    for b in cl.blocks]
    owned = set()
    for b in cl.blocks:
        owned.update(b.edges)
    edges = [(red_index[u], red_index[v], m[width(u), width(v)])
             for e, (u, v, m) in enumerate(problem.edges) if e not in owned]
    edges += [(red_index[b.entry], red_index[b.exit_node], tr.table[width(b.entry)])
              for b, tr in zip(cl.blocks, transfers)]
    return StrategyProblem(costs, [np.zeros(len(c)) for c in costs], edges), transfers


def _reduced_index(cl: Clustering) -> dict[int, int]:
    """Where each kept node and each block's exit sits in the reduced problem."""
    red_index = {u: r for r, u in enumerate(cl.kept)}
    for b in cl.blocks:
        red_index[b.exit_node] = len(red_index)
    return red_index


