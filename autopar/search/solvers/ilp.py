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
own deadline (MIP backends were measured to overrun their limits 2-4x).

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from autopar.search.solvers.bounds import gap as relative_gap
from autopar.search.solvers.bounds import star_bound
from autopar.search.solvers.incumbents import heuristic, lagrangian_incumbent
from autopar.search.solvers.presolve import NoPlanError, reduce_problem
from autopar.search.solvers.problem import (
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
