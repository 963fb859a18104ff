"""ZeRO over any set of data-parallel axes (issue 10): one axis with the others
replicated (HSDP), or several as one group (a whole 2-D data-parallel mesh), searched
in the same objective as the rest and forced with ``zero_axes=``.  Planning only; the
runtime's equivalence is tests/dist/test_parallelism_kinds.py's (``zero*-over-2x2``,
``hsdp-zero3-2x2``) and its collectives tests/dist/test_step_collectives.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autopar import MeshSpec, Plan, plan
from autopar.errors import ConfigError, PlanError
from autopar.search.forced import zero_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

MESH = MeshSpec.preset("8xA100-nvlink", shape=(2, 2))
pytestmark = pytest.mark.filterwarnings("ignore:the model computes")
DP2X2 = {"*": "RR", "input:0": "S(0)S(0)"}


def test_the_axis_sets_searched() -> None:
    assert zero_groups((2, 2), None) == [0, 1, (0, 1)]
    assert zero_groups((2, 1, 4), None) == [0, 2, (0, 2)]
    assert zero_groups((2, 2), (1,)) == [1]
    assert zero_groups((2, 2), (0, 1)) == [(0, 1)]
    # tensor parallelism splits the block weights on axis 1: ZeRO over both axes would
    # shard only the norm, as axis 0 alone does, and is not priced
    tp = [((0,), 100.0), ((0, 1), 1.0)]
    assert zero_groups((2, 2), None, tp) == [0, 1]
    # data parallel on both axes: the set is what shards the weights 4 ways
    assert zero_groups((2, 2), None, [((0, 1), 100.0), ((0,), 1.0)]) == [0, 1, (0, 1)]
    assert zero_groups((2, 2, 2), None, [((0, 1), 100.0), ((0, 1, 2), 1.0)]) == [0, 1, 2, (0, 1)]
    assert zero_groups((2, 2), (0, 1), tp) == [(0, 1)]  # forced: whatever it shards
    with pytest.raises(PlanError, match="axis 1, which has a single device"):
        zero_groups((4, 1), (0, 1))


@pytest.fixture(scope="module")
def model():
    # parameters dominate (dim 512, 8 rows): ZeRO-3's memory is mostly parameter state
    return gpt.build(layers=2, dim=512, heads=8, vocab=1024, seq=8, batch=8)


def test_a_budget_only_four_way_sharding_meets_picks_both_axes(model) -> None:
    m, ex = model
    one = plan(m, ex, MESH, pins=DP2X2, zero_stage=3, zero_axes=1, pipeline_stages=1)
    both = plan(m, ex, MESH, pins=DP2X2, zero_stage=3, zero_axes=[0, 1], pipeline_stages=1)
    assert one.decisions.zero_axes == (1,) and both.decisions.zero_axes == (0, 1)
    # sharding over 4 ranks holds about half the parameter state of sharding over 2
    held = lambda p: p.memory["params"] + p.memory["optimizer"]  # noqa: E731
    assert held(both) == pytest.approx(held(one) / 2, rel=0.02)
    budget = (one.memory["total"] + both.memory["total"]) / 2
    chosen = plan(m, ex, MESH, pins=DP2X2, zero_stage=3, pipeline_stages=1, memory_budget=budget)
    assert chosen.decisions.zero_axes == (0, 1), chosen.decisions.why["zero"]
    assert "mesh axes 0 and 1" in chosen.decisions.why["zero"]
    assert "as one group" in chosen.summary().splitlines()[1]
    # the plan file keeps the list, and an older plan's single axis still reads
    again = Plan.from_json(chosen.to_json())
    assert again.decisions.zero_axis == [0, 1] and again.decisions.zero_axes == (0, 1)


@pytest.mark.parametrize("bad", [[], [0, 0], [-1], ["0"], 1.5])
def test_zero_axes_is_validated(model, bad) -> None:
    m, ex = model
    with pytest.raises(ConfigError, match="zero_axes"):
        plan(m, ex, MESH, zero_stage=1, zero_axes=bad)


def test_zero_axes_needs_zero(model) -> None:
    m, ex = model
    with pytest.raises(PlanError, match="zero_stage=0 turns ZeRO off"):
        plan(m, ex, MESH, zero_stage=0, zero_axes=[0])
