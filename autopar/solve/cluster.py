r"""Repeated-layer clustering: solve a stack of identical layers once, then DP over the chain.

A transformer of ``L`` identical blocks gives a strategy problem of ``L`` copies of the
same subgraph. Each block (a *layer* of :mod:`autopar.layers`, e.g. ``blocks.3``) talks to
the rest of the graph through two nodes only: its *entry* ``p`` (the one node outside the
block that feeds it, the previous block's output) and its *exit* ``o`` (the one node of the
block used outside it). For such a block the internals can be minimised out exactly::

    T[a, b] = min over the block's other nodes of (their costs + edges inside the block
              + edges from p)   given   x_p = a, x_o = b

``T`` is computed by leaf/chain elimination with ``p`` and ``o`` protected (the same exact
DP :mod:`autopar.solve.ilp` uses; a transformer block is series-parallel, so nothing but
``p`` and ``o`` survives), once per *class* of identical blocks, not once per block. The
*reduced problem* keeps every node outside the blocks (embeddings, head, loss), one node per
block exit, and the edge ``(p, o, T)`` per block: a chain of ``L`` nodes that
:func:`~autopar.solve.ilp.solve_ilp` solves exactly by elimination. Replaying the recorded
eliminations for each block's ``(x_p, x_o)`` expands the answer to every node, and the
result is the flat problem's optimum (it is the same DP, only shared between blocks).

Identity is decided twice: an fx-level fingerprint (op sequence, shapes, FLOPs, strategy
lists, local wiring) groups blocks, and the numeric arrays (node costs, memory, every
in-block and entry edge matrix) are compared with the class representative before its
``T`` is reused, so clustering never changes the answer, only the time to reach it.

Memory budget (per-layer accounting through a Lagrangian): memory is a sum over nodes, so
``min cost + lam * memory`` clusters exactly like the cost. Without a budget, or when the
``lam = 0`` optimum fits, the plan is the exact optimum. Otherwise ``lam`` is bisected
(each step is one elimination per class plus a chain DP), the best feasible plan is
polished by budget-respecting single-node moves, and every ``lam`` gives the lower bound
``min(cost + lam * memory) - lam * budget``, so the plan reports a proven gap. When that
gap is not zero and the flat problem is small (:data:`FLAT_MIP_MAX_NODES`), the flat
budgeted MIP gets the remaining time and the better plan wins.

Example::

    >>> from autopar.solve.cluster import find_clusters, solve_clustered
    >>> # clusters = find_clusters(gm, nodes, strategies, problem)   # None: nothing repeats
    >>> # solution = solve_clustered(problem, clusters, time_limit=30.0)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import fx

from autopar.ir import info, tensor_inputs
from autopar.layers import Layer, layers
from autopar.rules import OpStrategy
from autopar.solve.bounds import gap as gap_to
from autopar.solve.bounds import star_bound
from autopar.solve.ilp import solve_ilp
from autopar.solve.incumbents import LAGRANGE_STEPS, polish_under_budget
from autopar.solve.presolve import Graph, NoPlanError, Reduction, eliminate, reduce_problem
from autopar.solve.problem import (
    InfeasibleError,
    Solution,
    SolveStatus,
    StrategyProblem,
    evaluate,
    format_bytes,
)

__all__ = [
    "FLAT_MIP_MAX_NODES",
    "MAX_SIDE_LAYOUTS",
    "STOP_GAP",
    "Block",
    "Clustering",
    "find_clusters",
    "shared_pricing",
    "solve_clustered",
]

MAX_SIDE_LAYOUTS = 256
"""Most joint layouts of the shared side inputs the clustered solver conditions on (each
costs one transfer per class and one chain solve; 25-100 is typical of a mask on a 2-D mesh)."""

FLAT_MIP_MAX_NODES = 600
"""Largest flat problem that still gets the budgeted MIP after a Lagrangian gap: above it
the MIP was measured to find nothing better within the limit (design.md section 4)."""
STOP_GAP = 1e-3
"""Proven relative gap at which the Lagrangian bisection stops: further steps could win at
most 0.1% of the step time, and each costs one solve per side-input layout."""
# Relative gap under which the Lagrangian plan is reported optimal (float summation noise).
_OPTIMAL_GAP = 1e-9


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


# ------------------------------------------------------------------------------ detection


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
    of the edges into it) are then the twin's, so :func:`autopar.search.build_problem`
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


# ------------------------------------------------------------------------------ transfer


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


# ------------------------------------------------------------------------------ one lam


@dataclass
class _LamResult:
    """The exact minimiser of ``cost + lam * memory`` and its value."""

    choice: list[int]
    value: float
    optimal: bool
    solver: str


class _NotClusterable(Exception):
    """A block is not series-parallel between its entry and exit."""


def _solve_weighted(problem: StrategyProblem, cl: Clustering, twins: list[int],
                    cost: list[np.ndarray], time_limit: float) -> _LamResult:
    """Minimise ``sum cost + edges`` (no budget) exactly: the least over every joint layout
    of the side inputs of the reduced problem solved with that layout fixed.

    Each layout's reduced problem is first bounded from below (exact chain elimination,
    then the star bound of what is left: within 0.1% of its optimum on an HF Llama) and
    the layouts are solved cheapest bound first; one whose bound is above the best value
    found cannot win and is not solved. The answer is the one solving every layout gives:
    the least value, the first layout in product order on ties."""
    deadline = time.monotonic() + time_limit
    staged = []
    for idx, layout in enumerate(itertools.product(*_side_layouts(problem, cl.sides, cost))):
        fixed = dict(zip(cl.sides, layout))
        reduced, transfers = _reduced_problem(problem, cl, twins, cost, fixed)
        staged.append((_reduced_bound(reduced), idx, fixed, reduced, transfers))
    staged.sort(key=lambda t: (t[0], t[1]))
    best: tuple[float, int, _LamResult] | None = None
    optimal = True  # a layout not solved to optimality may hide a better plan
    for bound, idx, fixed, reduced, transfers in staged:
        # rounding slack: a bound is summed in another order than the value it bounds
        if best is not None and bound > best[0] + 1e-9 * abs(best[0]):
            break  # sorted: every layout left is bounded above the best value as well
        left = max(1.0, deadline - time.monotonic())
        res = _solve_reduced(problem, cl, reduced, transfers, fixed, left)
        optimal &= res.optimal
        if best is None or (res.value, idx) < best[:2]:
            best = (res.value, idx, res)
    assert best is not None
    return dataclasses.replace(best[2], optimal=optimal)


def _reduced_bound(reduced: StrategyProblem) -> float:
    """A lower bound on ``reduced``'s optimum: elimination (exact without a budget) and
    the star bound of the residual; ``inf`` when the layout admits no plan."""
    try:
        red = reduce_problem(reduced, elimination=True, use_memory=False)
    except NoPlanError:
        return math.inf
    return star_bound(red.residual) + red.offset


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


def _solve_reduced(problem: StrategyProblem, cl: Clustering, reduced: StrategyProblem,
                   transfers: list[_Transfer], fixed: dict[int, int],
                   time_limit: float) -> _LamResult:
    """Solve one layout's reduced problem and expand the answer to every node."""
    red_index = _reduced_index(cl)
    sol = solve_ilp(reduced, time_limit=time_limit)
    choice = [-1] * problem.num_nodes
    for u in cl.kept:
        choice[u] = fixed.get(u, sol.choice[red_index[u]])
    for b, tr in zip(cl.blocks, transfers):
        a, o = sol.choice[red_index[b.entry]], sol.choice[red_index[b.exit_node]]
        local = tr.reduction.recover([a, o])
        for j, u in enumerate(b.nodes):
            choice[u] = local[j + 1]
    value = evaluate(reduced, sol.choice)[0]
    return _LamResult(choice, value, sol.status is SolveStatus.OPTIMAL, sol.solver)


# ------------------------------------------------------------------------------ driver


def solve_clustered(problem: StrategyProblem, clusters: Clustering,
                    time_limit: float = 30.0) -> Solution | None:
    """Solve ``problem`` exploiting ``clusters`` (see the module docstring).

    Returns the same :class:`Solution` as :func:`~autopar.solve.ilp.solve_ilp`: the exact
    optimum when the memory budget does not bind, otherwise the best Lagrangian (or flat
    MIP) plan with its proven gap. Returns ``None`` when a block is not series-parallel
    between its entry and exit (the caller then solves the flat problem). Raises
    :class:`InfeasibleError` when no plan fits the budget.
    """
    started = time.monotonic()
    deadline = started + time_limit
    problem.validate()
    budget = problem.memory_budget
    what = clusters.describe()
    try:
        twins = _twins(problem, clusters)
        first = _solve_weighted(problem, clusters, twins,
                                [np.asarray(c, float) for c in problem.node_costs],
                                time_limit)
    except _NotClusterable:
        return None
    obj, mem = evaluate(problem, first.choice)
    if not math.isfinite(obj):
        raise InfeasibleError("no plan exists: the forbidden resharding pairs leave no plan",
                              min_memory=math.inf)
    if budget is None or mem <= budget:
        status = SolveStatus.OPTIMAL if first.optimal else SolveStatus.FEASIBLE
        note = "" if budget is None else "; fits the memory budget"
        # a layout the time limit cut short: the plan's gap from the star bound instead
        return Solution(first.choice, obj, status,
                        0.0 if first.optimal else gap_to(obj, star_bound(problem)),
                        f"cluster/{first.solver}", time.monotonic() - started,
                        f"{'optimal' if first.optimal else 'feasible'} plan ({what}){note}")
    return _budgeted(problem, clusters, twins, first, started, deadline, what)


def _close(a, b) -> bool:
    """Two (cost, memory) pairs equal up to float summation order."""
    return all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b))


def _mix_blocks(problem: StrategyProblem, cl: Clustering, fits: list[int],
                over: list[int]) -> list[int]:
    """Move whole blocks from the plan that fits to the cheaper one that does not, while
    the budget allows: the Lagrangian only reaches plans where every block of a class
    makes the same trade, the budgeted optimum often mixes the two sides of ``lam*``."""
    budget = problem.memory_budget
    assert budget is not None
    plan = list(fits)
    obj, _ = evaluate(problem, plan)
    for b in cl.blocks:
        trial = list(plan)
        for u in b.nodes:
            trial[u] = over[u]
        t_obj, t_mem = evaluate(problem, trial)
        if t_mem <= budget and t_obj < obj:
            plan, obj = trial, t_obj
    return plan


def _budgeted(problem: StrategyProblem, cl: Clustering, twins: list[int], first: _LamResult,
              started: float, deadline: float, what: str) -> Solution:
    """Lagrangian bisection on ``lam`` (see the module docstring), then polish and gap."""
    budget = problem.memory_budget
    assert budget is not None
    costs = [np.asarray(c, float) for c in problem.node_costs]
    mems = [np.asarray(m, float) for m in problem.node_memory]

    def run(lam: float) -> tuple[_LamResult, float, float]:
        left = max(1.0, deadline - time.monotonic())
        res = _solve_weighted(problem, cl, twins, [c + lam * m for c, m in zip(costs, mems)], left)
        obj, mem = evaluate(problem, res.choice)
        return res, obj, mem

    # the least-memory plan first: it decides feasibility exactly (cost := memory, edges
    # only forbid pairs), as in solve_ilp
    memory_only = StrategyProblem(problem.node_costs, problem.node_memory,
                                  [(u, v, np.where(np.isinf(m), np.inf, 0.0))
                                   for u, v, m in problem.edges])
    least = _solve_weighted(memory_only, cl, twins, mems, max(1.0, deadline - time.monotonic()))
    least_mem = evaluate(problem, least.choice)[1]
    if least_mem > budget:
        raise InfeasibleError(
            f"memory budget {format_bytes(budget)} is infeasible: the smallest plan needs "
            f"{format_bytes(least_mem)}", min_memory=least_mem)
    lower = first.value if first.optimal else -math.inf  # lam = 0 bound
    best_choice, best_obj = least.choice, evaluate(problem, least.choice)[0]
    cost_span = sum(float(np.ptp(c)) for c in costs) + 1e-300
    mem_span = sum(float(np.ptp(m)) for m in mems) + 1e-300
    lo, hi = 0.0, cost_span / mem_span
    def probe(lam: float) -> tuple[bool, list[int], float, float]:
        """Solve at weight ``lam``: tighten the bound, keep the best plan that fits."""
        nonlocal lower, best_choice, best_obj
        res, obj, mem = run(lam)
        if res.optimal:
            lower = max(lower, res.value - lam * budget)
        fits = mem <= budget
        if fits and obj < best_obj:
            best_choice, best_obj = res.choice, obj
        return fits, res.choice, obj, mem

    found = False
    fit_at = (math.inf, math.inf)  # (cost, memory) of the plan found at hi
    for _ in range(40):  # grow lam until the plan fits (4**40 covers any unit ratio)
        if time.monotonic() > deadline:
            break
        found, _choice, *fit_at = probe(hi)
        if found:
            break
        lo, hi = hi, hi * 4.0
    over = first.choice  # the cheapest plan that does not fit, nearest to lam*
    over_at = evaluate(problem, over)
    for _ in range(LAGRANGE_STEPS if found else 0):
        if time.monotonic() > deadline or best_obj - lower <= STOP_GAP * abs(best_obj):
            break
        # where the two plans' weighted costs cross: if nothing beats them there, that
        # weight is the dual optimum (the bound cannot rise) and the search is over
        cross = (fit_at[0] - over_at[0]) / max(over_at[1] - fit_at[1], 1e-300)
        at_cross = lo < cross < hi
        mid = cross if at_cross else 0.5 * (lo + hi)
        fits, choice, *seen = probe(mid)
        if at_cross and any(_close(seen, known) for known in (fit_at, over_at)):
            break
        if fits:
            hi, fit_at = mid, seen
        else:
            lo, over, over_at = mid, choice, seen
    best_choice = _mix_blocks(problem, cl, best_choice, over)
    best_choice = polish_under_budget(problem, best_choice)
    best_obj = evaluate(problem, best_choice)[0]
    solver = "cluster/lagrangian"
    lower = max(lower, star_bound(problem))  # known even when no Lagrangian solve finished
    gap = gap_to(best_obj, lower)
    how = "Lagrangian over clustered layers"
    if (gap is None or gap > _OPTIMAL_GAP) and problem.num_nodes <= FLAT_MIP_MAX_NODES \
            and deadline - time.monotonic() > 1.0:
        flat = solve_ilp(problem, time_limit=deadline - time.monotonic())
        if flat.objective < best_obj and evaluate(problem, flat.choice)[1] <= budget:
            best_choice, best_obj, solver = flat.choice, flat.objective, flat.solver
            how = "flat budgeted MIP after the clustered Lagrangian"
        if flat.status is SolveStatus.OPTIMAL:
            lower = max(lower, flat.objective)
        elif flat.gap is not None:
            lower = max(lower, flat.objective * (1.0 - flat.gap))
        gap = gap_to(best_obj, lower)
    optimal = gap is not None and gap <= _OPTIMAL_GAP
    gap_text = "gap unknown" if gap is None else f"gap {100 * gap:.2f}%"
    message = (f"{'optimal' if optimal else 'feasible'} plan under the memory budget ({what}; "
               f"{how}; {gap_text})")
    return Solution(best_choice, best_obj, SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE,
                    0.0 if optimal else gap, solver, time.monotonic() - started, message)
