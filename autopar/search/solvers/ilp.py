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

Presolve (:mod:`autopar.search.solvers.presolve`; every step is exact and records how to recover
the dropped choices):

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
A greedy + local-search incumbent (:mod:`autopar.search.solvers.incumbents`) is always available before the MIP starts, so a timeout
still returns a feasible plan; the solver runs in a worker thread and is abandoned at our
own deadline (MIP backends were measured to overrun their limits 2-4x): the model and
its backends are :mod:`autopar.search.solvers.mip`.

Example::

    >>> import numpy as np
    >>> from autopar.search.solvers.problem import StrategyProblem
    >>> p = StrategyProblem([np.array([1.0, 0.0]), np.array([0.0, 1.0])],
    ...                     [np.zeros(2), np.zeros(2)], [(0, 1, np.array([[0.0, 5], [5, 0]]))])
    >>> solve_ilp(p).choice
    [0, 0]
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.search.solvers.bounds import gap as relative_gap
from autopar.search.solvers.bounds import star_bound
from autopar.search.solvers.incumbents import heuristic, lagrangian_incumbent
from autopar.search.solvers.mip import Backend, MipResult, solve_cpsat, solve_model_builder
from autopar.search.solvers.presolve import NoPlanError, reduce_problem
from autopar.search.solvers.problem import (
    InfeasibleError,
    Solution,
    SolveStatus,
    StrategyProblem,
    evaluate,
    format_bytes,
)

__all__ = ["solve_ilp"]

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
) -> MipResult:
    """Dispatch the residual MIP to the chosen backend."""
    if backend is Backend.CPSAT:
        return solve_cpsat(problem, hint, deadline)
    return solve_model_builder(problem, backend, hint, deadline)


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
        gap = None if bound is None else relative_gap(objective, bound)
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
        red = reduce_problem(problem, elimination=budget is None, use_memory=budget is not None)
    except NoPlanError as err:
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
    # the MIP's own bound, or the star bound of the residual when the MIP has none (it
    # ran out of time before its root LP, or lost to the incumbent): a plan not proven
    # optimal still says how far from optimal it can be
    star = star_bound(residual) + red.offset
    bound = star if result.bound is None else max(result.bound + red.offset, star)
    solver = chosen.value if optimal or best == result.choice else "heuristic"
    how = f"presolve kept {residual.num_nodes}/{problem.num_nodes} nodes, {chosen.value}"
    return _finish(problem, red.recover(best), optimal, bound, solver, started, time_limit, how)


def _incumbent(problem: StrategyProblem, deadline: float) -> list[int] | None:
    """A feasible plan of the residual before any MIP runs, or ``None`` if none was found."""
    if problem.memory_budget is not None:
        return lagrangian_incumbent(problem, deadline)
    plan = heuristic(problem, problem.node_costs)
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
