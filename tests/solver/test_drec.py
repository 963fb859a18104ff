"""D-Rec (autopar/solve/drec.py): quality against the ILP, scale, determinism, pins,
memory, the ``auto`` rule, and MindSpore's documented example.

No process groups: plans only (models on the meta device where they are large).
"""

from __future__ import annotations

import importlib
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from autopar import MeshSpec, plan
from autopar.annotate import annotate
from autopar.capture import capture
from autopar.costs import CostModel
from autopar.errors import PlanError
from autopar.placement import fmt_placements
from autopar.search import PlanOptions, Searcher, choose_searcher, make_plan
from autopar.solve.drec import CostMode, DRecOptions, Order, axis_order, drec_search

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402
from mlp import MLP  # noqa: E402

MODELS = ["mlp", "gpt", "cnn", "hf_gpt2"]
MESHES = [((2,), "cpu-gloo"), ((4,), "8xA100-nvlink"), ((2, 2), "cpu-gloo"),
          ((2, 4), "8xA100-nvlink")]
_CAPTURED: dict[str, object] = {}


def captured(name: str):
    """Capture each example once per session (export costs ~1 s for the GPTs)."""
    if name not in _CAPTURED:
        mod = importlib.import_module(name)
        model, ex = mod.build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cap = capture(model, ex)
        annotate(cap.gm)
        _CAPTURED[name] = cap
    return _CAPTURED[name]


@pytest.mark.parametrize("mesh_spec", MESHES, ids=lambda m: f"{'x'.join(map(str, m[0]))}-{m[1]}")
@pytest.mark.parametrize("model", MODELS)
def test_drec_within_5_percent_of_ilp(model, mesh_spec) -> None:
    # Measured: D-Rec (reverse order + exact per-round refinement) matches the ILP
    # optimum on all 16 cases (ratio 1.000); pure greedy rounds were 1.2-2x off here.
    shape, preset = mesh_spec
    cap = captured(model)
    mesh = MeshSpec.preset(preset, shape=shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ilp = make_plan(cap.gm, mesh, cap.aliases, PlanOptions(search="ilp"))
        drec = make_plan(cap.gm, mesh, cap.aliases, PlanOptions(search="drec"))
    assert ilp.solver.searcher == "ilp" and drec.solver.searcher == "drec"
    assert ilp.solver.status == "optimal"
    assert drec.objective <= ilp.objective * 1.05, drec.diff(ilp)
    assert drec.objective >= ilp.objective * (1 - 1e-9)  # the ILP is optimal
    # the same Plan fields, priced the same way
    assert drec.objective == pytest.approx(
        drec.compute_seconds + drec.comm_seconds + drec.grad_sync_seconds)
    assert drec.memory["total"] > 0 and set(drec.nodes) == set(ilp.nodes)


def test_drec_is_deterministic() -> None:
    cap = captured("gpt")
    mesh = MeshSpec.preset("8xA100-nvlink", shape=(2, 4))
    a = make_plan(cap.gm, mesh, cap.aliases, PlanOptions(search="drec"))
    b = make_plan(cap.gm, mesh, cap.aliases, PlanOptions(search="drec"))
    assert {k: (n.in_placements, n.out_placements) for k, n in a.nodes.items()} == \
        {k: (n.in_placements, n.out_placements) for k, n in b.nodes.items()}
    assert a.objective == b.objective


@pytest.mark.parametrize("shape", [(4, 4, 8, 8), (128, 8)])
def test_drec_plans_1024_devices_quickly(shape) -> None:
    mesh = MeshSpec.preset("multinode-a100-ib", shape=shape)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=1024, seq=256, dim=1024, heads=16, layers=4))
        ex = (torch.randint(0, 1024, (1024, 256)), torch.randint(0, 1024, (1024, 256)))
    t0 = time.perf_counter()
    p = plan(model, ex, mesh, search="drec")
    seconds = time.perf_counter() - t0
    assert p.solver.searcher == "drec", p.solver.message
    assert p.mesh.size == 1024
    assert seconds < 30, seconds  # measured ~1-2 s on 2 cores (capture included)
    # the slowest link is decided first (the in-node axis, NVLink, last)
    assert axis_order(mesh)[-1] == len(shape) - 1
    # auto: on 4 mesh axes the product ILP would price ~1e7 edge entries -> D-Rec; on
    # (128, 8) the ILP is small enough (~1e5 entries) and auto keeps it
    cap = capture(model, ex)
    annotate(cap.gm)
    searcher, why = choose_searcher(cap.gm, mesh, PlanOptions(search="auto"))
    assert searcher is (Searcher.DREC if len(shape) == 4 else Searcher.ILP), why


def test_auto_takes_the_ilp_on_small_problems() -> None:
    cap = captured("mlp")
    mesh = MeshSpec.preset("cpu-gloo", shape=(2, 2))
    searcher, why = choose_searcher(cap.gm, mesh, PlanOptions(search="auto"))
    assert searcher is Searcher.ILP and "auto: ILP" in why
    p = make_plan(cap.gm, mesh, cap.aliases, PlanOptions(search="auto"))
    assert p.solver.searcher == "ilp"
    with pytest.raises(PlanError, match="unknown search"):
        choose_searcher(cap.gm, mesh, PlanOptions(search="greedy"))


def test_drec_honours_pins() -> None:
    cap = captured("mlp")
    mesh = MeshSpec.preset("cpu-gloo", shape=(2, 2))
    pins = {"fc1.weight": "RS(0)", "input:0": "S(0)S(0)"}
    p = make_plan(cap.gm, mesh, cap.aliases, PlanOptions(search="drec", pins=pins))
    assert p.placement("fc1.weight") == "RS(0)"
    assert p.nodes["x"].out_placements[0] == "S(0)S(0)"
    with pytest.raises(PlanError):
        make_plan(cap.gm, mesh, cap.aliases, PlanOptions(search="drec", pins={"nope": "RR"}))


def test_drec_memory_budget() -> None:
    # Megatron-sharded weights dominate: the fastest plan needs 98.5 MiB per device, the
    # leanest 97.2 MiB (the ILP's exact minimum).  1% less than the fastest forces D-Rec
    # to price memory in; 10% less is infeasible for both searchers.
    with torch.device("meta"):
        model = MLP(1024, 4096, 1024)
        ex = (torch.randn(64, 1024), torch.randn(64, 1024))
    cap = capture(model, ex)
    annotate(cap.gm)
    mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
    cm = CostModel(mesh)
    fastest = drec_search(cap.gm, mesh, cm)
    assert fastest.lam == 0
    lean = drec_search(cap.gm, mesh, cm, memory_budget=0.99 * fastest.memory)
    assert lean.memory <= 0.99 * fastest.memory and lean.lam > 0
    assert "memory priced in" in lean.message
    with pytest.raises(PlanError, match="no plan within the memory budget"):
        drec_search(cap.gm, mesh, cm, memory_budget=0.9 * fastest.memory)


# ------------------------------------------------------------------ MindSpore's example
def _mindspore_first_matmul(order: Order) -> tuple[str, str]:
    torch.manual_seed(0)
    model = MLP(784, 512, 1)
    ex = (torch.randn(256, 784), torch.randn(256, 1))
    cap = capture(model, ex)
    annotate(cap.gm)
    mesh = MeshSpec.preset("cpu-gloo", shape=(2, 2, 2))  # 8 devices = 3 halvings
    r = drec_search(cap.gm, mesh, CostModel(mesh), DRecOptions(cost_mode=CostMode.MINDSPORE,
                                                                order=order))
    s = next(s for n, s in r.choice.items() if n.name == "linear")
    return fmt_placements(s.inputs[0]), fmt_placements(s.inputs[1])


def _as_mindspore(x: str, w: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Our placements on a (2,2,2) mesh -> MindSpore's ((A rows, A cols), (W rows, W cols))."""
    return ((2 ** x.count("S(0)"), 2 ** x.count("S(1)")), (2 ** w.count("S(0)"), 2 ** w.count("S(1)")))


def test_mindspore_mode_cuts_every_round() -> None:
    # MindSpore halves the device set every round: each axis cuts the first matmul
    x, w = _mindspore_first_matmul(Order.WEIGHT)
    (ai, ak), (wj, wk) = _as_mindspore(x, w)
    assert ai * ak * wj == 8  # i, k and j cuts together use all 3 halvings
    assert _mindspore_first_matmul(Order.WEIGHT) == (x, w)  # deterministic


@pytest.mark.xfail(strict=False, reason=(
    "MindSpore's documented ((4,2),(1,2)) is not reproduced by the design.md formulas as "
    "implemented (cut costs e_j*e_k/2, e_i*e_k/2, e_i*e_j/2; redistribution = local tensor "
    "size; followers grouped with their producer).  A scan over the natural variants "
    "(topological / reverse / weight order, redistribution weight 1 or 16, the reduction of "
    "a k-cut paid or free, the data input fixed batch-split or free) gives ((2,2),(2,2)), "
    "((2,4),(2,4)) or ((8,1),(1,1)), never ((4,2),(1,2)): under these formulas the first "
    "matmul always prefers cutting j or k over i in a round with no conflicting neighbour "
    "decided first (e.g. round 2: j costs 50176 < i 100352).  MindSpore's extra heuristics "
    "(its op weights and tensor-type coefficients) are not in design.md."))
def test_mindspore_documented_example() -> None:
    best = {order: _as_mindspore(*_mindspore_first_matmul(order)) for order in Order}
    assert ((4, 2), (1, 2)) in best.values(), best
