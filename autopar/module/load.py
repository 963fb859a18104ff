"""Loading an export directory (:mod:`autopar.module.export` describes its layout).

Two phases.  First each rank, alone, finds the complete export
(:func:`autopar.module.export_io.resolve`), checks the manifest (schema version, world size)
and the sha256 of every file it reads, parses ``plan.json`` (placements checked against
the mesh), ``meta.json``, runs ``module.py``, loads its ``rank{r}.pt`` and retraces the
forward.  Then the ranks agree (:func:`autopar.module.export_io.agree`): if any rank failed,
every rank raises that rank's error, same type and message, naming the file.  Only then
does the mesh start and the ParallelModule get built (collectives), so no rank waits for
a peer that already gave up.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import re
import sys
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import fx
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError, LoadError, MeshMismatchError, user_stacklevel
from autopar.module import export_io
from autopar.module.export import EXTRA_KEY, _retrace
from autopar.module.state import TensorInfo
from autopar.plans.data import Plan
from autopar.plans.placement import local_shape, parse_placements
from autopar.runtime.inputs import InputBinder
from autopar.runtime.mesh import init_plan_mesh

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule


def _stand_ins(plan: Plan, state: dict, owner: dict[str, int], params: set[str]) -> dict:
    """Meta-device stand-ins for the other pipeline stages' parameters and buffers: the
    stage split resolves every target of the graph before this rank drops the ones
    other stages hold, and they take no memory."""
    out = {}
    rep = parse_placements("R" * len(plan.mesh.shape))
    for n in plan.nodes.values():
        t = n.param
        if n.kind in ("param", "buffer") and t and t not in state and t in owner:
            pl = parse_placements(n.out_placements[0]) if t in params else rep
            out[t] = (torch.empty(local_shape(tuple(n.shape[0]), pl, plan.mesh.shape),
                                  device="meta"), t in params)
    return out


class _Parts(NamedTuple):
    """What phase 1 of :func:`load_module` read and checked."""

    plan: Plan
    meta: dict
    module: types.ModuleType
    state: dict


_META_KEYS = {"aliases", "state_keys", "in_spec", "out_spec", "graph", "tensors", "inputs"}


def _read_export(directory: Path, rank: int, world: int | None) -> _Parts:
    """Phase 1 of loading, local to this rank (no collectives): find the complete export,
    check the manifest and this rank's files, parse them.  Every failure is an
    :class:`~autopar.errors.AutoparError` naming the file."""
    found, warning = export_io.resolve(directory)
    if warning:
        warnings.warn(warning, stacklevel=user_stacklevel())
    manifest = export_io.read_manifest(found)
    if world is not None and manifest["world_size"] != world:
        raise MeshMismatchError(
            f"{found} was exported for {manifest['world_size']} ranks (mesh {manifest['mesh']}, "
            f"{manifest['pipeline_stages']} pipeline stage(s)) but the world size is {world}; "
            f"launch {manifest['world_size']} ranks or re-plan and re-export for {world}")
    rank_file = f"rank{rank}.pt"
    # every shared file (README too: the export is one unit) and this rank's tensors;
    # the other ranks check theirs, and load_module's agreement makes that everyone's
    shared = [n for n in manifest["files"] if not re.fullmatch(r"rank\d+\.pt", n)]
    export_io.verify(found, manifest, sorted({"plan.json", "meta.json", "module.py", *shared})
                     + [rank_file])
    plan = Plan.from_json(found / "plan.json")
    d = plan.decisions
    if (list(plan.mesh.shape), d.pipeline_stages) != (manifest["mesh"], manifest["pipeline_stages"]):
        raise LoadError(f"{found / 'plan.json'}: mesh {list(plan.mesh.shape)} with "
                        f"{d.pipeline_stages} stage(s) but {export_io.MANIFEST} records "
                        f"{manifest['mesh']} with {manifest['pipeline_stages']}: the plan was "
                        "edited; re-export")
    try:
        meta = json.loads((found / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{found / 'meta.json'} is not valid JSON ({e}); export again") from e
    if not isinstance(meta, dict) or set(meta) != _META_KEYS:
        keys = sorted(set(meta) ^ _META_KEYS) if isinstance(meta, dict) else ["(not an object)"]
        raise LoadError(f"{found / 'meta.json'}: unexpected or missing key {keys[0]!r} (written by "
                        "another autopar?): export again with this autopar")
    spec = importlib.util.spec_from_file_location(f"autopar_generated_{abs(hash(str(found)))}",
                                                  found / "module.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        mod.Generated  # noqa: B018 - a module.py without it is no export
    except Exception as e:  # noqa: BLE001 - any failure of generated code: name the file
        raise LoadError(f"{found / 'module.py'} does not run ({type(e).__name__}: {e}); "
                        "export again") from e
    sys.modules[spec.name] = mod
    try:
        state = torch.load(found / rank_file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises OSError, RuntimeError, pickle errors
        raise LoadError(f"{found / rank_file} cannot be read by torch.load ({type(e).__name__}: "
                        f"{e}); export again") from e
    if not isinstance(state, dict):
        raise LoadError(f"{found / rank_file} holds a {type(state).__name__}, not this rank's "
                        "tensors; export again")
    return _Parts(plan, meta, mod, state)


def _build_inner(parts: _Parts, directory: Path) -> tuple[fx.GraphModule, Any, Any]:
    """The retraced forward and input/output specs (local; errors name the files)."""
    plan, meta, state = parts.plan, parts.meta, dict(parts.state)
    state.pop(EXTRA_KEY, None)
    d = plan.decisions
    if d.pipeline_stages > 1:
        owner = {n.param: d.rank_of(n.layer) for n in plan.nodes.values()
                 if n.kind in ("param", "buffer") and n.param}
        state = state | _stand_ins(plan, state, owner, set(plan.params()))
    try:
        inner = _retrace(parts.module.Generated(state), vars(parts.module), meta["graph"])
        in_spec = pytree.treespec_loads(meta["in_spec"]) if meta["in_spec"] else None
        out_spec = pytree.treespec_loads(meta["out_spec"]) if meta["out_spec"] else None
    except Exception as e:  # noqa: BLE001 - inconsistent files: name them
        raise LoadError(f"{directory}: module.py, meta.json and this rank's tensors do not fit "
                        f"together ({type(e).__name__}: {e}); export again") from e
    return inner, in_spec, out_spec


def load_module(directory: str | Path, batch: str = "global", timeout: float = 600.0) -> ParallelModule:
    """Build this rank's ParallelModule from an export directory (no planning).

    Collective: every rank first checks the manifest, the checksums and the contents of
    the files it needs, then the ranks agree, so a missing, truncated, corrupt or
    inconsistent export raises the same :class:`~autopar.errors.LoadError` (or
    :class:`~autopar.errors.MeshMismatchError`) on every rank, naming the file, before
    any rank starts collectives that its peers would never join.  ``batch`` is as in
    :func:`autopar.auto_parallel` (``"local"``: each data-parallel rank passes its part);
    ``timeout`` (seconds) is the collective timeout of a process group created here."""
    # cycle: autopar.module.parallel imports this one (through autopar.module.clone)
    from autopar.module.parallel import ParallelModule

    directory = Path(directory).absolute()
    if not dist.is_initialized() and "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=timeout))
    world = dist.get_world_size() if dist.is_initialized() else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    err: AutoparError | None = None
    try:
        parts = _read_export(directory, rank, world)
        inner, in_spec, out_spec = _build_inner(parts, directory)
    except AutoparError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - never a bare error on one rank only
        err = LoadError(f"loading {directory} failed: {type(e).__name__}: {e}")
    export_io.agree(err)
    plan, meta = parts.plan, parts.meta
    init_plan_mesh(plan)
    binder = InputBinder(in_spec, [tuple(s) if s is not None else None for s in meta["inputs"]["shapes"]],
                         list(meta["inputs"]["names"]))
    extra = parts.state.get(EXTRA_KEY, ({}, False))[0]
    return ParallelModule(inner, plan, meta["aliases"], in_spec, out_spec, meta["state_keys"],
                          None, runtime=True, info=TensorInfo.from_json(meta["tensors"]),
                          binder=binder, batch=batch, extra=extra)
