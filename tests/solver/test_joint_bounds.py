"""The joint search bounds a split before its intra-op search (its compute floor,
``JointSearch._bounded``) and a pipelined config before its split search
(:func:`autopar.search.stages.pipeline_step.step_lower_bound`), and skips those slower than a plan
already found: neither bound exceeds a priced step, and the search chooses exactly what
it chooses when every split and config is priced."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest

import autopar.search.joint as J
from autopar import MeshSpec, plan
from autopar.search.stages.pipeline_step import price

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

MESH = MeshSpec.preset("multinode-a100-ib", shape=(4, 2))
# CI's slow step (~28 s on 2 cores: every config of the search priced, twice); the
# default suite keeps the search's own determinism and golden tests
pytestmark = pytest.mark.slow


def _plan(**kw):
    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=32, batch=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan(model, ex, MESH, explore=True, **kw)


def _uncut(stats, cfg, mesh, link, budget, optimizer, cut=math.inf):
    """``price`` without the plan in hand: every split searched (no config bounded)."""
    return price(stats, cfg, mesh, link, budget, optimizer)


@pytest.fixture(scope="module")
def unpruned():
    """Every config priced (the bound spied on and answered with 0), with each config's
    (bound, priced step) pair."""
    pairs: list[tuple[float, float]] = []
    real = J.step_lower_bound

    def spy(stats, cfg, mesh, link, optimizer):
        lb = real(stats, cfg, mesh, link, optimizer)
        pr = price(stats, cfg, mesh, link, math.inf, optimizer)  # no budget: the least step
        pairs.append((lb, pr.step_seconds))
        return 0.0

    mp = pytest.MonkeyPatch()
    mp.setattr(J, "step_lower_bound", spy)
    mp.setattr(J, "price", _uncut)
    mp.setattr(J.JointSearch, "_bounded", lambda self, *a: False)  # every split searched
    try:
        p = _plan()
    finally:
        mp.undo()
    return p, pairs


def test_bound_never_exceeds_the_priced_step(unpruned):
    _, pairs = unpruned
    assert len(pairs) > 50  # stages 2 and 4, micro-batch counts, ZeRO stages and axes, schedules
    for lb, step in pairs:
        assert math.isfinite(lb) and lb > 0.0
        assert lb <= step * (1 + 1e-12)
    # a bound worth having: within 2x of the step for most configs (could be false: a
    # bound of the compute alone is 3-10x under on this mesh)
    assert sorted(step / lb for lb, step in pairs)[len(pairs) // 2] < 2.0


def test_pruned_search_chooses_what_pricing_everything_chooses(unpruned, monkeypatch):
    full, pairs = unpruned
    searched: list[int] = []
    real = J.price

    def counting(stats, cfg, *a):
        if cfg.stages > 1:
            searched.append(cfg.stages)
        return real(stats, cfg, *a)

    monkeypatch.setattr(J, "price", counting)
    pruned = _plan()
    # some pipelined configs were only bounded (could be false: a bound that never cuts)
    assert len(searched) < len(pairs)
    a, b = full.decisions, pruned.decisions
    assert (a.pipeline_stages, a.micro_batches, a.schedule, a.zero_stage, a.zero_axis,
            a.recompute, a.stages) == (b.pipeline_stages, b.micro_batches, b.schedule,
                                        b.zero_stage, b.zero_axis, b.recompute, b.stages)
    assert a.step_seconds == b.step_seconds
    assert full.params() == pruned.params()


def test_split_bound_never_exceeds_a_priced_config(monkeypatch) -> None:
    """The compute floor spread over every device, times the pipeline's fill and drain,
    is below every config the search priced, whatever its split."""
    from autopar.plans.decisions import PlanOptions
    from autopar.search.joint import JointSearch

    model, ex = gpt.build(layers=4, dim=64, heads=4, vocab=256, seq=32, batch=16)
    monkeypatch.setattr(JointSearch, "_bounded", lambda self, *a: False)  # price them all
    monkeypatch.setattr(J, "step_lower_bound", lambda *a: 0.0)
    monkeypatch.setattr(J, "price", _uncut)
    js = JointSearch(model, ex, MESH, PlanOptions(explore=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        js.run()
    known = next(c for c, _ in js.priced if c.stats)
    work = sum(st.floor for st in known.stats) * known.micro_batches
    assert work > 0
    priced = [(c, p) for c, p in js.priced if p.feasible]
    assert {c.stages for c, _ in priced} >= {1, 2, 4}
    for c, p in priced:
        lb = work / MESH.size * (c.stages + c.micro_batches - 1) / c.micro_batches
        assert lb <= p.step_seconds * (1 + 1e-12), (c.stages, c.micro_batches)
    # the bound the search skips splits by: below every config priced for the split,
    # and above the compute floor alone where many micro-batches of small ops launch
    # more kernels than they compute (could be false: launches this model's ops do not pay)
    above = 0
    for c, p in priced:
        lb = js.space.split_floor(known, c.stages, c.micro_batches)
        assert lb <= p.step_seconds * (1 + 1e-12), (c.stages, c.micro_batches)
        flops = work / MESH.size * (c.stages + c.micro_batches - 1) / c.micro_batches
        above += lb > 1.5 * flops
    assert above > len(priced) // 2
