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

Reading JSON back and checking it is :mod:`autopar.plans.json`.  The methods that read
a plan in words (``summary``, ``table``, ``explain``, ``diff``) and ``verify`` hand on to
functions :mod:`autopar.report` and :mod:`autopar.verify` register
(:func:`register_reader`): the plan data imports nothing above it.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from autopar.cost_models import MeshSpec
from autopar.errors import LoadError
from autopar.plans.collective_record import Collective
from autopar.plans.decisions import Decisions, explain_keys, zero_axes

SCHEMA_VERSION = 1
"""Version of the plan JSON layout; bumped whenever a field changes meaning or goes away."""

_VERSION_KEYS = ("schema_version", "autopar_version", "torch_version")


def versions() -> dict[str, Any]:
    """What the files autopar writes record about their writer: schema, autopar and
    torch versions (torch's decides the generated code's semantics)."""
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
    flops: float = 0.0
    """Forward FLOPs of the op on the whole (unsharded) micro-batch."""
    local_seconds: float = 0.0
    """This node's price with its neighbours' choices fixed (its own cost plus its
    edges' redistributions): the number :attr:`alternatives` are comparable with."""
    redistributions: list[Redistribution] = field(default_factory=list)
    alternatives: list[Alternative] = field(default_factory=list)
    own_comm: float = 0.0
    """Seconds of :attr:`compute` that are the op's own exchanges (context-parallel
    attention, expert dispatch, distributed cross-entropy), not edge redistributions."""
    lowering: str = ""
    """What the op's local form does when it communicates itself, in words
    (:func:`autopar.sharding.local_forms.describe`); empty for ops that do not."""
    dtype: str = ""
    """The dtype of the node's (first) output, as torch names it (``"float32"``): what
    :meth:`Plan.predict` prices its bytes and FLOP rate in; empty in plans written before
    it was recorded (then read as float32)."""


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


@dataclass
class Request:
    """What the plan was asked for and the work one training step does: the mesh as the
    user gave it (before pipeline stages were carved out of one of its axes), the memory
    budget per device, and per step the tokens (0 when the model takes no token ids) and
    the model FLOPs (forward + backward of the whole global batch, backward counted as
    twice the forward as in the usual MFU convention).  The summary derives tokens/s,
    samples/s and MFU from them."""

    mesh_shape: list[int] = field(default_factory=list)
    memory_budget_bytes: float = 0.0
    tokens_per_step: int = 0
    model_flops_per_step: float = 0.0


def zero_words(axis: int | list[int] | tuple[int, ...] | None) -> str:
    """``"mesh axis 1"`` or ``"mesh axes 0 and 1"``, for messages."""
    axes = zero_axes(axis)
    if len(axes) == 1:
        return f"mesh axis {axes[0]}"
    return "mesh axes " + ", ".join(map(str, axes[:-1])) + f" and {axes[-1]}"


def compile_words(compiled: bool) -> str:
    """``plan.explain("compile")``: whether the graph runs compiled, and how it was priced."""
    if compiled:
        return ("compiled: the generated graph runs through torch.compile (compile=True, the "
                "default under NCCL) and is priced so: each chain of pointwise ops in a layer one "
                "fused kernel, its launches and memory traffic counted once")
    return ("eager: the generated graph runs op by op, as priced (compile=False, the default on a "
            "CPU, where the compiled step measured 0.93-1.09x the eager one on 4 gloo ranks for "
            "minutes of compiling; compile=True compiles)")


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
    request: Request = field(default_factory=Request)

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

    def collectives(self, stage: int | None = None) -> list[Collective]:
        """Every collective one training step issues on a rank, forward, backward and
        once per step, with the bytes it puts in and how often it runs
        (:class:`~autopar.plans.collective_record.Collective`): the edges' redistributions and
        their backward duals, the loss's sum, the distributed cross-entropy's, Ulysses'
        all-to-alls, the gradient buckets, ZeRO's gathers and reductions and a
        pipeline's messages, as the runtime issues them (compare with
        :func:`autopar.runtime.trace.collective_log`).  ``stage``: only those of that
        pipeline rank (they differ per stage).  Not listed yet: ring attention's shifts
        and the uneven expert dispatch of ``moe_experts``.  Empty for a plan made
        without a joint search (``make_plan``)."""
        out = [Collective.from_dict(c) for c in self.decisions.collectives]
        return out if stage is None else [c for c in out if c.stage == stage]

    def redistributions(self) -> list[tuple[str, str]]:
        """(node, step) for every redistribution step on the plan's edges that
        communicates, in graph order (forward; each runs its dual in backward)."""
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
        raise KeyError(self._unknown(name))

    def explainable(self) -> list[str]:
        """Every name :meth:`explain` accepts: decisions, layer keys, parameters, nodes."""
        names = explain_keys()
        names += sorted({n.layer for n in self.nodes.values() if n.layer})
        names += [n.param for n in self.nodes.values() if n.param]
        return names + list(self.nodes)

    def _unknown(self, name: str) -> str:
        known = self.explainable()
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        return (f"no node, parameter, layer or decision named {name!r} in the plan; {hint}"
                f"decisions: {', '.join(explain_keys())}; layers: "
                f"{', '.join(sorted({n.layer for n in self.nodes.values() if n.layer})) or 'none'}"
                "; parameters and nodes: see plan.explainable()")

    # ------------------------------------------------------------ explaining
    def explain(self, name: str) -> str:
        """Why node ``name`` got its strategy (its price and the best alternatives), or
        why a plan-level decision was taken: ``"pipeline"`` (stages and schedule),
        ``"zero"``, ``"micro_batches"``, ``"recompute"``, ``"buckets"`` (the gradient
        buckets), ``"shapes"`` (the shape the plan was priced at, the shapes it serves,
        the step predicted at a few others), or a layer key such as
        ``"blocks.7"`` (is it recomputed, which stage holds it)."""
        return _reader("explain")(self, name)

    def predict(self, batch: int | None = None, seq: int | None = None) -> float:
        """Predicted seconds per training step at global ``batch`` and sequence length
        ``seq`` (None: the shape the plan was priced at, whose step this then is
        exactly), from the plan's own prices, without a new search: each op priced again
        at the new shape, edge collectives grown with their bytes, parameter-sized terms
        constant (:func:`autopar.report.shapes.predict` says what scales how).  A plan
        with pipeline stages or micro-batches serves only its own shape: another raises
        :class:`~autopar.errors.ConfigError`."""
        return _reader("predict")(self, batch, seq)

    def diff(self, other: Plan, max_nodes: int | None = None) -> str:
        """What differs between ``self`` (A) and ``other`` (B): layout, step time, memory
        and decisions first, then the nodes whose placements differ (at most
        ``max_nodes`` of them, all when None)."""
        return _reader("diff")(self, other, max_nodes)

    # ------------------------------------------------------------ printing
    def table(self, max_rows: int | None = None, show_views: bool = False, *, nodes: bool = False,
              fmt: str = "text", width: int | None = None) -> str:
        """The per-layer view (repeated layers folded), or with ``nodes=True`` one row per
        graph node (views and getitems hidden unless ``show_views``).  ``fmt="tsv"``
        gives the node rows tab-separated, for grep and spreadsheets; ``width`` overrides
        the terminal's width."""
        if nodes or fmt == "tsv":
            return _reader("node_table")(self, max_rows=max_rows, show_views=show_views, fmt=fmt,
                                         width=width)
        return _reader("layer_view")(self, width)

    def verify(self, model, example_inputs: tuple = (), **options):
        """Train this plan and its best variants for a few steps on the live job and
        report predicted against measured step time; every rank calls it
        (:func:`autopar.verify.verify`: ``k``, ``steps``, ``pick``, ``store``, ...)."""
        return _reader("verify")(self, model, example_inputs, **options)

    def summary(self) -> str:
        """The plan in words: layout per mesh axis, step time split, throughput and MFU,
        memory against the budget, decisions and why (:mod:`autopar.report.summary`)."""
        return _reader("summary")(self)

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()

    # ------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        """Plain-data form (JSON-serialisable), with the writer's versions."""
        d = versions() | asdict(self)
        d["mesh"] = self.mesh.to_dict()
        d["summary"] = _reader("summary_numbers")(self)
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "the plan") -> Plan:
        """Inverse of :meth:`to_dict`.  Raises :class:`~autopar.errors.LoadError`
        naming ``source`` (the file) and the field for another schema version, unknown
        or missing keys, and placements that do not fit the mesh; warns when the plan
        was made with another torch version."""
        from autopar.plans.json import plan_from_dict  # cycle: autopar.plans.json imports this one

        return plan_from_dict(cls, d, source)

    def check_placements(self, source: str = "the plan") -> None:
        """Every placement string has one entry per mesh axis, shards a dim the tensor
        has, and the mesh axes sharding a dim divide it; raises
        :class:`~autopar.errors.LoadError` naming ``source``, the node and the field."""
        # cycle: autopar.plans.json imports this one
        from autopar.plans.json import check_placements

        check_placements(self, source)

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
        from autopar.plans.json import plan_from_json  # cycle: autopar.plans.json imports this one

        return plan_from_json(cls, path_or_text)


_READERS: dict[str, Callable[..., Any]] = {}
READERS = ("summary", "summary_numbers", "layer_view", "node_table", "explain", "diff", "verify",
           "predict")
"""The ways a plan is read that its methods hand on: the plan data imports nothing above
it, so :mod:`autopar.report` (and :mod:`autopar.verify` for ``"verify"``) registers
these with :func:`register_reader` when ``autopar`` is imported, which importing any of
its modules does first."""


def register_reader(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn`` what the :class:`Plan` method for ``name`` (one of :data:`READERS`) calls."""
    if name not in READERS:
        raise ValueError(f"unknown plan reader {name!r}; known: {', '.join(READERS)}")
    _READERS[name] = fn


def _reader(name: str) -> Callable[..., Any]:
    fn = _READERS.get(name)
    if fn is None:  # only while autopar itself is still being imported
        raise RuntimeError(f"plan.{name} is not available yet: autopar is still importing "
                           "(autopar.report registers it)")
    return fn


# Kept here rather than in plan_load (its only user) so it stays importable from
# autopar.plans without an import cycle.
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
