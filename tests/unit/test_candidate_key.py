"""``autopar.verify.candidate_key`` and the shortlist's merging of equal candidates (what
``autopar check`` measures): two plans are one candidate only when the mesh, every field
a plan-level decision records (the registry, :data:`autopar.plans.decisions.DECISIONS`)
and every parameter's placement agree."""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest

from autopar import MeshSpec, Plan
from autopar import plan as make_plan
from autopar.cli.check import _read_plans
from autopar.plans.decisions import DECISIONS, RESULT_FIELDS
from autopar.plans.kinds import GradCompression, Offload
from autopar.verify import candidate_key, shortlist
from tests.dist.harness import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import mlp  # noqa: E402

MESH = MeshSpec.preset("cpu-gloo", shape=(2,))


@pytest.fixture(scope="module")
def base() -> Plan:
    # ZeRO-1 under accumulation: a plan where split gathers and multi-copy overlap apply
    return make_plan(*mlp.build(), MESH, zero_stage=1, micro_batches=2, search="drec",
                     time_limit=5.0)


def _with(p: Plan, **fields: Any) -> Plan:
    """A copy of ``p`` that differs in the given decision fields only."""
    q = copy.deepcopy(p)
    for name, value in fields.items():
        assert getattr(q.decisions, name) != value, f"{name} is already {value!r}"
        setattr(q.decisions, name, value)
    return q


def _variants(base: Plan) -> dict[str, Plan]:
    """Plans equal to ``base`` but for one decision the old hand-kept key left out."""
    targets = sorted(base.params())
    return {
        "offload": _with(base, offload=Offload.OPTIMIZER.value),
        "grad_compression": _with(base, grad_compression=GradCompression.BF16.value),
        "compression_rank": _with(base, grad_compression=GradCompression.POWERSGD.value,
                                  compression_rank=4),
        "copies": _with(base, copies=2),
        "gather_chunks": _with(base, gather_chunks=[targets[:1], targets[1:]]),
    }


def test_plans_differing_in_offload_compression_copies_or_gather_chunks_are_not_merged(
        base, tmp_path):
    variants = {"base": base, **_variants(base)}
    keys = {name: candidate_key(p) for name, p in variants.items()}
    assert len(set(keys.values())) == len(keys), keys.keys()
    # ``autopar check --candidates a.json b.json ...``: the saved plans as check reads
    # them, then the shortlist it measures; each stays its own candidate
    paths = []
    for name, p in variants.items():
        paths.append(str(tmp_path / f"{name}.json"))
        p.to_json(paths[-1])
    given = _read_plans(paths)
    sl = shortlist(None, k=len(given), candidates=given)
    assert sl.duplicates == 0
    assert {id(c.plan) for c in sl.candidates} == {id(p) for p in given}

def _changed(value: Any) -> Any:
    """Another value of the same JSON kind as ``value``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, ["another"]]
    if isinstance(value, dict):
        return {**value, "another": 1}
    assert value is None, value
    return 1


def test_every_field_a_decision_records_enters_the_key(base):
    """Derived from the registry: a decision added there counts without editing verify.py."""
    fields = sorted({f for d in DECISIONS for f in d.fields})
    assert {"offload", "grad_compression", "copies", "gather_chunks", "grad_buckets"} <= set(fields)
    k0 = candidate_key(base)
    for name in fields:
        q = _with(base, **{name: _changed(getattr(base.decisions, name))})
        assert candidate_key(q) != k0, f"Decisions.{name} does not enter candidate_key"
    # a parameter's placement counts too; the numbers that justify a plan do not
    q = copy.deepcopy(base)
    node = next(n for n in q.nodes.values() if n.kind == "param")
    node.out_placements = ["S(1)" if node.out_placements[0] != "S(1)" else "R",
                           *node.out_placements[1:]]
    assert candidate_key(q) != k0
    for name in RESULT_FIELDS:
        q = _with(base, **{name: _changed(getattr(base.decisions, name))})
        assert candidate_key(q) == k0, f"the result field {name} splits equal plans"
    sl = shortlist(None, k=2, candidates=[base, _with(base, step_seconds=1.0)])
    assert sl.duplicates == 1 and len(sl.candidates) == 1
