"""Expert parallelism on real gloo ranks: examples/moe.py (GShard top-2 routing with a
capacity that drops tokens) under the parallel module vs the single-process model.

Cases: EP alone on (2,) (expert weights sharded on E, groups on the batch, an
all-to-all of the dispatched tokens there and back), EP x DP on (2, 2) (experts on the
inner axis, groups on both), EP x TP on (2, 2) (experts on axis 0, each expert's MLP
Megatron-split on axis 1), and the planner's own choice on (2,).  Each compares the
loss (the load-balancing loss is part of it), every gradient, the parameters after two
SGD-with-momentum steps and after two AdamW steps (tests/dist/harness.py ``run_case``).

Tolerances: the same as tests/dist/test_equivalence.py and for the same reasons (fp32
sums reordered by sharded contractions and collectives move results by a few ulps;
AdamW's m/sqrt(v) amplifies that where v is tiny, a wrong shard or lost step is off by
~lr).  Routing adds no tolerance of its own: top-k, cumsum positions and the capacity
cut are computed per group from the same router probabilities on every layout, so a
token is kept or dropped alike; the test asserts that tokens really are dropped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.dist.harness import Case, run_cases
from tests.dist.test_equivalence import check

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import moe  # noqa: E402

LAYERS = 2
BUILD = {"layers": LAYERS}  # build()'s defaults: capacity factor 1.0, groups = batch (4)
# Left alone, the planner replicates the default model (every kernel is at the launch
# floor, so sharding saves nothing and a collective costs ~0.1 ms); at this size it
# splits the experts and moves tokens by all-gathers and reduce-scatters, a layout the
# pinned cases do not cover.  It must stay cheap enough to train on CPU in the test.
AUTO = {"layers": LAYERS, "dim": 64, "hidden": 512, "experts": 8, "seq": 32}

TWO = [
    Case(id="moe-ep-2", model="moe", mesh=(2,), pins=moe.ep_pins(LAYERS, 1), build_kwargs=BUILD),
    Case(id="moe-auto-2", model="moe", mesh=(2,), build_kwargs=AUTO),
]
FOUR = [
    Case(id="moe-epxdp-2x2", model="moe", mesh=(2, 2), pins=moe.ep_pins(LAYERS, 2),
         build_kwargs=BUILD),
    Case(id="moe-epxtp-2x2", model="moe", mesh=(2, 2), pins=moe.ep_tp_pins(LAYERS),
         build_kwargs=BUILD),
]
# the expert weights' placements each 4-rank case must end with
FOUR_EXPERTS = {"moe-epxdp-2x2": {"RS(0)"}, "moe-epxtp-2x2": {"S(0)S(2)", "S(0)S(1)"}}


@pytest.fixture(scope="module")
def two_rank_results() -> dict[str, dict]:
    return run_cases(2, TWO)


@pytest.fixture(scope="module")
def four_rank_results() -> dict[str, dict]:
    return run_cases(4, FOUR)


@pytest.mark.parametrize("kwargs", [BUILD, AUTO], ids=["default", "auto"])
def test_capacity_drops_tokens(kwargs: dict) -> None:
    """The cases' batches overflow the experts' buffers in every layer: dropped tokens
    are covered (a fresh router is unbalanced, so capacity factor 1.0 drops many)."""
    model, ex = moe.build(**kwargs)
    for assigned, kept in moe.routing_stats(model, *ex):
        assert 0 < kept < assigned, (assigned, kept)


def _expert_params(res: dict) -> dict[str, str]:
    return {k: v for k, v in res["plan_params"].items() if k.endswith(("w_in", "w_out"))}


@pytest.mark.parametrize("case", TWO, ids=[c.id for c in TWO])
def test_two_ranks(two_rank_results: dict, case: Case) -> None:
    res = two_rank_results.get(case.id, {"error": "not run (an earlier case failed)"})
    check(res)
    if case.pins:  # the pins were honoured: experts split over the ranks
        assert set(_expert_params(res).values()) == {"S(0)"}, _expert_params(res)


@pytest.mark.slow
@pytest.mark.parametrize("case", FOUR, ids=[c.id for c in FOUR])
def test_four_ranks(four_rank_results: dict, case: Case) -> None:
    res = four_rank_results.get(case.id, {"error": "not run (an earlier case failed)"})
    check(res)
    assert set(_expert_params(res).values()) == FOUR_EXPERTS[case.id], _expert_params(res)


def ep_trace(c: dict) -> dict:
    """One EP training step under the profiler (shapes recorded): each all-to-all the
    runtime issues and the elements it sends, beside the plan's all-to-all
    redistributions and the local size of the tensor each one moves."""
    import math

    import torch

    from autopar import MeshSpec, auto_parallel
    from autopar.plans.placement import local_shape, parse_placements

    model, (x, y) = moe.build(layers=LAYERS)
    pm = auto_parallel(model, example_inputs=(x, y), pins=moe.ep_pins(LAYERS, 1),
                       mesh=MeshSpec.preset("cpu-gloo", shape=tuple(c["mesh"])))
    pm(x, y).backward()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        pm(x, y).backward()
    ran = [math.prod(e.input_shapes[1]) for e in prof.events()
           if e.name == "c10d::alltoall_base_"]
    planned = []
    for n in pm.plan.nodes.values():
        for r in n.redistributions:
            if any(s.startswith("all_to_all") for s in r.steps):
                shape = pm.plan.nodes[r.input].shape[0]
                planned.append(math.prod(local_shape(shape, parse_placements(r.src), pm.plan.mesh.shape)))
    return {"ran": ran, "planned": planned}


@pytest.mark.slow
def test_trace_shows_the_planned_all_to_alls() -> None:
    """The runtime issues exactly the plan's all-to-alls, forward and their reverse in
    backward (2 + 2 per MoE layer), each sending the dispatched tokens' local size."""
    from tests.dist.harness import run_fn_cases

    res = run_fn_cases(2, "tests.dist.test_expert_parallel:ep_trace", [{"id": "t", "mesh": [2]}])["t"]
    assert "error" not in res, res.get("error")
    assert len(res["planned"]) == 2 * LAYERS, res
    assert len(res["ran"]) == 2 * len(res["planned"]), res
    assert sorted(res["ran"]) == sorted(res["planned"] * 2), res
