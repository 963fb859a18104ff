"""Lower bounds on a strategy problem's optimum, cheap enough to come with every plan.

A solver stopped by its time limit, or a heuristic (D-Rec), knows its plan's cost but not
how far it is from the best plan. These bounds make that distance known at most: the
plan's gap is ``(objective - bound) / objective``, so "feasible" always says how far from
optimal the plan can be.

:func:`star_bound` splits every edge's price between its two ends: for any plan,

    sum_i c_i[x_i] + sum_(u,v) R[x_u, x_v]
        = sum_i (c_i[x_i] + sum_(e at i) R_e[x_u, x_v] / 2)
       >= sum_i min_a (c_i[a] + sum_(e at i) min_other R_e(a, other) / 2)

since each half is at least the least entry of its row (at ``u``) or column (at ``v``).
It holds with or without a memory budget (dropping the budget only lowers the optimum).
On the chain-like graphs of a layer stack it is weak where resharding dominates and close
where compute does; a MIP's own bound, when it has one, is at least as strong.

Example::

    >>> import numpy as np
    >>> from autopar.search.solvers.problem import StrategyProblem
    >>> p = StrategyProblem([np.array([1.0, 3.0]), np.array([2.0, 0.0])],
    ...                     [np.zeros(2), np.zeros(2)], [(0, 1, np.array([[0.0, 4], [4, 0]]))])
    >>> star_bound(p)  # the optimum is 3.0 (both pick 0: 1 + 2, or both 1: 3 + 0)
    1.0
"""

from __future__ import annotations

import math

import numpy as np

from autopar.search.solvers.problem import StrategyProblem


def star_bound(problem: StrategyProblem) -> float:
    """A lower bound on ``problem``'s optimum (module docstring): each node's cheapest
    strategy counting half of the cheapest resharding on each of its edges. ``inf`` when a
    node has no strategy allowed by its forbidden pairs (no plan exists)."""
    acc = [np.array(c, dtype=np.float64) for c in problem.node_costs]
    for u, v, m in problem.edges:
        m = np.asarray(m, dtype=np.float64)
        acc[u] += 0.5 * m.min(axis=1)
        acc[v] += 0.5 * m.min(axis=0)
    return math.fsum(float(a.min()) for a in acc)


def node_bound(node_costs: list[np.ndarray]) -> float:
    """The least each node's own cost can be, summed: a lower bound on any plan whose node
    strategies come from these vectors (edges cost >= 0). For plans whose edges were never
    priced (D-Rec on meshes where the ILP's edge matrices are too many to build)."""
    return math.fsum(float(np.min(c)) for c in node_costs)


def gap(objective: float, bound: float) -> float | None:
    """The relative optimality gap ``(objective - bound) / objective`` clamped at 0;
    ``None`` when either number is not finite (nothing is known)."""
    if not (math.isfinite(objective) and math.isfinite(bound)):
        return None
    return max(0.0, (objective - bound) / max(abs(objective), 1e-300))


__all__ = ["gap", "node_bound", "star_bound"]
