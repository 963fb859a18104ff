"""Gradient compression priced (decision ``grad_compression``): the bytes a gradient
puts on the link, the search weighing it only when allowed and picking it only where
the data-parallel reduction is what the step waits for."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar import MeshSpec
from autopar.errors import ConfigError
from autopar.plans.decisions import PlanOptions
from autopar.runtime.compression import low_rank
from autopar.search.compression import bucket_terms, kinds
from autopar.search.stages.layer_stats import ParamStat
from tests.dist.compression_cases import DATA_PARALLEL, Wide, _task

MESH = MeshSpec.preset("cpu-gloo", shape=(4,))


def test_wire_bytes() -> None:
    square = ParamStat(4.0 * 1024 * 1024, (0,), "w", (1024, 1024))
    assert bucket_terms(square, "none", 0, MESH) == (square.bytes, 0.0)
    assert bucket_terms(square, "bf16", 0, MESH)[0] == square.bytes / 2
    # P (1024 x 4) and Q (1024 x 4) in fp32 instead of the 1024 x 1024 matrix
    wire, work = bucket_terms(square, "powersgd", 4, MESH)
    assert wire == (1024 + 1024) * 4 * 4 and work > 0
    # a bias, and a matrix whose factors would be over half its size, go whole
    assert bucket_terms(ParamStat(4096.0, (0,), "b", (1024,)), "powersgd", 4, MESH)[0] == 4096.0
    assert low_rank((16, 8), 4) is None and low_rank((64, 64), 4) == (64, 64, 4)
    assert low_rank((8, 4, 3, 3), 2) == (8, 36, 2)  # a conv weight: (out, in x kh x kw)


def test_kinds_only_when_allowed() -> None:
    assert kinds(PlanOptions()) == [("none", 0)]
    assert kinds(PlanOptions(grad_compression="bf16")) == [("bf16", 0)]
    assert kinds(PlanOptions(grad_compression="powersgd", compression_rank=8)) == [("powersgd", 8)]
    assert [k for k, _ in kinds(PlanOptions(grad_compression="auto"))] == ["none", "bf16", "powersgd"]


def _plan(width: int, rows: int, **kw):
    torch.manual_seed(0)
    return autopar.plan(Wide(width, 4), example_inputs=_task(width, rows), mesh=MESH,
                        pins=DATA_PARALLEL, zero_stage=0, **kw)


def test_auto_picks_compression_only_where_the_reduction_is_waited_for() -> None:
    # 4 rows a rank of a 1024-wide MLP: 16 MiB of gradients against 1 MFLOP a row
    comm = _plan(1024, 16, grad_compression="auto")
    plain = _plan(1024, 16)
    assert comm.decisions.grad_compression == "bf16"
    assert comm.decisions.step_seconds < plain.decisions.step_seconds
    assert "without compression takes" in comm.explain("compression")
    assert "compression    gradients are sent in bf16" in comm.summary()
    # 4,096 rows a rank of a 128-wide one: the reduction hides under the backward
    compute = _plan(128, 16384, grad_compression="auto")
    assert compute.decisions.grad_compression == "none"
    assert "bf16 takes" in compute.explain("compression")
    # not allowed, never weighed (it changes the numbers)
    assert plain.decisions.grad_compression == "none"
    assert "grad_compression='auto'" in plain.explain("compression")


def test_forced_kind_travels_with_the_plan() -> None:
    p = _plan(256, 16, grad_compression="powersgd", compression_rank=2)
    assert (p.decisions.grad_compression, p.decisions.compression_rank) == ("powersgd", 2)
    back = autopar.Plan.from_json(p.to_json())
    assert (back.decisions.grad_compression, back.decisions.compression_rank) == ("powersgd", 2)
    # PowerSGD's error feedback holds one more copy of the reduced gradients
    assert p.memory["compression"] == pytest.approx(4 * (256 * 256 + 256) * 4)
    assert json.loads(p.to_json())["decisions"]["grad_compression"] == "powersgd"


def test_listed_and_drawn_as_they_run() -> None:
    p = _plan(256, 16, grad_compression="powersgd")
    cs = p.collectives()
    # P: a 256 x 4 factor per weight and the four biases whole; Q: a 256 x 4 factor per weight
    assert sum(c.bytes for c in cs if "PowerSGD P" in c.what) == 4 * 256 * 4 * 4 + 4 * 256 * 4
    assert sum(c.bytes for c in cs if "PowerSGD Q" in c.what) == 4 * 256 * 4 * 4
    assert not [c for c in cs if c.kind == "all_reduce" and "PowerSGD" not in c.what
                and "gradient bucket" in c.what]
    from autopar.report.timeline import predicted_events
    assert any("PowerSGD r4" in e.label for e in predicted_events(p))


@pytest.mark.parametrize("kw", [{"grad_compression": "fp8"}, {"compression_rank": 0}])
def test_bad_values_are_refused(kw) -> None:
    with pytest.raises(ConfigError):
        _plan(64, 16, **kw)
