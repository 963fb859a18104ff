r"""Exact strategy selection: presolve by elimination, then an Alpa-style MIP.

The model (Alpa intra-op ILP) for a :class:`StrategyProblem` with nodes ``i`` (``k_i``
strategies, costs ``c_i``, memory ``m_i``) and edges ``(u, v)`` with resharding matrices
``R_uv`` is

.. math::

    \min\;& \sum_i c_i^\top s_i + \sum_{(u,v)} \sum_{(a,b) \in F_{uv}} R_{uv}[a,b]\, e_{uv}[a,b] \\
    \text{s.t.}\;& \textstyle\sum_a s_i[a] = 1                 && \forall i \quad\text{(one-hot)} \\
    & \textstyle\sum_{b:(a,b)\in F_{uv}} e_{uv}[a,b] = s_u[a]   && \forall (u,v), a \quad\text{(rows)} \\
    & \textstyle\sum_{a:(a,b)\in F_{uv}} e_{uv}[a,b] = s_v[b]   && \forall (u,v), b \quad\text{(columns)} \\
    & \textstyle\sum_i m_i^\top s_i \le B                        && \text{(memory, if budgeted)} \\
    & s_i \in \{0,1\}^{k_i},\quad e_{uv} \in [0,1]^{F_{uv}}

where ``F_uv = {(a, b) : R_uv[a, b] < inf}``: a forbidden pair simply has no variable, so
the row/column equalities make choosing it infeasible. ``e`` may be continuous: once the
``s`` are one-hot, the row and column sums leave exactly one admissible ``e_uv[a, b] = 1``.

Presolve (every step is exact and records how to recover the dropped choices):

1. *merge* parallel edges (matrices add) and fold nodes with a single strategy into their
   neighbours' costs (their memory becomes a constant);
2. *prune* strategies that cannot appear in any plan (some incident ``R`` row is all inf);
3. *dominance*: drop strategy ``a`` of node ``u`` when another ``b`` has ``c[b] <= c[a]``,
   ``m[b] <= m[a]`` (when budgeted) and ``R_uv[b, :] <= R_uv[a, :]`` on every edge;
4. *elimination* (only without a memory budget, where it is exact): a degree-1 node ``v`` on
   ``u`` folds ``min_j (c_v[j] + R_uv[i, j])`` into ``c_u[i]``; a degree-2 node ``v`` between
   ``a`` and ``b`` becomes the edge ``M[i, l] = min_j (R_av[i, j] + c_v[j] + R_vb[j, l])``.
   On a forest this is the exact tree DP and no MIP is built at all.

With a memory budget the elimination is used on the Lagrangian cost ``c + lam m`` (bisection
on ``lam``) only to produce a feasible incumbent; the full MIP then proves or improves it.
A greedy + local-search incumbent is always available before the MIP starts, so a timeout
still returns a feasible plan; the solver runs in a worker thread and is abandoned at our
own deadline (MIP backends were measured to overrun their limits 2-4x).

Example::

    >>> import numpy as np
    >>> from autopar.solve.problem import StrategyProblem
    >>> p = StrategyProblem([np.array([1.0, 0.0]), np.array([0.0, 1.0])],
    ...                     [np.zeros(2), np.zeros(2)], [(0, 1, np.array([[0.0, 5], [5, 0]]))])
    >>> solve_ilp(p).choice
    [0, 0]
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from autopar.solve.problem import (
    InfeasibleError,
    Solution,
    SolveStatus,
    StrategyProblem,
    evaluate,
    format_bytes,
)

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = ["Backend", "solve_ilp"]

# Largest |objective coefficient| handed to a MIP backend. Costs in seconds can be ~1e-6,
# below the backends' absolute tolerances (HiGHS mip_abs_gap defaults to 1e-6), so the
# objective is rescaled to a range the tolerances are negligible against.
_OBJECTIVE_SCALE_TARGET = 1e3
# Fraction of the remaining time given to a backend: they overrun their own limit, and
# we still have to return by the caller's deadline.
_BACKEND_TIME_SHARE = 0.75
# Lagrangian bisection steps for the budgeted incumbent; 30 halvings of lam are far finer
# than any cost difference that matters, and each step is one cheap elimination pass.
_LAGRANGE_STEPS = 30
_LOCAL_SEARCH_SWEEPS = 20


class Backend(StrEnum):
    """MIP backend names accepted by :func:`solve_ilp`."""

    AUTO = "auto"
    """SCIP: it takes the incumbent as a hint and always reports a bound. HiGHS solved some
    instances faster but found no plan at all within 15 s on others (250-300 nodes x 8)."""
    HIGHS = "highs"
    """HiGHS through OR-Tools' model builder (not highspy: both bundle HiGHS and clash)."""
    SCIP = "scip"
    """SCIP through OR-Tools' model builder."""
    CPSAT = "cpsat"
    """OR-Tools CP-SAT, one worker; suited to small or heavily constrained problems."""


class _NoPlanError(Exception):
    """Raised by presolve when forbidden pairs leave node ``node`` without any strategy."""

    def __init__(self, node: int) -> None:
        super().__init__(node)
        self.node = node


# --------------------------------------------------------------------------- presolve graph


class _Graph:
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
class _Reduction:
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


def _fold_single_strategy_nodes(g: _Graph, red: _Reduction) -> None:
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


def _prune_forbidden(g: _Graph) -> None:
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
            raise _NoPlanError(u)
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


def _drop_dominated(g: _Graph, use_memory: bool) -> None:
    """Remove dominated strategies of every alive node (one pass)."""
    for u in g.alive_nodes():
        if len(g.cost[u]) < 2:
            continue
        rows = [mat for _, mat in sorted(g.nbrs[u].items())]
        drop = _dominated(g.cost[u], g.memory[u] if use_memory else None, rows)
        if drop.any():
            g.restrict(u, ~drop)


def _eliminate_leaf(g: _Graph, red: _Reduction, v: int) -> None:
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


def _eliminate_chain(g: _Graph, red: _Reduction, v: int) -> None:
    """Degree-2 node between a and b: replace it by an a-b edge of min-over-v costs."""
    (a, r_va), (b, r_vb) = sorted(g.nbrs[v].items())
    total = r_va.T[:, :, None] + g.cost[v][None, :, None] + r_vb[None, :, :]
    best = np.argmin(total, axis=1)  # (k_a, k_b), lowest index on ties
    table = np.full((g.orig_k[a], g.orig_k[b]), -1)
    table[np.ix_(g.keep[a], g.keep[b])] = g.keep[v][best]
    merged = np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :]
    red.records.append((v, a, b, table))
    g.remove_node(v)
    g.add_edge(a, b, merged)


def _eliminate(g: _Graph, red: _Reduction, protected: frozenset[int] | set[int] = frozenset()) -> None:
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


def _reduce(problem: StrategyProblem, eliminate: bool, use_memory: bool) -> _Reduction:
    """Run the exact presolve pipeline; see the module docstring for the steps."""
    g = _Graph(problem)
    red = _Reduction(problem, [], [], problem.num_nodes)
    _prune_forbidden(g)
    _fold_single_strategy_nodes(g, red)
    # A fixed neighbour can forbid some of a node's strategies outright.
    _prune_forbidden(g)
    _drop_dominated(g, use_memory)
    if eliminate:
        _eliminate(g, red)
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


# ------------------------------------------------------------------------------ incumbents


def _local_search(problem: StrategyProblem, cost: list[np.ndarray]) -> list[int]:
    """Greedy assignment in index order, then best-response sweeps until stable.

    ``cost`` replaces ``problem.node_costs`` (the Lagrangian passes ``c + lam m``).
    """
    n = problem.num_nodes
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for u, v, mat in problem.edges:
        nbrs[u].append((v, mat))
        nbrs[v].append((u, mat.T))
    choice = [-1] * n

    def best(i: int) -> int:
        total = cost[i].copy()
        for v, mat in nbrs[i]:
            if choice[v] >= 0:
                total += mat[:, choice[v]]
        return int(np.argmin(total))

    for i in range(n):
        choice[i] = best(i)
    for _ in range(_LOCAL_SEARCH_SWEEPS):
        changed = False
        for i in range(n):
            j = best(i)
            if j != choice[i]:
                choice[i], changed = j, True
        if not changed:
            break
    return choice


def _heuristic(problem: StrategyProblem, cost: list[np.ndarray]) -> list[int]:
    """Plan minimising ``cost`` + edges ignoring memory: exact elimination, local search on the rest."""
    weighted = StrategyProblem(cost, problem.node_memory, problem.edges)
    red = _reduce(weighted, eliminate=True, use_memory=False)
    return red.recover(_local_search(red.residual, red.residual.node_costs))


def _lagrangian_incumbent(problem: StrategyProblem, deadline: float) -> list[int] | None:
    """Feasible plan under the budget by bisecting ``lam`` in ``min cost + lam * memory``."""
    budget = problem.memory_budget
    assert budget is not None

    def run(lam: float) -> tuple[list[int], float, float]:
        weighted = [c + lam * m for c, m in zip(problem.node_costs, problem.node_memory)]
        plan = _heuristic(problem, weighted)
        obj, mem = evaluate(problem, plan)
        return plan, obj, mem

    plan, obj, mem = run(0.0)
    if math.isfinite(obj) and mem <= budget:
        return plan
    cost_span = sum(float(np.ptp(c)) for c in problem.node_costs) + 1e-300
    mem_span = sum(float(np.ptp(m)) for m in problem.node_memory) + 1e-300
    lo, hi = 0.0, cost_span / mem_span
    best: tuple[float, list[int]] | None = None
    # Grow lam until memory dominates cost; 4**25 ~ 1e15 covers any byte/cost resolution.
    for _ in range(25):
        if time.monotonic() > deadline:
            break
        plan, obj, mem = run(hi)
        if math.isfinite(obj) and mem <= budget:
            best = (obj, plan)
            break
        lo, hi = hi, hi * 4.0
    if best is None:
        return None
    for _ in range(_LAGRANGE_STEPS):
        if time.monotonic() > deadline:
            break
        mid = 0.5 * (lo + hi)
        plan, obj, mem = run(mid)
        if math.isfinite(obj) and mem <= budget:
            hi = mid
            if obj < best[0]:
                best = (obj, plan)
        else:
            lo = mid
    return _polish_under_budget(problem, best[1])


def _polish_under_budget(problem: StrategyProblem, plan: list[int]) -> list[int]:
    """Best-response sweeps on the true cost that never leave the memory budget.

    The Lagrangian plan overpays wherever ``lam`` is too coarse; single-node moves that
    stay under the budget recover most of that before the MIP starts.
    """
    budget = problem.memory_budget
    assert budget is not None
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(problem.num_nodes)]
    for u, v, mat in problem.edges:
        nbrs[u].append((v, mat))
        nbrs[v].append((u, mat.T))
    start, plan = plan, list(plan)
    memory = evaluate(problem, plan)[1]
    for _ in range(_LOCAL_SEARCH_SWEEPS):
        changed = False
        for i in range(problem.num_nodes):
            total = problem.node_costs[i].copy()
            for v, mat in nbrs[i]:
                total += mat[:, plan[v]]
            mem_i = problem.node_memory[i]
            fits = memory - mem_i[plan[i]] + mem_i <= budget
            total[~fits] = np.inf
            j = int(np.argmin(total))
            if total[j] < total[plan[i]]:
                memory += mem_i[j] - mem_i[plan[i]]
                plan[i], changed = j, True
        if not changed:
            break
    # The running memory total drifts by rounding; never trade the budget for it.
    return plan if evaluate(problem, plan)[1] <= budget else start


# -------------------------------------------------------------------------------- MIP model


@dataclass
class _Layout:
    """Column layout of the MIP: ``s`` of node i is ``s_start[i] : s_start[i] + k_i``;
    edge ``t`` owns columns ``e_cols[t]`` for its finite pairs ``e_pairs[t]``."""

    s_start: np.ndarray
    e_cols: list[np.ndarray]
    e_pairs: list[tuple[np.ndarray, np.ndarray]]
    num_cols: int
    objective: np.ndarray
    scale: float


def _layout(problem: StrategyProblem) -> _Layout:
    """Number the variables and build the (rescaled) objective vector."""
    sizes = np.array([len(c) for c in problem.node_costs])
    s_start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    col = int(sizes.sum())
    e_cols, e_pairs, obj = [], [], [np.concatenate(problem.node_costs)]
    for _, _, mat in problem.edges:
        rows, cols = np.nonzero(np.isfinite(mat))
        e_pairs.append((rows, cols))
        e_cols.append(np.arange(col, col + len(rows)))
        obj.append(mat[rows, cols])
        col += len(rows)
    objective = np.concatenate(obj)
    peak = float(np.max(np.abs(objective))) if objective.size else 0.0
    scale = _OBJECTIVE_SCALE_TARGET / peak if peak > 0 else 1.0
    return _Layout(s_start, e_cols, e_pairs, col, objective * scale, scale)


@dataclass
class _Rows:
    """Sparse constraint rows ``lb <= sum coef * x[var] <= ub`` collected as arrays."""

    rows: list[tuple[np.ndarray, np.ndarray, float, float]] = field(default_factory=list)

    def add(self, var: np.ndarray, coef: np.ndarray, lb: float, ub: float) -> None:
        """Append one row."""
        self.rows.append((np.asarray(var, np.int64), np.asarray(coef, np.float64), lb, ub))


def _one_hot_rows(problem: StrategyProblem, lay: _Layout, out: _Rows) -> None:
    """sum_a s_i[a] = 1 for every node."""
    for i, c in enumerate(problem.node_costs):
        out.add(lay.s_start[i] + np.arange(len(c)), np.ones(len(c)), 1.0, 1.0)


def _edge_rows(problem: StrategyProblem, lay: _Layout, out: _Rows) -> None:
    """Row sums of e_uv equal s_u, column sums equal s_v (absent pairs are forbidden)."""
    for t, (u, v, mat) in enumerate(problem.edges):
        rows, cols = lay.e_pairs[t]
        for side, pos, node in ((rows, 0, u), (cols, 1, v)):
            for a in range(mat.shape[pos]):
                e_vars = lay.e_cols[t][side == a]
                var = np.append(e_vars, lay.s_start[node] + a)
                out.add(var, np.append(np.ones(len(e_vars)), -1.0), 0.0, 0.0)


def _memory_row(problem: StrategyProblem, lay: _Layout, out: _Rows) -> None:
    """sum_i m_i . s_i <= B, normalised by B so feasibility tolerances are relative."""
    budget = problem.memory_budget
    if budget is None:
        return
    mem = np.concatenate(problem.node_memory)
    norm = abs(budget) if budget != 0 else max(1.0, float(np.max(np.abs(mem))))
    out.add(np.arange(len(mem)), mem / norm, -np.inf, budget / norm)


def _choice_from(values: np.ndarray, problem: StrategyProblem, lay: _Layout) -> list[int]:
    """Argmax of each node's one-hot block (values are integral up to tolerance)."""
    return [
        int(np.argmax(values[lay.s_start[i] : lay.s_start[i] + len(c)]))
        for i, c in enumerate(problem.node_costs)
    ]


@dataclass
class _MipResult:
    """What a backend returned: a plan (or None), whether it is optimal, a lower bound."""

    choice: list[int] | None
    optimal: bool
    bound: float | None


def _run_with_deadline(
    target: Callable[[], None], deadline: float, interrupt: Callable[[], None]
) -> bool:
    """Run ``target`` in a daemon thread; return False if it is still running at ``deadline``.

    The backends release the GIL, so the caller keeps its own clock; an overrunning solve is
    asked to stop and then abandoned (it ends at its own, shorter, time limit).
    """
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        interrupt()
        worker.join(0.05)
    return not worker.is_alive()


def _solve_model_builder(
    problem: StrategyProblem, backend: Backend, hint: list[int] | None, deadline: float
) -> _MipResult:
    """Build the MIP from arrays in OR-Tools' model builder and solve with HiGHS or SCIP."""
    from ortools.linear_solver.python import model_builder_helper as mbh

    lay = _layout(problem)
    rows = _Rows()
    _one_hot_rows(problem, lay, rows)
    _edge_rows(problem, lay, rows)
    _memory_row(problem, lay, rows)

    model = mbh.ModelBuilderHelper()
    n_s = int(lay.s_start[-1] + len(problem.node_costs[-1]))
    integral = np.zeros(lay.num_cols, dtype=bool)
    integral[:n_s] = True  # e stays continuous: one-hot s force it integral (module doc)
    model.add_var_array_with_bounds(np.zeros(lay.num_cols), np.ones(lay.num_cols), integral, "x")
    model.set_objective_coefficients(list(range(lay.num_cols)), lay.objective.tolist())
    for var, coef, lb, ub in rows.rows:
        ct = model.add_linear_constraint()
        model.set_constraint_lower_bound(ct, lb)
        model.set_constraint_upper_bound(ct, ub)
        for j, c in zip(var.tolist(), coef.tolist()):
            model.add_term_to_constraint(ct, j, c)
    # OR-Tools 9.15 segfaults when a hint is passed to HiGHS (reproduced on a 2-variable
    # model), so only SCIP gets the incumbent; HiGHS just competes with it afterwards.
    if hint is not None and backend is Backend.SCIP:
        for i, a in enumerate(hint):
            model.add_hint(int(lay.s_start[i] + a), 1.0)

    solver = mbh.ModelSolverHelper("highs" if backend is Backend.HIGHS else "scip")
    limit = max(0.05, _BACKEND_TIME_SHARE * (deadline - time.monotonic()))
    solver.set_time_limit_in_seconds(limit)
    if backend is Backend.HIGHS:
        # Exact optimality (default gaps are 1e-4 relative, 1e-6 absolute), one thread for
        # determinism, silence the banner, and tight feasibility so the memory row holds.
        solver.set_solver_specific_parameters(
            "mip_rel_gap=0\nmip_abs_gap=0\nthreads=1\noutput_flag=false\n"
            "primal_feasibility_tolerance=1e-9\nmip_feasibility_tolerance=1e-9"
        )
    else:
        solver.set_solver_specific_parameters(
            "limits/gap = 0\nlimits/absgap = 0\nnumerics/feastol = 1e-9\nrandomization/randomseedshift = 0"
        )
    if not _run_with_deadline(lambda: solver.solve(model), deadline, solver.interrupt_solve):
        return _MipResult(None, False, None)
    status = solver.status()
    if (
        status not in (mbh.SolveStatus.OPTIMAL, mbh.SolveStatus.FEASIBLE)
        or not solver.has_solution()
    ):
        return _MipResult(None, False, None)
    choice = _choice_from(np.asarray(solver.variable_values()), problem, lay)
    optimal = status == mbh.SolveStatus.OPTIMAL
    bound = solver.best_objective_bound() / lay.scale
    return _MipResult(choice, optimal, bound if math.isfinite(bound) else None)


def _solve_cpsat(problem: StrategyProblem, hint: list[int] | None, deadline: float) -> _MipResult:
    """Same model in CP-SAT (booleans everywhere, memory scaled to integers conservatively)."""
    from ortools.sat.python import cp_model

    lay = _layout(problem)
    model = cp_model.CpModel()
    x = [model.new_bool_var(f"x{j}") for j in range(lay.num_cols)]
    rows = _Rows()
    _one_hot_rows(problem, lay, rows)
    _edge_rows(problem, lay, rows)
    for var, coef, lb, ub in rows.rows:
        model.add(
            cp_model.LinearExpr.weighted_sum([x[j] for j in var], coef.astype(int).tolist())
            == int(lb)
        )
        assert lb == ub
    _cpsat_memory(problem, model, x)
    model.minimize(cp_model.LinearExpr.weighted_sum(x, lay.objective.tolist()))
    if hint is not None:
        for i, a in enumerate(hint):
            for j in range(len(problem.node_costs[i])):
                model.add_hint(x[int(lay.s_start[i]) + j], j == a)
    solver = cp_model.CpSolver()
    # One worker runs the full LP-based search deterministically; linearization 2 gives it
    # the LP relaxation that is nearly integral here (design.md section 4).
    solver.parameters.num_workers = 1
    solver.parameters.linearization_level = 2
    solver.parameters.max_time_in_seconds = max(
        0.05, _BACKEND_TIME_SHARE * (deadline - time.monotonic())
    )
    result: list[int] = []
    if not _run_with_deadline(
        lambda: result.append(solver.solve(model)), deadline, solver.stop_search
    ):
        return _MipResult(None, False, None)
    status = result[0]
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _MipResult(None, False, None)
    values = np.array(
        [solver.value(v) for v in x[: int(lay.s_start[-1]) + len(problem.node_costs[-1])]]
    )
    bound = solver.best_objective_bound / lay.scale
    return _MipResult(
        _choice_from(values, problem, lay),
        status == cp_model.OPTIMAL,
        bound if math.isfinite(bound) else None,
    )


def _cpsat_memory(problem: StrategyProblem, model: cp_model.CpModel, x: list) -> None:
    """Integer memory row: ceil each footprint and floor the budget, so never over budget."""
    from ortools.sat.python import cp_model

    budget = problem.memory_budget
    if budget is None:
        return
    mem = np.concatenate(problem.node_memory)
    # Exact when footprints are whole bytes (the normal case); else ~1e-9 resolution.
    exact = bool(np.all(mem == np.round(mem))) and float(np.abs(mem).sum()) < 2**53
    unit = 1.0 if exact else max(float(np.abs(mem).sum()), abs(budget), 1.0) * 1e-9
    coef = np.ceil(mem / unit - 1e-12).astype(np.int64).tolist()
    model.add(
        cp_model.LinearExpr.weighted_sum(x[: len(mem)], coef) <= math.floor(budget / unit + 1e-12)
    )


# ------------------------------------------------------------------------------- top level


def _resolve_backend(backend: str) -> Backend:
    """Parse ``backend`` and pick a concrete one for ``auto``."""
    try:
        chosen = Backend(backend.lower())
    except ValueError:
        names = ", ".join(b.value for b in Backend)
        raise ValueError(f"unknown backend {backend!r}; expected one of {names}") from None
    return Backend.SCIP if chosen is Backend.AUTO else chosen


def _solve_residual(
    problem: StrategyProblem, backend: Backend, hint: list[int] | None, deadline: float
) -> _MipResult:
    """Dispatch the residual MIP to the chosen backend."""
    if backend is Backend.CPSAT:
        return _solve_cpsat(problem, hint, deadline)
    return _solve_model_builder(problem, backend, hint, deadline)


def _min_memory_problem(problem: StrategyProblem) -> StrategyProblem:
    """Same graph with cost := memory and edges reduced to feasibility (0 or inf)."""
    return StrategyProblem(
        node_costs=[np.asarray(m, dtype=np.float64) for m in problem.node_memory],
        node_memory=[np.zeros(len(m)) for m in problem.node_memory],
        edges=[(u, v, np.where(np.isinf(mat), np.inf, 0.0)) for u, v, mat in problem.edges],
        names=problem.names,
    )


def _no_plan_error(problem: StrategyProblem, node: int) -> InfeasibleError:
    """Error for forbidden pairs that leave no plan at all."""
    return InfeasibleError(
        f"no plan exists: the forbidden resharding pairs leave {problem.name(node)} "
        "without any usable strategy",
        min_memory=math.inf,
    )


def _memory_infeasible(budget: float, min_memory: float, exact: bool) -> InfeasibleError:
    """Error for a budget below the smallest achievable memory."""
    qualifier = "" if exact else " (best found before the time limit)"
    return InfeasibleError(
        f"memory budget {format_bytes(budget)} is infeasible: the smallest plan needs "
        f"{format_bytes(min_memory)}{qualifier}",
        min_memory=min_memory,
    )


def _least_memory_plan(
    residual: StrategyProblem, deadline: float, backend: str
) -> tuple[list[int], float, bool]:
    """Minimum-memory plan of the residual, its memory and whether it is proven minimal.

    Solved by this same function with cost := memory and no budget, where elimination is
    exact, so forests need no MIP.
    """
    least = solve_ilp(
        _min_memory_problem(residual),
        time_limit=max(0.0, deadline - time.monotonic()),
        backend=backend,
    )
    memory = evaluate(residual, least.choice)[1]
    return least.choice, memory, least.status is SolveStatus.OPTIMAL


def _finish(
    problem: StrategyProblem,
    choice: list[int],
    optimal: bool,
    bound: float | None,
    solver: str,
    started: float,
    time_limit: float,
    how: str,
) -> Solution:
    """Assemble the :class:`Solution` with an exact objective, gap and user message."""
    objective, _ = evaluate(problem, choice)
    if optimal:
        gap: float | None = 0.0
        message = f"optimal plan ({how})"
    else:
        gap = None
        if bound is not None:
            gap = max(0.0, (objective - bound) / max(abs(objective), 1e-300))
        gap_text = "gap unknown" if gap is None else f"gap {100 * gap:.1f}%"
        message = f"time limit {time_limit:g} s reached; returning best feasible plan, {gap_text}"
    status = SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE
    return Solution(choice, objective, status, gap, solver, time.monotonic() - started, message)


def solve_ilp(
    problem: StrategyProblem, time_limit: float = 30.0, backend: str = "auto"
) -> Solution:
    """Pick one strategy per node minimising cost under the memory budget.

    Exact presolve (merge, prune, dominance, and without a budget leaf/chain elimination)
    shrinks the graph; a forest is solved outright by the elimination DP. What remains goes
    to the MIP of the module docstring on ``backend`` (``auto``, ``highs``, ``scip``,
    ``cpsat``), seeded with a heuristic incumbent. The call returns by about
    ``time_limit`` seconds: a plan not proven optimal comes back as
    :attr:`SolveStatus.FEASIBLE` with the gap when a bound is known.

    Raises :class:`InfeasibleError` when no plan meets the budget (with the exact minimum
    memory) or the forbidden pairs admit no plan; ``ValueError`` on a malformed problem.
    """
    started = time.monotonic()
    deadline = started + time_limit
    problem.validate()
    chosen = _resolve_backend(backend)
    budget = problem.memory_budget
    try:
        red = _reduce(problem, eliminate=budget is None, use_memory=budget is not None)
    except _NoPlanError as err:
        raise _no_plan_error(problem, err.node) from None
    residual = red.residual

    if residual.num_nodes == 0:
        choice = red.recover([])
        memory = evaluate(problem, choice)[1]
        if budget is not None and memory > budget:
            # Only single-strategy nodes were left: their memory is the minimum.
            raise _memory_infeasible(budget, memory, exact=True)
        return _finish(
            problem,
            choice,
            True,
            None,
            "presolve",
            started,
            time_limit,
            "graph solved exactly by elimination",
        )

    incumbent = _incumbent(residual, started + 0.25 * time_limit)
    if incumbent is None and budget is not None:
        plan, memory, exact = _least_memory_plan(residual, deadline, backend)
        if memory > residual.memory_budget:  # type: ignore[operator]
            raise _memory_infeasible(budget, memory + red.memory_offset, exact)
        incumbent = plan

    result = _solve_residual(residual, chosen, incumbent, deadline)
    best = _better(residual, result.choice, incumbent)
    if best is None:
        # Not proven infeasible: neither the heuristic nor the backend found a plan in time.
        raise TimeoutError(
            f"no plan respecting the forbidden resharding pairs was found within "
            f"{time_limit:g} s; raise time_limit"
        )
    # A proven-optimal MIP plan makes any plan at least as cheap optimal too (the
    # incumbent can win a tie by one ulp of summation order).
    optimal = result.optimal
    bound = None if result.bound is None else result.bound + red.offset
    solver = chosen.value if optimal or best == result.choice else "heuristic"
    how = f"presolve kept {residual.num_nodes}/{problem.num_nodes} nodes, {chosen.value}"
    return _finish(problem, red.recover(best), optimal, bound, solver, started, time_limit, how)


def _incumbent(problem: StrategyProblem, deadline: float) -> list[int] | None:
    """A feasible plan of the residual before any MIP runs, or ``None`` if none was found."""
    if problem.memory_budget is not None:
        return _lagrangian_incumbent(problem, deadline)
    plan = _heuristic(problem, problem.node_costs)
    return plan if math.isfinite(evaluate(problem, plan)[0]) else None


def _better(
    problem: StrategyProblem, first: list[int] | None, second: list[int] | None
) -> list[int] | None:
    """The cheaper feasible of two plans (``first`` on ties, e.g. the proven MIP plan)."""
    budget = problem.memory_budget

    def key(plan: list[int] | None) -> float:
        if plan is None:
            return math.inf
        obj, mem = evaluate(problem, plan)
        return math.inf if budget is not None and mem > budget else obj

    if key(first) == math.inf and key(second) == math.inf:
        return None
    return first if key(first) <= key(second) else second
