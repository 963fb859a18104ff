"""Repeated-layer clustering (autopar/solve/cluster.py) and planning on the meta device.

The clustered solver is the flat elimination DP shared between identical layers, so on
every GPT where both run it must return the flat optimum exactly (tolerance: float
summation order only, 1e-12 relative).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from autopar import MeshSpec
from autopar.annotate import annotate
from autopar.api import plan
from autopar.capture import capture
from autopar.costs import CostModel
from autopar.search import build_problem
from autopar.solve.cluster import find_clusters, shared_pricing, solve_clustered
from autopar.solve.ilp import solve_ilp
from autopar.solve.problem import SolveStatus, evaluate
from autopar.strategies import enumerate_strategies
from examples.gpt import build


def _problem(layers: int, dim: int, preset: str, shape: tuple[int, ...], share: bool = False):
    with torch.device("meta"):
        model, ex = build(layers=layers, dim=dim, heads=4, vocab=512, seq=64, batch=16)
    cap = capture(model, ex)
    annotate(cap.gm)
    mesh = MeshSpec.preset(preset, shape=shape)
    st = enumerate_strategies(cap.gm, shape)
    pb = build_problem(cap.gm, mesh, st, CostModel(mesh), None,
                       shared_pricing(cap.gm, st) if share else None)
    return cap.gm, pb


@pytest.mark.parametrize("layers,dim,preset,shape", [
    (2, 64, "cpu-gloo", (4,)),
    (3, 256, "8xA100-nvlink", (2, 4)),
    (4, 512, "multinode-a100-ib", (2, 8)),
])
def test_clustered_equals_flat_optimum(layers, dim, preset, shape):
    gm, pb = _problem(layers, dim, preset, shape)
    cl = find_clusters(gm, pb.nodes, pb.strategies, pb.problem)
    assert cl is not None and len(cl.blocks) == layers and cl.classes == 1
    clustered = solve_clustered(pb.problem, cl, time_limit=30)
    flat = solve_ilp(pb.problem, time_limit=30)
    assert clustered.status is SolveStatus.OPTIMAL and flat.status is SolveStatus.OPTIMAL
    assert clustered.objective == pytest.approx(flat.objective, rel=1e-12)
    # expansion assigns every node a valid strategy and the objective is the plan's own
    assert len(clustered.choice) == pb.problem.num_nodes
    assert all(0 <= c < len(k) for c, k in zip(clustered.choice, pb.problem.node_costs))
    assert evaluate(pb.problem, clustered.choice)[0] == pytest.approx(clustered.objective, rel=1e-12)
    assert "clustered" in clustered.message


def test_shared_pricing_builds_the_same_problem():
    gm, flat = _problem(3, 128, "8xA100-nvlink", (2, 4))
    _, shared = _problem(3, 128, "8xA100-nvlink", (2, 4), share=True)
    a, b = flat.problem, shared.problem
    assert all((x == y).all() for x, y in zip(a.node_costs, b.node_costs))
    assert all((x == y).all() for x, y in zip(a.node_memory, b.node_memory))
    assert all(u == p and v == q and (m == n).all() for (u, v, m), (p, q, n) in zip(a.edges, b.edges))


def test_budget_plans_fit_and_report_a_gap():
    gm, pb = _problem(3, 256, "8xA100-nvlink", (2, 4))
    cl = find_clusters(gm, pb.nodes, pb.strategies, pb.problem)
    free = solve_ilp(pb.problem)
    mem = evaluate(pb.problem, free.choice)[1]
    tight = dataclasses.replace(pb.problem, memory_budget=0.97 * mem)
    sol = solve_clustered(tight, cl, time_limit=20)
    assert evaluate(tight, sol.choice)[1] <= tight.memory_budget
    assert sol.objective >= free.objective * (1 - 1e-12)
    assert sol.status is SolveStatus.OPTIMAL or sol.gap is not None


def test_no_clusters_without_repeated_layers():
    gm, pb = _problem(1, 64, "cpu-gloo", (2,))
    assert find_clusters(gm, pb.nodes, pb.strategies, pb.problem) is None


def test_meta_device_plan_allocates_nothing():
    # 8 layers of dim 4096 hold 1.6e9 parameters: 6.5 GB in fp32 if anything allocated them
    with torch.device("meta"):
        model, ex = build(layers=8, dim=4096, heads=32, vocab=50304, seq=1024, batch=64)
    assert all(p.is_meta for p in model.parameters())
    t0 = time.perf_counter()
    p = plan(model, ex, MeshSpec.preset("multinode-a100-ib", shape=(2, 8)), search="ilp")
    assert time.perf_counter() - t0 < 60
    assert all(p.is_meta for p in model.parameters())
    assert p.solver.searcher == "ilp" and p.solver.backend.startswith("cluster")
    assert "clustered 8 repeated layers" in p.solver.message
    assert p.objective > 0 and len(p.nodes) > 8 * 30
