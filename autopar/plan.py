"""The Plan: every decision the search made, its price, and how to read it.

A Plan prints as a table (``print(plan)``), explains one node
(``plan.explain("linear_3")``), diffs against another plan and round-trips through
JSON, so a plan made on a laptop can be shipped to the cluster and lowered there.
Placements are stored in their short string form (``"S(0)R"``: one entry per mesh axis).

The JSON carries ``schema_version`` (:data:`SCHEMA_VERSION`), the autopar and torch
versions that wrote it; reading it checks the schema (another one is an error saying to
re-plan or re-export), rejects keys this autopar does not know (a plan from a newer
autopar) and checks every placement against the mesh and the tensor's shape, naming the
file, the node and the field (:class:`~autopar.errors.LoadError`).
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from autopar.cost_models import MeshSpec, format_bytes
from autopar.errors import LoadError

SCHEMA_VERSION = 1
"""Version of the plan JSON layout; bumped whenever a field changes meaning or goes away."""

_VERSION_KEYS = ("schema_version", "autopar_version", "torch_version")


def versions() -> dict[str, Any]:
    """What the files autopar writes record about their writer: schema, autopar and
    torch versions (torch's decides the generated code's semantics)."""
    import importlib.metadata

    import torch

    try:
        mine = importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        mine = "unknown"
    return {"schema_version": SCHEMA_VERSION, "autopar_version": mine,
            "torch_version": torch.__version__}


@dataclass
class Redistribution:
    """Collectives inserted on one input edge of a node."""

    input: str
    src: str
    dst: str
    steps: list[str]
    seconds: float


@dataclass
class Alternative:
    """A strategy the search did not choose, priced with the neighbours fixed."""

    inputs: list[str]
    outputs: list[str]
    seconds: float


@dataclass
class NodePlan:
    """The decision for one graph node."""

    name: str
    op: str
    kind: str  # "input", "param", "buffer", "op"
    shape: list[list[int]]
    inputs: list[str]
    in_placements: list[str]
    out_placements: list[str]
    compute: float = 0.0
    comm: float = 0.0
    memory: float = 0.0
    param: str | None = None
    layer: str = ""
    redistributions: list[Redistribution] = field(default_factory=list)
    alternatives: list[Alternative] = field(default_factory=list)


@dataclass
class SolverInfo:
    """Which searcher produced the plan and how it ended."""

    searcher: str
    backend: str
    status: str
    gap: float | None
    seconds: float
    message: str = ""
    problem_nodes: int = 0
    problem_edges: int = 0


class Schedule(StrEnum):
    """How micro-batches flow through pipeline stages."""

    NONE = "none"
    """No pipeline (one stage); micro-batches, if any, are gradient accumulation."""
    GPIPE = "gpipe"
    """All forwards, then all backwards: every stage holds all micro-batches' activations."""
    ONE_F_ONE_B = "1f1b"
    """Warm-up forwards, then one forward / one backward: stage ``s`` of ``p`` holds at
    most ``p - s`` micro-batches' activations."""


@dataclass
class Decisions:
    """Plan-level decisions beside the per-node placements (issue: ZeRO, pipeline,
    recomputation, gradient accumulation), with the numbers that justify them.

    ``pipeline_stages > 1`` adds a leading pipeline axis to the device mesh: the plan's
    ``mesh`` is then each stage's sub-mesh and ``stages[s]`` lists the layer keys
    (:mod:`autopar.layers`) of stage ``s``.  ``micro_batches`` splits the global batch
    (the graph was captured at the micro-batch size); without a pipeline it is the
    number of gradient accumulation steps.  ``zero_stage`` 1/2/3 shards optimizer state
    / gradients / parameters of replicated parameters over sub-mesh axis ``zero_axis``.
    ``recompute`` lists layer keys whose activations are recomputed in backward.
    ``why`` maps each decision to a sentence with its memory and time effect.
    """

    pipeline_stages: int = 1
    schedule: str = Schedule.NONE.value
    micro_batches: int = 1
    stages: list[list[str]] = field(default_factory=list)
    zero_stage: int = 0
    zero_axis: int | None = None
    recompute: list[str] = field(default_factory=list)
    global_batch: int = 0
    stage_seconds: list[float] = field(default_factory=list)
    stage_memory: list[float] = field(default_factory=list)
    step_seconds: float = 0.0
    why: dict[str, str] = field(default_factory=dict)

    def stage_of(self, layer: str) -> int:
        """Pipeline stage holding ``layer`` (0 without a pipeline)."""
        for s, keys in enumerate(self.stages):
            if layer in keys:
                return s
        if self.pipeline_stages > 1:
            raise KeyError(f"layer {layer!r} is in no pipeline stage")
        return 0


@dataclass
class Plan:
    """A complete parallel plan for one model on one mesh."""

    mesh: MeshSpec
    nodes: dict[str, NodePlan]
    objective: float
    compute_seconds: float
    comm_seconds: float
    grad_sync_seconds: float
    memory: dict[str, float]
    solver: SolverInfo
    pins: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    decisions: Decisions = field(default_factory=Decisions)

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: the sub-mesh size times the pipeline stages."""
        return self.mesh.size * self.decisions.pipeline_stages

    # ------------------------------------------------------------ queries
    def placement(self, name: str) -> str:
        """Output placement of node or parameter ``name`` (graph node name or param FQN)."""
        return self._find(name).out_placements[0]

    def params(self) -> dict[str, str]:
        """Parameter FQN -> placement."""
        return {n.param: n.out_placements[0] for n in self.nodes.values() if n.kind == "param"}

    def collectives(self) -> list[tuple[str, str]]:
        """(node, step) for every collective the forward issues, in graph order."""
        out = []
        for n in self.nodes.values():
            for r in n.redistributions:
                for s in r.steps:
                    if not s.startswith(("local_slice", "to_partial")):
                        out.append((n.name, s))
        return out

    def _find(self, name: str) -> NodePlan:
        if name in self.nodes:
            return self.nodes[name]
        for n in self.nodes.values():
            if n.param == name:
                return n
        raise KeyError(f"no node or parameter named {name!r} in the plan")

    # ------------------------------------------------------------ explaining
    def explain(self, name: str) -> str:
        """Why node ``name`` got its strategy (its price and the best alternatives), or
        why a plan-level decision was taken: ``"pipeline"`` (stages and schedule),
        ``"zero"``, ``"micro_batches"``, ``"recompute"``, or a layer key such as
        ``"blocks.7"`` (is it recomputed, which stage holds it)."""
        d = self.decisions
        aliases = {"stages": "pipeline", "schedule": "pipeline", "optimizer": "zero",
                   "accumulation": "micro_batches", "gradient_accumulation": "micro_batches"}
        key = aliases.get(name, name)
        if key in d.why:
            return d.why[key]
        layers = {n.layer for n in self.nodes.values()}
        if name in layers:
            where = f"stage {d.stage_of(name)} of {d.pipeline_stages}" if d.pipeline_stages > 1 \
                else "the only stage"
            if f"layer:{name}" in d.why:
                return d.why[f"layer:{name}"] + f"; it runs on {where}"
            return f"{name} runs on {where} and is not recomputed: " + d.why.get(
                "recompute", "its activations fit the budget")
        n = self._find(name)
        lines = [f"{n.name} ({n.op}, shape {n.shape}) on mesh {self.mesh.shape} "
                 f"axes {self.mesh.axis_names}:",
                 f"  chosen: inputs {n.in_placements} -> output {n.out_placements}; "
                 f"compute {n.compute * 1e3:.4f} ms, communication {n.comm * 1e3:.4f} ms, "
                 f"memory {format_bytes(n.memory)}"]
        for r in n.redistributions:
            lines.append(f"  input {r.input}: {r.src} -> {r.dst} via {', '.join(r.steps)} "
                         f"({r.seconds * 1e3:.4f} ms)")
        if n.alternatives:
            best = min(a.seconds for a in n.alternatives)
            lines.append("  alternatives (this node's cost with its neighbours' choices fixed):")
            for a in n.alternatives:
                lines.append(f"    inputs {a.inputs} -> {a.outputs}: {a.seconds * 1e3:.4f} ms"
                             f" (+{(a.seconds - best) * 1e3:.4f} ms)")
        return "\n".join(lines)

    def diff(self, other: Plan) -> str:
        """Nodes whose placements differ between ``self`` and ``other``."""
        lines = []
        for name, a in self.nodes.items():
            b = other.nodes.get(name)
            if b is None:
                lines.append(f"{name}: only in this plan")
            elif (a.in_placements, a.out_placements) != (b.in_placements, b.out_placements):
                lines.append(f"{name}: {a.in_placements}->{a.out_placements} vs "
                             f"{b.in_placements}->{b.out_placements}")
        lines.append(f"objective {self.objective * 1e3:.4f} ms vs {other.objective * 1e3:.4f} ms")
        return "\n".join(lines)

    # ------------------------------------------------------------ printing
    def table(self, max_rows: int | None = None, show_views: bool = False) -> str:
        """The plan as a text table (rich); views and getitems are hidden by default."""
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"autopar plan: mesh {self.mesh.shape} {self.mesh.axis_names} "
                        f"({self.mesh.name}), searcher {self.solver.searcher}/{self.solver.backend}")
        for col in ("node", "op", "shape", "placement", "inserted collectives",
                    "compute ms", "comm ms", "memory"):
            t.add_column(col, overflow="fold")
        rows = 0
        for n in self.nodes.values():
            if not show_views and n.kind == "op" and n.compute == 0 and not n.redistributions \
                    and n.memory == 0:
                continue
            if max_rows is not None and rows >= max_rows:
                t.add_row("...", "", "", "", "", "", "", "")
                break
            coll = "; ".join(f"{r.input}: {' '.join(r.steps)}" for r in n.redistributions
                             if any(not s.startswith("local") for s in r.steps))
            t.add_row(n.param or n.name, n.op, "x".join(map(str, n.shape[0])) if n.shape else "",
                      ",".join(n.out_placements), coll, f"{n.compute * 1e3:.4f}",
                      f"{n.comm * 1e3:.4f}", format_bytes(n.memory))
            rows += 1
        mem = self.memory
        d = self.decisions
        decided = (
            f"step time {d.step_seconds * 1e3:.4f} ms: "
            + (f"{d.pipeline_stages} pipeline stages ({d.schedule}), " if d.pipeline_stages > 1 else "")
            + f"{d.micro_batches} micro-batch(es), "
            + (f"ZeRO-{d.zero_stage} over axis {d.zero_axis}, " if d.zero_stage else "no ZeRO, ")
            + (f"recompute {', '.join(d.recompute)}" if d.recompute else "no recomputation")
            + "; per micro-batch: ") if d.step_seconds else ""
        t.caption = decided + (
            f"time {self.objective * 1e3:.4f} ms = compute {self.compute_seconds * 1e3:.4f} + "
            f"communication {self.comm_seconds * 1e3:.4f} + gradient sync "
            f"{self.grad_sync_seconds * 1e3:.4f}; memory per device "
            f"{format_bytes(mem.get('total', 0))} (params {format_bytes(mem.get('params', 0))}, "
            f"grads {format_bytes(mem.get('grads', 0))}, optimizer "
            f"{format_bytes(mem.get('optimizer', 0))}, activations "
            f"{format_bytes(mem.get('activations', 0))}); solver {self.solver.status}"
            + (f", gap {self.solver.gap:.2%}" if self.solver.gap else "")
            + f" in {self.solver.seconds:.2f} s"
            + (f"; {self.solver.message}" if self.solver.message else "")
        )
        buf = io.StringIO()
        Console(file=buf, width=170, force_terminal=False, color_system=None).print(t)
        return buf.getvalue()

    def __str__(self) -> str:
        return self.table()

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """Plain-data form (JSON-serialisable), with the writer's versions."""
        d = versions() | asdict(self)
        d["mesh"] = self.mesh.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "the plan") -> Plan:
        """Inverse of :meth:`to_dict`.  Raises :class:`~autopar.errors.LoadError`
        naming ``source`` (the file) and the field for another schema version, unknown
        or missing keys, and placements that do not fit the mesh; warns when the plan
        was made with another torch version."""
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
                          "the model's captured graph changed", stacklevel=2)
        try:
            _known(d, cls, source, "", set(_VERSION_KEYS))
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
            rest = {k: v for k, v in d.items()
                    if k not in ("mesh", "nodes", "solver", "decisions", *_VERSION_KEYS)}
            try:
                mesh = MeshSpec.from_dict(d["mesh"])
            except (ValueError, TypeError) as e:
                raise LoadError(f"{source}: field mesh: {e}") from e
            plan = cls(mesh=mesh, nodes=nodes, solver=SolverInfo(**d["solver"]),
                       decisions=Decisions(**d.get("decisions", {})), **rest)
        except KeyError as e:
            raise LoadError(f"{source}: required field {e} is missing (truncated or hand-edited?): "
                            "re-export") from e
        except TypeError as e:
            raise LoadError(f"{source}: {e} (a field is missing or has the wrong type): "
                            "re-export") from e
        plan.check_placements(source)
        return plan

    def check_placements(self, source: str = "the plan") -> None:
        """Every placement string has one entry per mesh axis, shards a dim the tensor
        has, and the mesh axes sharding a dim divide it; raises
        :class:`~autopar.errors.LoadError` naming ``source``, the node and the field."""
        from autopar.placement import parse_placements, shard_factor

        mesh = tuple(self.mesh.shape)
        shapes = {n.name: n.shape for n in self.nodes.values()}

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

        for n in self.nodes.values():
            for i, text in enumerate(n.out_placements):
                check(n.name, f"out_placements[{i}]", text, n.shape[i] if i < len(n.shape) else None)
            for i, text in enumerate(n.in_placements):
                src = shapes.get(n.inputs[i]) if i < len(n.inputs) else None
                check(n.name, f"in_placements[{i}]", text, src[0] if src and len(src) == 1 else None)

    def to_json(self, path: str | Path | None = None) -> str:
        """JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> Plan:
        """Load a plan from a JSON file or text; a missing, unreadable or malformed file
        is a :class:`~autopar.errors.LoadError` naming it."""
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


def _known(d: Any, kind: type, source: str, where: str, extra: set[str] = frozenset()) -> None:
    """Raise :class:`LoadError` for keys of ``d`` that ``kind`` has no field for."""
    if not isinstance(d, dict):
        raise LoadError(f"{source}: field {where or 'top level'} should be an object, got "
                        f"{type(d).__name__}")
    unknown = sorted(set(d) - {f.name for f in fields(kind)} - extra)
    if unknown:
        raise LoadError(f"{source}: unknown key {unknown[0]!r} in {where or 'the top level'}"
                        f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; it was "
                        "probably written by a newer autopar: upgrade autopar or re-export with "
                        "this one")
