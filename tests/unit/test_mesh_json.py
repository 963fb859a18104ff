"""``MeshSpec``'s JSON keeps every field: a mesh with every field away from its default
(the fields listed by :func:`dataclasses.fields`, so a new field is covered without
editing this test) comes back equal, and files written before a field existed still
load, the missing fields at their defaults."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields, replace
from typing import Any, get_args, get_type_hints

import pytest
from autopar.cost_models import LinkSpec
from autopar.cost_models.mesh import RANGES

from autopar import MeshSpec
from tests.dist.harness import ROOT

OLD_FILE = ROOT / "tests" / "fixtures" / "gloo_curves_4ranks.json"
"""A calibrated mesh saved before most of today's fields existed."""

# Values to try, by a field's annotation (first valid one that is not the default wins):
# a field of a new type fails below until its values are added here.
_CANDIDATES: dict[str, tuple[Any, ...]] = {
    "float": (3.7e14, 1.37, 0.37),  # large for rates, 1 < x for factors, < 1 for shares
    "float | None": (3.7e14,),
    "int | None": (4,),
    "str": ("a mesh of its own",),
    "bool": (True,),
    "LinkSpec | None": (LinkSpec(2e-6, 3e10, kinds=(("all_gather", 3e-6, 2e10),)),),
    "tuple[str, ...]": (("all_reduce",),),
    "tuple[tuple[float, float], ...]": (((1e6, 1e11), (1e9, 2e11)),),
}


def _every_field_changed() -> MeshSpec:
    """A mesh whose every field with a default holds another valid value; the required
    ones (shape, axis names, links) are a 2-D mesh with named axes and links that span
    nodes."""
    m = MeshSpec.preset("multinode-a100-ib", shape=(2, 16), axis_names=("pp", "dp"))
    for f in fields(MeshSpec):
        if f.default is MISSING:
            continue
        assert f.type in _CANDIDATES, f"add values for MeshSpec.{f.name}'s type {f.type!r}"
        for value in _CANDIDATES[f.type]:
            try:
                changed = replace(m, **{f.name: value})
            except ValueError:  # out of this field's range: the next value
                continue
            if getattr(changed, f.name) != f.default:
                m = changed
                break
        else:
            pytest.fail(f"no valid non-default value for MeshSpec.{f.name} in {_CANDIDATES[f.type]}")
    return m


def test_every_field_survives_the_json_round_trip():
    m = _every_field_changed()
    assert all(getattr(m, f.name) != f.default for f in fields(MeshSpec) if f.default is not MISSING)
    assert m.links[1].hierarchical and m.axis_names == ("pp", "dp")
    text = m.to_json()
    assert set(json.loads(text)) == {f.name for f in fields(MeshSpec)}
    back = MeshSpec.from_json(text)
    for f in fields(MeshSpec):
        assert getattr(back, f.name) == getattr(m, f.name), f"MeshSpec.{f.name} lost in JSON"
    assert back == m and back.to_json() == text


def test_a_file_written_before_the_newer_fields_loads_with_their_defaults():
    old = json.loads(OLD_FILE.read_text())
    m = MeshSpec.from_json(OLD_FILE)
    missing = {f.name for f in fields(MeshSpec)} - set(old)
    assert {"matmul_curve", "straggler", "host_memory", "search_shape"} <= missing
    for f in fields(MeshSpec):
        if f.name in missing:
            assert getattr(m, f.name) == f.default, f.name
    d = m.to_dict()
    assert {k: d[k] for k in old if k != "calibration"} == {k: v for k, v in old.items()
                                                            if k != "calibration"}
    assert MeshSpec.from_dict(d) == m


def test_every_number_field_is_checked() -> None:
    """Every float field of MeshSpec has its interval in ``RANGES`` (``__post_init__``
    checks them from there, not from hand-kept lists: a number field added without one
    fails here), and each rejects a value outside it, naming the field."""
    hints = get_type_hints(MeshSpec)
    numbers = {f.name for f in fields(MeshSpec) if float in (hints[f.name], *get_args(hints[f.name]))}
    assert numbers == set(RANGES), numbers ^ set(RANGES)
    m = MeshSpec.preset("cpu-gloo", shape=(2,))
    for name, interval in RANGES.items():
        bad = [interval.lo - 1 if math.isfinite(interval.lo) else -math.inf, math.nan, True, "1"]
        if math.isfinite(interval.hi):
            bad.append(interval.hi + 1)
        if not interval.optional:
            bad.append(None)
        for v in bad:
            with pytest.raises(ValueError, match=f"MeshSpec.{name} must be a number in"):
                replace(m, **{name: v})
