"""The plan checks before a plan is applied (:func:`autopar.module.plan_checks.check_plan`):
each pair of decisions that cannot run together refused with the message the runtime
always gave, on a plan edited by hand, without building a module."""

from __future__ import annotations

import dataclasses

import pytest

from autopar import MeshSpec
from autopar.errors import PlanError
from autopar.module.plan_checks import check_plan, zero_axes_in_use
from autopar.plans.data import NodePlan, Plan, SolverInfo
from autopar.plans.decisions import Decisions

# a 2 x 2 mesh: "w" replicated on both axes, "v" sharded on axis 1 (replicated on 0)
MESH = MeshSpec.preset("cpu-gloo", shape=(2, 2))
NODES = {"w": NodePlan("w", "param", "param", [[4, 4]], [], [], ["RR"], param="w"),
         "v": NodePlan("v", "param", "param", [[4, 4]], [], [], ["RS(0)"], param="v")}


def _plan(**decisions) -> Plan:
    return Plan(MESH, dict(NODES), 0.0, 0.0, 0.0, 0.0, {}, SolverInfo("test", "none", "ok", None, 0.0),
                decisions=Decisions(**decisions))


ZERO3 = {"zero_stage": 3, "zero_axis": [0, 1]}
BAD = {
    "gather_chunks under ZeRO-3": (
        {**ZERO3, "gather_chunks": [["w"]]},
        r"gathers ZeRO's parameters in chunks \(gather_chunks\), which runs with ZeRO-1 or 2 on "
        r"one pipeline stage only"),
    "gather_chunks over a pipeline": (
        {"zero_stage": 1, "zero_axis": 0, "gather_chunks": [["w"]], "pipeline_stages": 2},
        r"in chunks \(gather_chunks\)"),
    "offload='params' under ZeRO-1": (
        {"zero_stage": 1, "zero_axis": [0, 1], "offload": "params"},
        r"keeps parameter shards in host memory \(offload='params'\), which needs ZeRO-3 over every "
        r"replicated axis of the parameters"),
    "offload='params' without ZeRO": ({"offload": "params"}, r"\(offload='params'\)"),
    # ZeRO-3 over axis 1 only: "w" is still replicated on axis 0 (its shard reduced there)
    "offload='params' under ZeRO-3 over one of two replicated axes": (
        {"zero_stage": 3, "zero_axis": 1, "offload": "params"}, r"\(offload='params'\)"),
    "recompute under the zero-bubble schedule": (
        {"schedule": "zero-bubble", "pipeline_stages": 2, "micro_batches": 2, "recompute": ["l0"]},
        r"runs schedule 'zero-bubble' with recompute: torch.utils.checkpoint cannot recompute"),
    "ZeRO-3 under the zero-bubble schedule": (
        {**ZERO3, "schedule": "zero-bubble", "pipeline_stages": 2, "micro_batches": 2},
        r"runs schedule 'zero-bubble' with zero_stage=3: ZeRO-3 gathers weights inside backward"),
    "zero_reduce_once without ZeRO-3": (
        {"zero_reduce_once": True},
        r"reduces ZeRO-3 gradients once a step \(zero_reduce_once\) with zero_stage=0 and 1 "
        r"pipeline stages: it needs zero_stage=3 and no pipeline"),
    "zero_reduce_once over a pipeline": (
        {**ZERO3, "zero_reduce_once": True, "pipeline_stages": 2, "micro_batches": 2},
        r"with zero_stage=3 and 2 pipeline stages"),
    "copies with other micro-batches": (
        {"copies": 2, "micro_batches": 4}, r"runs 2 copies with 4 micro-batches over 1 stages"),
    "copies over a pipeline": (
        {"copies": 2, "micro_batches": 2, "pipeline_stages": 2},
        r"runs 2 copies with 2 micro-batches over 2 stages"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_refused(case: str) -> None:
    decisions, message = BAD[case]
    with pytest.raises(PlanError, match=message + r".*plan it again"):
        check_plan(_plan(**decisions))


GOOD = {
    "nothing": {},
    "ZeRO-3 over both axes, shards in host memory": {**ZERO3, "offload": "params"},
    "ZeRO-3 with zero_reduce_once": {**ZERO3, "zero_reduce_once": True},
    "gather_chunks under ZeRO-1": {"zero_stage": 1, "zero_axis": [0, 1], "gather_chunks": [["w"]]},
    "two copies of two micro-batches": {"copies": 2, "micro_batches": 2},
    "recompute under 1F1B": {"schedule": "1f1b", "pipeline_stages": 2, "micro_batches": 2,
                             "recompute": ["l0"]},
}


@pytest.mark.parametrize("case", sorted(GOOD))
def test_accepted(case: str) -> None:
    check_plan(_plan(**GOOD[case]))


def test_frozen_parameters_are_not_sharded() -> None:
    # ZeRO leaves a frozen parameter whole: its other replicated axis does not matter
    plan = _plan(zero_stage=3, zero_axis=1, offload="params")
    check_plan(plan, frozen={"w"})
    with pytest.raises(PlanError, match=r"\(offload='params'\)"):
        check_plan(plan, frozen={"v"})


def test_zero_axes_of_one_device_shard_nothing() -> None:
    one = dataclasses.replace(_plan(zero_stage=1, zero_axis=[0, 1]),
                              mesh=MeshSpec.preset("cpu-gloo", shape=(1, 2)))
    assert zero_axes_in_use(one) == (1,)
    assert zero_axes_in_use(_plan()) == ()
