"""Reading a plan back from JSON: the bodies of :meth:`Plan.from_dict
<autopar.plans.Plan.from_dict>`, :meth:`Plan.check_placements
<autopar.plans.Plan.check_placements>` and :meth:`Plan.from_json
<autopar.plans.Plan.from_json>`.

Loading is where every user-facing :class:`~autopar.errors.LoadError` of a plan file is
raised (schema, unknown keys, placements that do not fit); it is separate from
:mod:`autopar.plans` so the plan's records read without the validation.  The methods on
:class:`~autopar.plans.Plan` delegate to these functions (imported lazily there, since
this module imports :mod:`autopar.plans`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.cost_models import MeshSpec
from autopar.errors import LoadError, user_stacklevel
from autopar.plans.data import (
    _VERSION_KEYS,
    SCHEMA_VERSION,
    Alternative,
    NodePlan,
    Redistribution,
    Request,
    SolverInfo,
    _known,
    versions,
)
from autopar.plans.decisions import Decisions
from autopar.plans.placement import parse_placements, shard_factor

if TYPE_CHECKING:
    from autopar.plans.data import Plan

__all__ = ["check_placements", "plan_from_dict", "plan_from_json"]


def plan_from_dict(cls: type[Plan], d: dict, source: str = "the plan") -> Plan:
    """What :meth:`Plan.from_dict <autopar.plans.Plan.from_dict>` returns (``cls`` is the
    class it was called on)."""
    if not isinstance(d, dict):
        raise LoadError(f"{source}: expected a JSON object, got {type(d).__name__}")
    ver = d.get("schema_version")
    if ver != SCHEMA_VERSION:
        raise LoadError(
            f"{source}: schema_version {ver!r} but this autopar (schema {SCHEMA_VERSION}) "
            f"reads only {SCHEMA_VERSION}; it was written by autopar "
            f"{d.get('autopar_version', 'before schema versions')}: re-export (or re-plan) "
            "with this autopar, or load it with the autopar that wrote it")
    if d.get("torch_version") not in (None, versions()["torch_version"]):
        warnings.warn(f"{source} was written with torch {d['torch_version']} but this is "
                      f"torch {versions()['torch_version']}; the plan loads, but re-plan if "
                      "the model's captured graph changed", stacklevel=user_stacklevel())
    try:
        _known(d, cls, source, "", {*_VERSION_KEYS, "summary"})
        nodes = {}
        for k, v in d["nodes"].items():
            where = f"nodes.{k}"
            _known(v, NodePlan, source, where)
            v = dict(v)
            for key, kind in (("redistributions", Redistribution), ("alternatives", Alternative)):
                for i, r in enumerate(v.get(key, [])):
                    _known(r, kind, source, f"{where}.{key}[{i}]")
                v[key] = [kind(**r) for r in v.get(key, [])]
            nodes[k] = NodePlan(**v)
        _known(d["solver"], SolverInfo, source, "solver")
        _known(d.get("decisions", {}), Decisions, source, "decisions")
        _known(d.get("request", {}), Request, source, "request")
        # "summary" is derived (to_dict writes it for readers of the JSON): not read back
        rest = {k: v for k, v in d.items() if k not in
                ("mesh", "nodes", "solver", "decisions", "request", "summary", *_VERSION_KEYS)}
        try:
            mesh = MeshSpec.from_dict(d["mesh"])
        except (ValueError, TypeError) as e:
            raise LoadError(f"{source}: field mesh: {e}") from e
        plan = cls(mesh=mesh, nodes=nodes, solver=SolverInfo(**d["solver"]),
                   decisions=Decisions(**d.get("decisions", {})),
                   request=Request(**d.get("request", {})), **rest)
    except KeyError as e:
        raise LoadError(f"{source}: required field {e} is missing (truncated or hand-edited?): "
                        "re-export") from e
    except TypeError as e:
        raise LoadError(f"{source}: {e} (a field is missing or has the wrong type): "
                        "re-export") from e
    plan.check_placements(source)
    return plan


def check_placements(plan: Plan, source: str = "the plan") -> None:
    """What :meth:`Plan.check_placements <autopar.plans.Plan.check_placements>` checks."""
    mesh = tuple(plan.mesh.shape)
    shapes = {n.name: n.shape for n in plan.nodes.values()}

    def check(node: str, fld: str, text: str, shape: list[int] | None) -> None:
        where = f"{source}: node {node!r} field {fld} = {text!r}"
        try:
            pl = parse_placements(text)
        except (ValueError, TypeError) as e:
            raise LoadError(f"{where}: {e}") from e
        if len(pl) != len(mesh):
            raise LoadError(f"{where} has {len(pl)} entries but the plan's mesh {mesh} has "
                            f"{len(mesh)} axes: the mesh or the placements were edited; "
                            "re-plan for this mesh and re-export")
        if shape is None:
            return
        for p in pl:
            dim = getattr(p, "dim", None)
            if dim is not None and not 0 <= dim < len(shape):
                raise LoadError(f"{where} shards dim {dim} of a tensor of shape {shape}: "
                                "re-plan and re-export")
        for dim, size in enumerate(shape):
            f = shard_factor(pl, mesh, dim)
            if size % f:
                raise LoadError(f"{where}: mesh {mesh} cuts dim {dim} (size {size}) into {f} "
                                "pieces, which does not divide it: re-plan for this mesh "
                                "and re-export")

    for n in plan.nodes.values():
        for i, text in enumerate(n.out_placements):
            check(n.name, f"out_placements[{i}]", text, n.shape[i] if i < len(n.shape) else None)
        for i, text in enumerate(n.in_placements):
            src = shapes.get(n.inputs[i]) if i < len(n.inputs) else None
            check(n.name, f"in_placements[{i}]", text, src[0] if src and len(src) == 1 else None)


def plan_from_json(cls: type[Plan], path_or_text: str | Path) -> Plan:
    """What :meth:`Plan.from_json <autopar.plans.Plan.from_json>` returns (``cls`` is the
    class it was called on)."""
    s = str(path_or_text)
    is_text = s.lstrip().startswith("{")
    source = "plan JSON text" if is_text else s
    try:
        text = s if is_text else Path(s).read_text()
        d = json.loads(text)
    except OSError as e:
        raise LoadError(f"cannot read plan file {s}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{source} is not valid JSON ({e}): the file is truncated or "
                        "corrupt; re-export or re-plan") from e
    return cls.from_dict(d, source)
