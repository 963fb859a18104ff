"""The joint search's time_limit split among its phases (autopar/search/budget.py), on a clock
the test drives: each intra-op search costs exactly one second of it."""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings
from pathlib import Path

import pytest

import autopar.search.budget as budget
import autopar.search.joint as joint
from autopar import MeshSpec, plan
from autopar.search.budget import SHARES, Phase, TimeBudget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

# no launch floor: these tiny models' kernels are launch-bound, and the floor bounds most
# splits before their solve (JointSearch._bounded), so a search would not spend the
# shares these tests count
MESH = dataclasses.replace(MeshSpec.preset("8xA100-nvlink", shape=(4, 2)), kernel_floor=0.0)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(budget, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


@pytest.fixture
def one_second_solves(clock, monkeypatch):
    """Every intra-op search costs one second of the driven clock (capture costs none);
    returns the options each was called with, in order."""
    seen = []
    real = joint.make_weighted_plans

    def one_second_each(gm, mesh, aliases, opts, **k):
        seen.append(opts)
        clock[0] += 1.0
        return real(gm, mesh, aliases, opts, **k)

    monkeypatch.setattr(joint, "make_weighted_plans", one_second_each)
    monkeypatch.setattr(joint.JointSearch, "uncharged", lambda self: 0.0)
    return seen


def test_the_shares_cover_the_limit_and_confirm_inherits_what_explore_left(clock):
    assert sum(SHARES.values()) == pytest.approx(1.0)
    b = TimeBudget(20.0)
    assert b.deadline(Phase.EXPLORE) == 15.0 and b.deadline(Phase.CONFIRM) == 20.0
    clock[0] += 9.0
    assert not b.over() and b.left() == 6.0
    assert b.status() == "explore budget: 6.0 s of its 15.0 s left"
    b.enter(Phase.CONFIRM)  # explore used 9 of its 15 s: confirm gets 11
    assert b.left() == 11.0 and b.status() == "confirm budget: 11.0 s of its 11.0 s left"
    assert b.allowance(Phase.CONFIRM) == 11.0
    clock[0] += 12.0
    assert b.over() and b.left() == 0.0
    t: dict[str, float] = {}
    b.record(t)
    assert t == {"budget_explore": 15.0, "search_explore": 9.0,
                 "budget_confirm": 11.0, "search_confirm": 12.0}


def test_uncharged_seconds_do_not_count(clock):
    # nor those before the budget began (a second pass after wrong estimates has a budget
    # of its own: the first pass's captures are not deducted from it again)
    uncharged = [3.0]
    b = TimeBudget(10.0, uncharged=lambda: uncharged[0])
    clock[0] += 5.0
    uncharged[0] += 4.0  # a capture of 4 s during this budget
    assert b.spent() == 1.0 and b.left_total() == 9.0


def test_the_confirm_phase_keeps_its_share_when_explore_runs_out(one_second_solves):
    """Before, the estimates drew on the whole limit and the full-depth solve of the
    chosen split (the plan returned) got the 1 s floor; now exploring stops at 75%."""
    model, ex = gpt.build(layers=6, dim=64, heads=4, vocab=256, seq=32, batch=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, ex, MESH, time_limit=8.0, explore=True)
    limits = [o.time_limit for o in one_second_solves]
    explore, confirm = limits[:-1], limits[-1]
    # explore's share is 6 s: each solver gets what is left of it, and the split that
    # starts with 1 s left is the last one (the plain one first, whatever its cost)
    assert explore == [6.0 - i for i in range(len(explore))] and len(explore) == 6
    assert confirm == 2.0  # 8 s - 6 s charged: more than the 1 s floor it got before
    assert p.timings["search_explore"] == 6.0 and p.timings["search_confirm"] == 1.0
    assert p.timings["budget_explore"] == 6.0 and p.timings["budget_confirm"] == 2.0
    assert any("explore budget (6.0 s) of time_limit=8.0 s" in w for w in p.warnings)


def test_the_memory_lean_replan_runs_when_exploring_spent_its_share(one_second_solves):
    """Nothing fits with the fastest placements: the memory-lean re-plan runs in the
    confirm phase, the first always (before, a spent explore share skipped every one and
    the error said lean placements had been considered)."""
    model, ex = gpt.build(layers=6, dim=64, heads=4, vocab=256, seq=32, batch=16)
    with warnings.catch_warnings(), pytest.raises(joint.PlanError, match="no plan fits"):
        warnings.simplefilter("ignore")
        # offload ruled out: its retry would search again (tests/unit/test_offload.py)
        plan(model, ex, MESH, time_limit=4.0,
             explore=True, memory_budget=64 * 1024, offload="none")
    budgets = [o.memory_budget for o in one_second_solves]
    fastest = [b for b in budgets if b is None or b == float("inf")]
    assert len(fastest) == 3  # explore's 3 s, one second each
    assert len(budgets) > len(fastest)  # then at least one memory-lean re-plan


def test_explore_may_take_the_whole_limit(clock):
    b = TimeBudget(20.0)
    b.explore_all()
    assert b.deadline(Phase.EXPLORE) == 20.0 and b.allowance(Phase.EXPLORE) == 20.0
    clock[0] += 16.0  # past the 15 s share: still exploring
    assert not b.over() and b.left() == 4.0


def test_a_search_with_nothing_to_confirm_explores_for_the_whole_limit(one_second_solves):
    """Every candidate planned at full depth (``blocks=``: no shallow estimates): the
    confirm phase would have nothing to plan, so exploring goes on to the whole limit
    (before, it stopped at 75% and that share sat idle)."""
    model, ex = gpt.build(layers=2, dim=64, heads=4, vocab=256, seq=32, batch=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, ex, MESH, time_limit=8.0, explore=True, blocks=6)
    limits = [o.time_limit for o in one_second_solves]
    # each exact candidate's solver gets what is left of the whole budget; the last
    # starts with 1 s left: 8 candidates where the 75% share stopped at 6
    assert limits == [8.0 - i for i in range(8)]
    assert p.timings["budget_explore"] == 8.0 and p.timings["search_explore"] == 8.0
