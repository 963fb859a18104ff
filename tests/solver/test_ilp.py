"""solve_ilp against brute force on small problems, plus presolve, limits and scale checks."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from autopar.search.solvers.ilp import solve_ilp
from autopar.search.solvers.problem import (
    InfeasibleError,
    SolveStatus,
    StrategyProblem,
    evaluate,
)

GiB = 1024**3


def brute_force(problem: StrategyProblem) -> tuple[float, list[int] | None, float]:
    """(optimal objective, an optimal plan, least memory over edge-feasible plans)."""
    best, best_plan, least = math.inf, None, math.inf
    for plan in itertools.product(*(range(len(c)) for c in problem.node_costs)):
        obj, mem = evaluate(problem, list(plan))
        if math.isinf(obj):
            continue
        least = min(least, mem)
        if problem.memory_budget is not None and mem > problem.memory_budget:
            continue
        if obj < best:
            best, best_plan = obj, list(plan)
    return best, best_plan, least


def random_problem(
    rng: np.random.Generator,
    n: int,
    max_k: int,
    edge_prob: float,
    inf_prob: float,
    budget_quantile: float | None,
) -> StrategyProblem:
    """Random problem; memory in whole bytes, budget at a quantile of feasible plans."""
    ks = rng.integers(1, max_k + 1, n)
    costs = [rng.random(k).round(3) for k in ks]
    memory = [rng.integers(1, 100, k).astype(float) for k in ks]
    edges = []
    for u, v in itertools.combinations(range(n), 2):
        for _ in range(rng.integers(0, 3)):  # parallel edges on purpose
            if rng.random() < edge_prob:
                mat = rng.random((ks[u], ks[v])).round(3)
                mat[rng.random(mat.shape) < inf_prob] = np.inf
                edges.append((u, v) if rng.random() < 0.5 else (v, u))
                if edges[-1] == (v, u):
                    mat = mat.T
                edges[-1] = (*edges[-1], mat)
    problem = StrategyProblem(costs, memory, edges)
    if budget_quantile is not None:
        mems = sorted(
            evaluate(problem, list(p))[1]
            for p in itertools.product(*(range(k) for k in ks))
            if math.isfinite(evaluate(problem, list(p))[0])
        )
        if mems:
            problem.memory_budget = float(mems[int(budget_quantile * (len(mems) - 1))])
    return problem


def check_against_brute_force(problem: StrategyProblem, backend: str = "auto") -> None:
    """solve_ilp matches the brute-force optimum, or raises the right error."""
    best, _, least = brute_force(problem)
    if math.isinf(best):
        with pytest.raises(InfeasibleError) as info:
            solve_ilp(problem, time_limit=10, backend=backend)
        assert info.value.min_memory == pytest.approx(least)
        return
    sol = solve_ilp(problem, time_limit=10, backend=backend)
    obj, mem = evaluate(problem, sol.choice)
    assert sol.status is SolveStatus.OPTIMAL
    assert sol.gap == 0.0
    # Objective is recomputed exactly; 1e-9 only absorbs summation order.
    assert obj == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert sol.objective == pytest.approx(obj, rel=1e-12)
    if problem.memory_budget is not None:
        assert mem <= problem.memory_budget


@pytest.mark.parametrize("seed", range(60))
def test_random_small_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    quantile = [None, 0.0, 0.3, 0.7][seed % 4]
    problem = random_problem(
        rng,
        n=int(rng.integers(1, 6)),
        max_k=4,
        edge_prob=0.5,
        inf_prob=0.2,
        budget_quantile=quantile,
    )
    check_against_brute_force(problem)


@pytest.mark.parametrize("backend", ["highs", "scip", "cpsat"])
@pytest.mark.parametrize("seed", range(8))
def test_backends_match_brute_force(backend: str, seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    # Dense graphs keep a residual after elimination, so the backend really runs.
    problem = random_problem(
        rng,
        n=5,
        max_k=4,
        edge_prob=0.9,
        inf_prob=0.1,
        budget_quantile=[None, 0.4][seed % 2],
    )
    check_against_brute_force(problem, backend)


def chain_or_tree(rng: np.random.Generator, n: int, k: int, tree: bool) -> StrategyProblem:
    """Chain (parent i-1) or random tree (parent < i) with some forbidden pairs."""
    costs = [rng.random(k) for _ in range(n)]
    memory = [rng.random(k) for _ in range(n)]
    edges = []
    for i in range(1, n):
        parent = int(rng.integers(0, i)) if tree else i - 1
        mat = rng.random((k, k))
        mat[rng.random((k, k)) < 0.3] = np.inf
        mat[np.arange(k), np.arange(k)] = 0.0  # keep every chain feasible
        edges.append((parent, i, mat))
    return StrategyProblem(costs, memory, edges)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_elimination_exact_on_chains_and_trees(tree: bool, seed: int) -> None:
    problem = chain_or_tree(np.random.default_rng(seed), n=6, k=3, tree=tree)
    best, _, _ = brute_force(problem)
    sol = solve_ilp(problem)
    assert sol.solver == "presolve"  # the forest never reaches the MIP
    assert sol.status is SolveStatus.OPTIMAL
    assert sol.objective == pytest.approx(best, rel=1e-12)


def test_cycle_with_pendant_chains_matches_brute_force() -> None:
    """Degree-2 elimination on a cycle creates and merges edges between survivors."""
    rng = np.random.default_rng(7)
    k, n = 3, 7
    pairs = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (1, 3), (3, 4), (4, 5), (5, 6)]
    problem = StrategyProblem(
        [rng.random(k) for _ in range(n)],
        [np.ones(k) for _ in range(n)],
        [(u, v, rng.random((k, k))) for u, v in pairs],
    )
    best, _, _ = brute_force(problem)
    assert solve_ilp(problem).objective == pytest.approx(best, rel=1e-12)


def test_infeasible_budget_reports_min_memory() -> None:
    costs = [np.array([1.0, 2.0]), np.array([1.0, 3.0])]
    memory = [np.array([1.0, 0.5]) * GiB, np.array([1.5, 1.2]) * GiB]
    # The pair (1, 1) is forbidden, so the least memory is 1.0 + 1.2 or 0.5 + 1.5 = 2.0 GiB
    # rather than 0.5 + 1.2 = 1.7 GiB.
    edges = [(0, 1, np.array([[0.0, 0.0], [0.0, np.inf]]))]
    problem = StrategyProblem(costs, memory, edges, memory_budget=1.0 * GiB)
    with pytest.raises(InfeasibleError) as info:
        solve_ilp(problem)
    assert info.value.min_memory == pytest.approx(2.0 * GiB)
    assert "memory budget 1.0 GiB is infeasible: the smallest plan needs 2.0 GiB" in str(info.value)
    problem.memory_budget = 2.0 * GiB
    sol = solve_ilp(problem)
    assert sol.choice == [1, 0] and evaluate(problem, sol.choice)[1] == 2.0 * GiB


def test_forbidden_pairs_are_respected() -> None:
    # Each node's cheapest strategy is forbidden against the other's cheapest.
    costs = [np.array([0.0, 5.0, 6.0]), np.array([0.0, 5.0, 1.0])]
    mat = np.zeros((3, 3))
    mat[0, :] = [np.inf, np.inf, 1.0]
    mat[1, 0] = np.inf
    problem = StrategyProblem(costs, [np.zeros(3)] * 2, [(0, 1, mat)])
    sol = solve_ilp(problem)
    assert math.isfinite(sol.objective)
    assert sol.choice == [0, 2] and sol.objective == 2.0


def test_no_plan_at_all_raises() -> None:
    mat = np.full((2, 2), np.inf)
    problem = StrategyProblem([np.zeros(2)] * 2, [np.zeros(2)] * 2, [(0, 1, mat)])
    with pytest.raises(InfeasibleError, match="no plan exists") as info:
        solve_ilp(problem)
    assert info.value.min_memory == math.inf


def test_validate_rejects_bad_shapes() -> None:
    problem = StrategyProblem([np.zeros(2)] * 2, [np.zeros(2)] * 2, [(0, 1, np.zeros((2, 3)))])
    with pytest.raises(ValueError, match=r"R has shape \(2, 3\), expected \(2, 2\)"):
        solve_ilp(problem)
    with pytest.raises(ValueError, match="finite"):
        StrategyProblem([np.array([np.nan])], [np.zeros(1)], []).validate()


def random_graph(seed: int, n: int, k: int, budget_fraction: float | None) -> StrategyProblem:
    """Chain plus random chords: the shape of a layer graph with skip connections."""
    rng = np.random.default_rng(seed)
    pairs = [(i, i + 1) for i in range(n - 1)]
    pairs += [(int(a), int(b)) for a, b in rng.integers(0, n, (n // 2, 2)) if a != b]
    memory = [rng.integers(1, 1000, k).astype(float) for _ in range(n)]
    problem = StrategyProblem(
        [rng.random(k) for _ in range(n)], memory, [(u, v, rng.random((k, k))) for u, v in pairs]
    )
    if budget_fraction is not None:
        low = sum(float(m.min()) for m in memory)
        high = sum(float(m.max()) for m in memory)
        problem.memory_budget = low + budget_fraction * (high - low)
    return problem


@pytest.mark.parametrize("budget_fraction", [None, 0.3])
def test_time_limit_returns_feasible_plan_in_time(budget_fraction: float | None) -> None:
    problem = random_graph(0, n=300, k=8, budget_fraction=budget_fraction)
    start = time.monotonic()
    sol = solve_ilp(problem, time_limit=0.5)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, elapsed
    assert sol.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
    obj, mem = evaluate(problem, sol.choice)
    assert math.isfinite(obj) and obj == pytest.approx(sol.objective)
    if budget_fraction is not None:
        assert mem <= problem.memory_budget
    if sol.status is SolveStatus.FEASIBLE:
        assert "time limit 0.5 s reached" in sol.message


def test_deterministic() -> None:
    problem = random_graph(3, n=60, k=6, budget_fraction=0.5)
    first = solve_ilp(problem, time_limit=10)
    second = solve_ilp(problem, time_limit=10)
    assert first.status is SolveStatus.OPTIMAL
    assert first.choice == second.choice


def test_long_chain_solves_fast() -> None:
    problem = chain_or_tree(np.random.default_rng(0), n=500, k=16, tree=False)
    start = time.monotonic()
    sol = solve_ilp(problem)
    assert time.monotonic() - start < 3.0
    assert sol.status is SolveStatus.OPTIMAL
    # The chain DP is exact: no single-node change can improve the plan.
    for i in range(0, 500, 25):
        for a in range(16):
            alt = list(sol.choice)
            alt[i] = a
            assert evaluate(problem, alt)[0] >= sol.objective - 1e-9
