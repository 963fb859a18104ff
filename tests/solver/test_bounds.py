"""Lower bounds that give every plan a gap (autopar/search/solvers/bounds.py): valid on random
problems against brute force, and reported where a solver has no bound of its own."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import autopar.search.solvers.ilp as ilp
from autopar.search.solvers.bounds import gap, node_bound, star_bound
from autopar.search.solvers.problem import SolveStatus, StrategyProblem, evaluate


def _random(seed: int, n: int = 5, k: int = 3, p_edge: float = 0.6) -> StrategyProblem:
    rng = np.random.default_rng(seed)
    costs = [rng.uniform(0, 10, k) for _ in range(n)]
    edges = []
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < p_edge:
            m = rng.uniform(0, 10, (k, k))
            m[rng.random((k, k)) < 0.15] = np.inf  # a few forbidden pairs
            edges.append((u, v, m))
    return StrategyProblem(costs, [np.zeros(k) for _ in range(n)], edges)


def _optimum(p: StrategyProblem) -> float:
    return min(evaluate(p, list(c))[0]
               for c in itertools.product(*(range(len(c)) for c in p.node_costs)))


@pytest.mark.parametrize("seed", range(20))
def test_star_bound_never_exceeds_the_optimum(seed: int) -> None:
    p = _random(seed)
    opt = _optimum(p)
    assert star_bound(p) <= opt + 1e-9
    assert node_bound(p.node_costs) <= star_bound(p) + 1e-12  # half-edges only add


def test_without_edges_the_bounds_are_the_optimum() -> None:
    p = _random(0, p_edge=0.0)
    assert star_bound(p) == pytest.approx(_optimum(p)) == pytest.approx(node_bound(p.node_costs))


def test_gap_is_unknown_only_without_finite_numbers() -> None:
    assert gap(10.0, 7.5) == pytest.approx(0.25)
    assert gap(10.0, 11.0) == 0.0  # a bound above the objective proves optimality
    assert gap(10.0, float("inf")) is None and gap(float("inf"), 1.0) is None


def test_a_mip_without_an_answer_still_reports_a_gap(monkeypatch) -> None:
    # a cycle, so presolve leaves a residual for the MIP; the backend then returns
    # nothing (as when it runs out of time before its first LP): the heuristic's plan
    # comes back, and before the star bound its gap was "unknown"
    p = _random(3, n=6, k=4, p_edge=1.0)
    opt = _optimum(p)
    monkeypatch.setattr(ilp, "_solve_residual", lambda *a, **k: ilp.MipResult(None, False, None))
    sol = ilp.solve_ilp(p, time_limit=5)
    assert sol.status is SolveStatus.FEASIBLE
    assert sol.gap is not None and 0.0 <= sol.gap < 1.0
    assert sol.objective * (1 - sol.gap) <= opt + 1e-9  # the bound is below the optimum
    assert "gap unknown" not in sol.message
