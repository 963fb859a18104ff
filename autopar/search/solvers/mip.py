r"""The MIP of :mod:`autopar.search.solvers.ilp` (its module docstring states the model),
built from arrays and solved by one backend under our own deadline: HiGHS or SCIP
through OR-Tools' model builder, or CP-SAT."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

from autopar.search.solvers.problem import StrategyProblem

if TYPE_CHECKING:
    from ortools.sat.python import cp_model


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
class MipResult:
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


def solve_model_builder(
    problem: StrategyProblem, backend: Backend, hint: list[int] | None, deadline: float
) -> MipResult:
    """Build the MIP from arrays in OR-Tools' model builder and solve with HiGHS or SCIP."""
    # start-up: ortools' model builder costs ~0.1-0.3 s to import
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
        return MipResult(None, False, None)
    status = solver.status()
    if (
        status not in (mbh.SolveStatus.OPTIMAL, mbh.SolveStatus.FEASIBLE)
        or not solver.has_solution()
    ):
        return MipResult(None, False, None)
    choice = _choice_from(np.asarray(solver.variable_values()), problem, lay)
    optimal = status == mbh.SolveStatus.OPTIMAL
    bound = solver.best_objective_bound() / lay.scale
    return MipResult(choice, optimal, bound if math.isfinite(bound) else None)


def solve_cpsat(problem: StrategyProblem, hint: list[int] | None, deadline: float) -> MipResult:
    """Same model in CP-SAT (booleans everywhere, memory scaled to integers conservatively)."""
    from ortools.sat.python import cp_model  # start-up: ortools' CP-SAT costs ~1.3 s to import

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
    # the LP relaxation that is nearly integral here.
    solver.parameters.num_workers = 1
    solver.parameters.linearization_level = 2
    solver.parameters.max_time_in_seconds = max(
        0.05, _BACKEND_TIME_SHARE * (deadline - time.monotonic())
    )
    result: list[int] = []
    if not _run_with_deadline(
        lambda: result.append(solver.solve(model)), deadline, solver.stop_search
    ):
        return MipResult(None, False, None)
    status = result[0]
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return MipResult(None, False, None)
    values = np.array(
        [solver.value(v) for v in x[: int(lay.s_start[-1]) + len(problem.node_costs[-1])]]
    )
    bound = solver.best_objective_bound / lay.scale
    return MipResult(
        _choice_from(values, problem, lay),
        status == cp_model.OPTIMAL,
        bound if math.isfinite(bound) else None,
    )


def _cpsat_memory(problem: StrategyProblem, model: cp_model.CpModel, x: list) -> None:
    """Integer memory row: ceil each footprint and floor the budget, so never over budget."""
    from ortools.sat.python import cp_model  # start-up: ortools' CP-SAT costs ~1.3 s to import

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


__all__ = ["Backend", "MipResult", "solve_cpsat", "solve_model_builder"]
