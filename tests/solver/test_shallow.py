"""The joint search's estimates from a shallow copy (autopar/shallow.py).

Once the plain candidate shows a model's repeated layers alike, the other (stages,
micro-batches) splits are priced on a 2-layer copy extrapolated to full depth, and only
the one that wins is planned at full depth.  Checked: the copy leaves the model as it
was, an estimate prices exactly what the full-depth plan of the same split prices, and
the search with estimates chooses the plan the all-exact search chooses.  Planning
only (no process group).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path

import pytest

import autopar.joint as joint
from autopar import MeshSpec, plan
from autopar.joint import JointSearch
from autopar.search import PlanOptions
from autopar.shallow import deepen, homogeneous, shallow_copy
from autopar.solve.layer_stats import LayerStat

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

MESH = MeshSpec.preset("8xA100-nvlink", shape=(4, 2))
LAYERS = 6


def _gpt():
    return gpt.build(layers=LAYERS, dim=64, heads=4, vocab=256, seq=32, batch=16)


def test_shallow_copy_shares_weights_and_leaves_the_model_alone() -> None:
    model, (x, y) = _gpt()
    before = [id(p) for p in model.parameters()]
    short = shallow_copy(model, "blocks")
    assert short is not None and len(short.blocks) == 2 and len(model.blocks) == LAYERS
    assert [id(p) for p in model.parameters()] == before
    assert all(a is b for a, b in zip(short.blocks.parameters(), model.blocks[:2].parameters()))
    assert short.tok.weight is model.tok.weight
    short(x, y).item()  # the copy runs
    assert shallow_copy(model, "nothere") is None and shallow_copy(model, "tok") is None


def test_homogeneous_needs_equal_layers_after_the_first() -> None:
    def st(key: str, s: float) -> LayerStat:
        return LayerStat(key, seconds=s, forward=s / 3)

    body = [st("h.0", 2.0)] + [st(f"h.{i}", 1.0) for i in range(1, 5)]
    stats = [st("pre", 0.5), *body, st("post", 0.7)]
    assert homogeneous(stats) == ("h", 5)
    deep = deepen([stats[0], body[0], body[1], stats[-1]], "h", 5)
    assert [s.key for s in deep] == [s.key for s in stats]
    assert [s.seconds for s in deep] == [s.seconds for s in stats]
    assert homogeneous([stats[0], *body[:4], st("h.4", 1.5), stats[-1]]) is None  # one differs
    assert homogeneous([stats[0], *body[:2], stats[-1]]) is None  # too shallow to cut


def _search() -> JointSearch:
    model, ex = _gpt()
    js = JointSearch(model, ex, MESH, PlanOptions(search="ilp", time_limit=120))
    js._t0, js._stopped = time.perf_counter(), False
    return js


@pytest.mark.parametrize("split", [(1, 2), (2, 4)])
def test_an_estimate_prices_what_the_full_depth_plan_prices(split: tuple[int, int]) -> None:
    js = _search()
    js._try(1, 1, math.inf, strict=True)
    assert js._start_shallow(), "GPT's blocks after the first are alike"
    n = len(js.priced)
    js._try(*split, math.inf, estimate=True)
    est = {p.config: p.step_seconds for c, p in js.priced[n:]}
    assert all(c.estimate and c.cap.gm is not js.captures[(16, False)].gm for c, _ in js.priced[n:])
    n = len(js.priced)
    js._try(*split, math.inf)
    exact = {p.config: p.step_seconds for c, p in js.priced[n:]}
    assert est.keys() == exact.keys()
    for cfg, s in exact.items():
        assert est[cfg] == pytest.approx(s, rel=1e-9) or (math.isinf(s) and math.isinf(est[cfg]))


def test_search_with_estimates_chooses_what_the_exact_search_chooses(monkeypatch) -> None:
    model, ex = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a budget under the plain plan's memory: the search explores splits
        budget = plan(model, ex, MESH).memory["total"] * 0.6
        fast = plan(model, ex, MESH, memory_budget=budget, time_limit=120)
        monkeypatch.setattr(joint, "shallow_copy", lambda *a, **k: None)  # every split exact
        exact = plan(model, ex, MESH, memory_budget=budget, time_limit=120)
    assert "estimated from a 2-layer copy" in fast.solver.message
    assert "estimated" not in exact.solver.message
    a, b = fast.decisions, exact.decisions
    assert (a.pipeline_stages, a.micro_batches, a.zero_stage, a.schedule) == \
        (b.pipeline_stages, b.micro_batches, b.zero_stage, b.schedule)
    assert a.step_seconds == pytest.approx(b.step_seconds, rel=1e-9)
    assert fast.params() == exact.params()
