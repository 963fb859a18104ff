r"""Repeated-layer clustering: solve a stack of identical layers once, then DP over the chain.

A transformer of ``L`` identical blocks gives a strategy problem of ``L`` copies of the
same subgraph. Each block (a *layer* of :mod:`autopar.capture.layers`, e.g. ``blocks.3``) talks to
the rest of the graph through two nodes only: its *entry* ``p`` (the one node outside the
block that feeds it, the previous block's output) and its *exit* ``o`` (the one node of the
block used outside it). For such a block the internals can be minimised out exactly::

    T[a, b] = min over the block's other nodes of (their costs + edges inside the block
              + edges from p)   given   x_p = a, x_o = b

``T`` is computed by leaf/chain elimination with ``p`` and ``o`` protected (the same exact
DP :mod:`autopar.search.solvers.ilp` uses; a transformer block is series-parallel, so nothing but
``p`` and ``o`` survives), once per *class* of identical blocks, not once per block. The
*reduced problem* keeps every node outside the blocks (embeddings, head, loss), one node per
block exit, and the edge ``(p, o, T)`` per block: a chain of ``L`` nodes that
:func:`~autopar.search.solvers.ilp.solve_ilp` solves exactly by elimination. Replaying the recorded
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

This module holds the solve (one weight, the Lagrangian driver); detection is in
:mod:`autopar.search.solvers.cluster_detect` and the per-block transfers and reduced problem in
:mod:`autopar.search.solvers.cluster_transfer`.

Example::

    >>> from autopar.search.solvers.cluster import solve_clustered
    >>> from autopar.search.solvers.cluster_detect import find_clusters
    >>> # clusters = find_clusters(gm, nodes, strategies, problem)   # None: nothing repeats
    >>> # solution = solve_clustered(problem, clusters, time_limit=30.0)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from autopar.search.solvers.bounds import gap as gap_to
from autopar.search.solvers.bounds import star_bound
from autopar.search.solvers.cluster_detect import Clustering
from autopar.search.solvers.cluster_transfer import (
    _NotClusterable,
    _reduced_index,
    _reduced_problem,
    _side_layouts,
    _Transfer,
    _twins,
)
from autopar.search.solvers.ilp import solve_ilp
from autopar.search.solvers.incumbents import LAGRANGE_STEPS, polish_under_budget
from autopar.search.solvers.presolve import NoPlanError, reduce_problem
from autopar.search.solvers.problem import (
    InfeasibleError,
    Solution,
    SolveStatus,
    StrategyProblem,
    evaluate,
    format_bytes,
)

__all__ = ["FLAT_MIP_MAX_NODES", "STOP_GAP", "solve_clustered"]

FLAT_MIP_MAX_NODES = 600
"""Largest flat problem that still gets the budgeted MIP after a Lagrangian gap: above it
the MIP was measured to find nothing better within the limit."""
STOP_GAP = 1e-3
"""Proven relative gap at which the Lagrangian bisection stops: further steps could win at
most 0.1% of the step time, and each costs one solve per side-input layout."""
# Relative gap under which the Lagrangian plan is reported optimal (float summation noise).
_OPTIMAL_GAP = 1e-9


# ------------------------------------------------------------------------------ one lam


@dataclass
class _LamResult:
    """The exact minimiser of ``cost + lam * memory`` and its value."""

    choice: list[int]
    value: float
    optimal: bool
    solver: str


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

    Returns the same :class:`Solution` as :func:`~autopar.search.solvers.ilp.solve_ilp`: the exact
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
    least = _least_memory(problem, cl, twins, mems, deadline, budget)
    lg = _Lagrangian(problem, cl, twins, costs, mems, deadline, budget,
                     lower=first.value if first.optimal else -math.inf,  # lam = 0 bound
                     best_choice=least.choice, best_obj=evaluate(problem, least.choice)[0])
    over = _bisect(lg, first)
    best_choice = _mix_blocks(problem, cl, lg.best_choice, over)
    best_choice = polish_under_budget(problem, best_choice)
    lower = max(lg.lower, star_bound(problem))  # known even when no Lagrangian solve finished
    return _budgeted_solution(problem, best_choice, lower, started, deadline, what)


def _least_memory(problem: StrategyProblem, cl: Clustering, twins: list[int],
                  mems: list[np.ndarray], deadline: float, budget: float) -> _LamResult:
    """The least-memory plan: it decides feasibility exactly (cost := memory, edges only
    forbid pairs), as in solve_ilp.  Raises :class:`InfeasibleError` when it does not
    fit ``budget``."""
    memory_only = StrategyProblem(problem.node_costs, problem.node_memory,
                                  [(u, v, np.where(np.isinf(m), np.inf, 0.0))
                                   for u, v, m in problem.edges])
    least = _solve_weighted(memory_only, cl, twins, mems, max(1.0, deadline - time.monotonic()))
    least_mem = evaluate(problem, least.choice)[1]
    if least_mem > budget:
        raise InfeasibleError(
            f"memory budget {format_bytes(budget)} is infeasible: the smallest plan needs "
            f"{format_bytes(least_mem)}", min_memory=least_mem)
    return least


@dataclass
class _Lagrangian:
    """The bisection's state: the proven lower bound and the best plan that fits so far."""

    problem: StrategyProblem
    cl: Clustering
    twins: list[int]
    costs: list[np.ndarray]
    mems: list[np.ndarray]
    deadline: float
    budget: float
    lower: float
    best_choice: list[int]
    best_obj: float

    def probe(self, lam: float) -> tuple[bool, list[int], float, float]:
        """Solve at weight ``lam``: tighten the bound, keep the best plan that fits;
        whether it fits, the plan, its cost and memory."""
        left = max(1.0, self.deadline - time.monotonic())
        res = _solve_weighted(self.problem, self.cl, self.twins,
                              [c + lam * m for c, m in zip(self.costs, self.mems)], left)
        obj, mem = evaluate(self.problem, res.choice)
        if res.optimal:
            self.lower = max(self.lower, res.value - lam * self.budget)
        fits = mem <= self.budget
        if fits and obj < self.best_obj:
            self.best_choice, self.best_obj = res.choice, obj
        return fits, res.choice, obj, mem


def _bisect(lg: _Lagrangian, first: _LamResult) -> list[int]:
    """Grow ``lam`` until its plan fits, then bisect between the plan that fits and the
    cheapest that does not; returns the latter, nearest to ``lam*``."""
    cost_span = sum(float(np.ptp(c)) for c in lg.costs) + 1e-300
    mem_span = sum(float(np.ptp(m)) for m in lg.mems) + 1e-300
    lo, hi = 0.0, cost_span / mem_span
    found = False
    fit_at = (math.inf, math.inf)  # (cost, memory) of the plan found at hi
    for _ in range(40):  # grow lam until the plan fits (4**40 covers any unit ratio)
        if time.monotonic() > lg.deadline:
            break
        found, _choice, *fit_at = lg.probe(hi)
        if found:
            break
        lo, hi = hi, hi * 4.0
    over = first.choice  # the cheapest plan that does not fit, nearest to lam*
    over_at = evaluate(lg.problem, over)
    for _ in range(LAGRANGE_STEPS if found else 0):
        if time.monotonic() > lg.deadline or lg.best_obj - lg.lower <= STOP_GAP * abs(lg.best_obj):
            break
        # where the two plans' weighted costs cross: if nothing beats them there, that
        # weight is the dual optimum (the bound cannot rise) and the search is over
        cross = (fit_at[0] - over_at[0]) / max(over_at[1] - fit_at[1], 1e-300)
        at_cross = lo < cross < hi
        mid = cross if at_cross else 0.5 * (lo + hi)
        fits, choice, *seen = lg.probe(mid)
        if at_cross and any(_close(seen, known) for known in (fit_at, over_at)):
            break
        if fits:
            hi, fit_at = mid, seen
        else:
            lo, over, over_at = mid, choice, seen
    return over


def _budgeted_solution(problem: StrategyProblem, best_choice: list[int], lower: float,
                       started: float, deadline: float, what: str) -> Solution:
    """The budgeted plan with its gap; a small flat problem left with a gap gets the
    budgeted MIP for the time that remains."""
    budget = problem.memory_budget
    best_obj = evaluate(problem, best_choice)[0]
    solver = "cluster/lagrangian"
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
