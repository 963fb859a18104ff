"""Feasible plans before (or instead of) a MIP: greedy + best-response local search,
a Lagrangian incumbent under a memory budget (elimination on ``c + lam m``, bisection on
``lam``) and a polish that trades memory for cost while the budget allows.  A timed-out
search always has one of these to return.
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.search.solvers.presolve import reduce_problem
from autopar.search.solvers.problem import StrategyProblem, evaluate

# Lagrangian bisection steps for the budgeted incumbent; 30 halvings of lam are far finer
# than any cost difference that matters, and each step is one cheap elimination pass.
LAGRANGE_STEPS = 30
LOCAL_SEARCH_SWEEPS = 20


def local_search(problem: StrategyProblem, cost: list[np.ndarray]) -> list[int]:
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
    for _ in range(LOCAL_SEARCH_SWEEPS):
        changed = False
        for i in range(n):
            j = best(i)
            if j != choice[i]:
                choice[i], changed = j, True
        if not changed:
            break
    return choice


def heuristic(problem: StrategyProblem, cost: list[np.ndarray]) -> list[int]:
    """Plan minimising ``cost`` + edges ignoring memory: exact elimination, local search on the rest."""
    weighted = StrategyProblem(cost, problem.node_memory, problem.edges)
    red = reduce_problem(weighted, elimination=True, use_memory=False)
    return red.recover(local_search(red.residual, red.residual.node_costs))


def lagrangian_incumbent(problem: StrategyProblem, deadline: float) -> list[int] | None:
    """Feasible plan under the budget by bisecting ``lam`` in ``min cost + lam * memory``."""
    budget = problem.memory_budget
    assert budget is not None

    def run(lam: float) -> tuple[list[int], float, float]:
        weighted = [c + lam * m for c, m in zip(problem.node_costs, problem.node_memory)]
        plan = heuristic(problem, weighted)
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
    for _ in range(LAGRANGE_STEPS):
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
    return polish_under_budget(problem, best[1])


def polish_under_budget(problem: StrategyProblem, plan: list[int]) -> list[int]:
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
    for _ in range(LOCAL_SEARCH_SWEEPS):
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
