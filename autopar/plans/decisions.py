"""Every plan-level decision, declared once: the registry (:data:`DECISIONS`).

A *decision* is something the plan decides for the whole model beside each node's
placement: ZeRO, pipeline stages, micro-batches, recomputation, precision, gradient
buckets, ... .  Its entry (:class:`Decision`) names

* the ``auto_parallel`` / ``autopar.plan`` keywords that force it (:class:`Option`, with
  the check of the value; a forced value travels in :class:`PlanOptions`),
* the JSON fields of :class:`Decisions` that record what was decided (two plans
  whose fields agree decided the same: :func:`decision_key`),
* the ``plan.explain(...)`` key that says why.

Where the search prices a decision and where the runtime applies it are the functions
themselves: each is decorated where it is defined, ``@prices("zero")`` in the search,
``@applies("zero")`` in the runtime (the plan data imports nothing above it, so the
layers above register into it), and :attr:`Decision.price` / :attr:`Decision.apply`
return them.  ``tests/unit/test_decisions.py`` checks the registry against the fields
of :class:`Decisions` and :class:`PlanOptions`, the keywords the API accepts and the
hooks registered after ``import autopar``, so a decision cannot be half-added.
``docs/architecture.md`` has the recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from autopar.plans.kinds import (
    CONTEXT_PARALLEL,
    GRAD_COMPRESSIONS,
    OFFLOADS,
    POWERSGD_RANK,
    SCHEDULES,
    GradCompression,
    Offload,
    Schedule,
)
from autopar.plans.option_checks import (
    copies_check,
    flag,
    layer_names,
    mesh_axis,
    one_of,
    positive_int,
    precision,
    zero_axes_value,
    zero_stage,
)

if TYPE_CHECKING:
    from autopar.cost_models import MeshSpec


@dataclass
class Decisions:
    """Plan-level decisions beside the per-node placements (ZeRO, pipeline,
    recomputation, gradient accumulation), with the numbers that justify them.

    ``pipeline_stages > 1`` adds a leading pipeline axis to the device mesh: the plan's
    ``mesh`` is then each stage's sub-mesh and ``stages[s]`` lists the layer keys
    (:mod:`autopar.capture.layers`) of stage ``s``.  Under the interleaved schedule,
    ``stages`` lists ``pipeline_stages * virtual_stages`` virtual stages in model order
    and virtual stage ``k`` runs on pipeline rank ``k % pipeline_stages``;
    ``stage_seconds``, ``stage_memory`` and ``stage_parts`` are per rank (its chunks
    summed).  ``micro_batches`` splits the global batch
    (the graph was captured at the micro-batch size); without a pipeline it is the
    number of gradient accumulation steps.  ``zero_stage`` 1/2/3 shards optimizer state
    / gradients / parameters of replicated parameters over sub-mesh axis ``zero_axis``
    (or over several axes at once).
    ``recompute`` lists layer keys whose activations are recomputed in backward: the
    layers the model checkpoints itself (``torch.utils.checkpoint``), and those the
    memory budget asks for.
    ``why`` maps each decision to a sentence with its memory and time effect.
    """

    pipeline_stages: int = 1
    pipeline_axis: int = 0
    """The axis of the requested mesh (``Plan.request.mesh_shape``) the stages were
    carved from: 0, the outermost (across nodes), or a later one (inside a node); each
    stage is a contiguous block of that axis (:func:`autopar.plans.splits.stage_ranks`)."""
    schedule: str = Schedule.NONE.value
    virtual_stages: int = 1
    """Model chunks per pipeline rank (> 1 only under ``Schedule.INTERLEAVED``)."""
    sliced_sends: list[int] = field(default_factory=list)
    """The pipeline ranks whose stages send each value replicated over sub-mesh axes as
    one slice per rank, all-gathered by the next stage (:mod:`autopar.runtime.stage_wire`),
    where the search priced that faster than sending it whole from every rank."""
    micro_batches: int = 1
    stages: list[list[str]] = field(default_factory=list)
    zero_stage: int = 0
    zero_axis: int | list[int] | None = None
    """The sub-mesh axis ZeRO shards over, or several (a list: one group spanning them,
    ranks in row-major order); :attr:`zero_axes` reads either form."""
    recompute: list[str] = field(default_factory=list)
    zero_kept: list[str] = field(default_factory=list)
    """Under ZeRO-3: layer keys whose whole parameters stay gathered from their forward
    to their backward (FSDP2's ``reshard_after_forward=False``): no re-gather in
    backward, for their bytes held at the activation peak (chosen per layer where the
    memory budget allows, or ``reshard_after_forward=``)."""
    grad_buffers_kept: bool = False
    """The data-parallel gradient buckets keep their buffers between steps, as DDP's
    (runtime/grad_sync.py): the gradients they reduce are counted whole from the start
    of the step, chosen where that memory fits the budget (False: a new buffer per
    bucket each backward, freed with the gradients at ``zero_grad()``; plans made
    before this choice load so)."""
    zero_reduce_once: bool = False
    """Under ZeRO-3 with micro-batches and no pipeline: each rank accumulates whole gradients
    and reduce-scatters them once, in the last micro-batch's backward (where it fits and pays)."""
    precision: str = "native"
    """``"native"`` (the model's own dtypes), ``"bf16-mixed"`` or ``"fp16-mixed"``: the graph was captured
    with :mod:`autopar.capture.mixed_precision`'s casts, which every rank re-applies."""
    compile: bool = False
    """Runs through ``torch.compile``, priced with inductor's fusion (:mod:`autopar.search.fusion`)."""
    pack: bool = False
    """Right-padded batches run packed, padding dropped (:mod:`autopar.runtime.packing`)."""
    batch: str = "global"
    """``"global"``: every rank passes the whole batch and gets outputs replicated;
    ``"local"``: each data-parallel rank passes its part and gets its rows of every
    batch-shaped output (:func:`autopar.plans.placement.returned_placement`)."""
    local_axes: list[int] | None = None
    """Under ``batch="local"``: the mesh axes that split the returned rows (the first
    batch-shaped output's ``Shard(0)`` axes), which are then the data-parallel axes the
    caller's sampler follows; None when no output is batch-shaped."""
    global_batch: int = 0
    stage_seconds: list[float] = field(default_factory=list)
    stage_memory: list[float] = field(default_factory=list)
    step_seconds: float = 0.0
    why: dict[str, str] = field(default_factory=dict)
    stage_parts: list[dict[str, float]] = field(default_factory=list)
    """Per stage: its per-micro-batch ``stage_seconds`` split into ``compute``,
    ``recompute`` and ``comm``, and the step's tail ``sync_exposed`` + ``gather_step``
    (with ``sync``, all gradient reduction): what :mod:`autopar.report.timeline` draws."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """``step_seconds`` on the slowest stage split into ``compute_seconds`` (forward,
    backward and recomputation), ``exposed_comm_seconds`` (collectives on the critical
    path: the ops' own, ZeRO gathers, pipeline sends, the gradient sync left after the
    last backward), ``bubble_seconds`` (pipeline fill and drain) and ``optimizer_seconds``
    (the optimizer's update of this device's parameters, memory-bound); these four sum to
    the step.  ``hidden_comm_seconds`` is gradient sync overlapped with backward (not in
    the sum)."""
    grad_buckets: list[list[str]] = field(default_factory=list)
    """Data-parallel gradient buckets in launch order (parameter targets), chosen by
    :mod:`autopar.search.buckets` (or ``bucket_bytes=`` each); the runtime reduces
    exactly these.  Empty in plans made before buckets were planned: the runtime then
    falls back to 4 MiB buckets."""
    grad_compression: str = GradCompression.NONE.value
    """How the data-parallel gradient buckets are sent (:class:`GradCompression`); ZeRO's
    own reduce-scatters are never compressed."""
    compression_rank: int = 0  # PowerSGD's rank (0 without PowerSGD)
    offload: str = Offload.NONE.value  # what lives in host memory between steps (Offload)
    copies: int = 1
    """Multi-copy overlap: the step's ``micro_batches`` (then 2) halves of the batch run
    as copies interleaved in one forward and backward, one copy's collectives running
    while the other computes (:mod:`autopar.passes.multi_copy`); 1: none."""
    host_memory: float = 0.0  # host bytes per device of offloaded state (the fullest stage's)
    gather_chunks: list[list[str]] = field(default_factory=list)
    """ZeRO-1/2's gathers of the updated parameters, in chunks of parameter targets in
    forward order, one in flight at a time, each waited for where its first parameter
    is read (:mod:`autopar.search.gathers`); empty: one blocking gather before the
    forward."""
    mesh_shapes: list[dict[str, Any]] = field(default_factory=list)
    """When the mesh shape was searched (``MeshSpec.preset(name, devices=N)``): each shape
    considered, fastest first, with its best plan's predicted ``step_seconds`` (None: no
    plan fits or none could beat the chosen shape), ``memory``, ``layout``, whether it
    was ``estimated`` from the shallow copy and a ``note`` (:mod:`autopar.search.mesh_shapes`).
    Empty for a mesh given whole."""
    collectives: list[dict[str, Any]] = field(default_factory=list)
    """What :meth:`Plan.collectives` lists (:class:`autopar.plans.collective_record.Collective`
    in JSON form), computed from the captured graph when the plan is made."""

    @property
    def zero_axes(self) -> tuple[int, ...]:
        """The ZeRO axes as a sorted tuple (empty without ZeRO)."""
        return zero_axes(self.zero_axis) if self.zero_stage else ()

    def rank_of(self, layer: str) -> int:
        """Pipeline rank (stage of the mesh's pipeline axis) running ``layer``: its
        virtual stage modulo the pipeline stages."""
        return self.stage_of(layer) % max(1, self.pipeline_stages)

    def stage_of(self, layer: str) -> int:
        """Pipeline stage holding ``layer`` (0 without a pipeline); under the interleaved
        schedule, its virtual stage."""
        for s, keys in enumerate(self.stages):
            if layer in keys:
                return s
        if self.pipeline_stages > 1:
            raise KeyError(f"layer {layer!r} is in no pipeline stage")
        return 0


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the search.

    ``memory_budget`` is bytes per device the plan may fill (default: the mesh's
    :attr:`~autopar.cost_models.mesh.MeshSpec.usable_memory`, its capacity less the
    preset's reserve; a budget given here is used as it is);
    ``optimizer`` sizes optimizer state; ``time_limit`` bounds the search in seconds,
    capture not counted (the best feasible plan is returned when it runs out, and the plan
    says so; a joint search splits it between exploring and planning the chosen split at
    full depth, :mod:`autopar.search.budget`); ``search`` is
    ``"ilp"``, ``"drec"`` or ``"auto"`` (:class:`Searcher`).
    """

    memory_budget: float | None = None
    optimizer: str = "adamw"
    time_limit: float = 30.0
    search: str = "ilp"
    pins: dict = field(default_factory=dict)
    # plan-level decisions (autopar/search/joint.py): None = searched, a value = forced
    zero_stage: int | None = None
    zero_axes: tuple[int, ...] | None = None  # the sub-mesh axes ZeRO shards over; None = searched
    pipeline_stages: int | None = None
    # the mesh axis the stages are carved from (0: across nodes); None = searched
    pipeline_axis: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    # model chunks per pipeline rank under schedule="interleaved-1f1b"; None = searched
    virtual_stages: int | None = None
    recompute: tuple[str, ...] | None = None
    explore: bool = False  # also try pipelines/micro-batches when the plain plan fits
    bucket_bytes: int | None = None  # fixed gradient bucket size; None = chosen (MG-WFBP)
    # ZeRO-3: True re-gathers every layer in backward, False keeps every layer gathered
    # from forward to backward; None = chosen per layer under the memory budget
    reshard_after_forward: bool | None = None
    # the data-parallel gradient buckets' buffers kept between steps (as DDP's): True,
    # False, or None = kept where the memory budget allows (Decisions.grad_buffers_kept)
    keep_grad_buffers: bool | None = None
    # data-parallel gradients sent compressed (GradCompression): None or "none" = never,
    # "auto" = where the search prices it faster, "bf16" / "powersgd" = forced
    grad_compression: str | None = None
    compression_rank: int | None = None  # PowerSGD's rank; None = POWERSGD_RANK
    # what lives in host memory (Offload): None = none, unless no plan fits the devices
    # (then weighed as under "auto"); "auto" = weighed; a level = forced
    offload: str | None = None
    # multi-copy overlap: None = off, 2 = forced, "auto" = searched (Decisions.copies)
    copies: int | str | None = None
    # ZeRO-1/2's gathers after the step in forward-order chunks (Decisions.gather_chunks):
    # True, False (one blocking gather) or None = where the cost model prices them faster
    split_gathers: bool | None = None
    # the sequence split attention may use (autopar.plans.kinds.ContextParallel:
    # "off", "gather-kv", "exchange"); None = searched
    context_parallel: str | None = None
    # "native" (the model's dtypes), "bf16-mixed" or "fp16-mixed" (autopar/capture/mixed_precision.py): never
    # searched, since it changes the numbers the model computes
    precision: str = "native"
    compile: bool = False  # priced and run compiled; auto_parallel resolves None (api.compiles)
    pack: bool = False  # right-padded batches packed (captured and priced packed)
    # "global": outputs returned replicated; "local": each data-parallel rank passes its
    # part of the batch and gets its rows of batch-shaped outputs back (as with DDP)
    batch: str = "global"
    # plan as if the model's repeated block were stacked this many times (deep models
    # planned from a shallow capture of identical blocks; planning only)
    blocks: int | None = None
    progress: bool = False  # print per-phase progress lines on stderr
    # the limit ``search="auto"`` compares the ILP's predicted build time with: the user's
    # whole time_limit even when a joint search passes what is left of it, so the
    # searcher depends on the problem's size, never on how busy the machine is
    choose_limit: float | None = None

    def budget_for(self, mesh: MeshSpec) -> float:
        """Bytes per device the plan may fill on ``mesh``: ``memory_budget`` as given,
        else the device less its reserve (:attr:`MeshSpec.usable_memory`)."""
        return self.memory_budget if self.memory_budget is not None else mesh.usable_memory


def zero_axes(axis: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """A ZeRO axis field (None, one axis, or several) as a sorted tuple of axes."""
    if axis is None:
        return ()
    if isinstance(axis, int):
        return (axis,)
    return tuple(sorted(int(a) for a in axis))


# ---------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Option:
    """A keyword of ``auto_parallel`` / ``autopar.plan`` that forces (part of) a decision;
    ``None`` (the default) leaves it to the search."""

    name: str
    check: Callable[[str, Any], None]
    """Raises :class:`~autopar.errors.ConfigError` naming the keyword for a bad value."""
    doc: str


@dataclass(frozen=True)
class Decision:
    """One plan-level decision (see the module docstring)."""

    name: str
    doc: str
    options: tuple[Option, ...]
    fields: tuple[str, ...]
    """The :class:`Decisions` fields (``plan.json``'s ``decisions``) that record it."""
    explain: str | None = None
    """What ``plan.explain(...)`` takes to say why (``None``: see the nodes' placements)."""
    summary: str | None = None
    """The label of its line in ``plan.summary()`` (the ``explain`` text); ``None``: no line."""
    summary_if: Callable[[Decisions], bool] | None = None
    """Shown only where this holds (a decision that changes the numbers, said when
    taken); ``None``: whenever the search explained it."""
    forced_only: bool = False
    """Never searched: every plan records the value its one keyword forces (one option,
    one field of the same name); a price hook only where that value changes prices."""
    choices: tuple[Any, ...] = ()
    """A searched decision's values, each priced as its own config when the keyword
    leaves it to the search (the search's :class:`Config` field that ``DECIDED_BY``
    names takes them, and the plan records the chosen one); empty where the search
    enumerates the values itself."""

    @property
    def price(self) -> Callable[..., Any] | None:
        """The function the search prices it with (registered by :func:`prices`)."""
        return _HOOKS["price"].get(self.name)

    @property
    def apply(self) -> Callable[..., Any] | None:
        """The function that applies it to the model (registered by :func:`applies`)."""
        return _HOOKS["apply"].get(self.name)


_HOOKS: dict[str, dict[str, Callable[..., Any]]] = {"price": {}, "apply": {}}
_F = TypeVar("_F", bound=Callable[..., Any])


def prices(*names: str) -> Callable[[_F], _F]:
    """Decorator: the function it decorates is where the search prices the decisions
    ``names`` (:attr:`Decision.price`)."""
    return _hook("price", names)


def applies(*names: str) -> Callable[[_F], _F]:
    """Decorator: the function it decorates applies the decisions ``names`` to the
    model (:attr:`Decision.apply`)."""
    return _hook("apply", names)


def _hook(kind: str, names: tuple[str, ...]) -> Callable[[_F], _F]:
    """Register the decorated function as the ``kind`` hook of each of ``names``: a name
    the registry lacks, or a decision already hooked, is a ValueError at import."""
    known = {d.name for d in DECISIONS}
    table = _HOOKS[kind]

    def register(fn: _F) -> _F:
        for name in names:
            if name not in known:
                raise ValueError(f"{fn.__qualname__}: no decision {name!r} in DECISIONS to {kind}")
            if name in table:
                raise ValueError(f"decision {name!r} has two {kind} hooks: "
                                 f"{table[name].__qualname__} and {fn.__qualname__}")
        table.update(dict.fromkeys(names, fn))
        return fn
    return register


DECISIONS: tuple[Decision, ...] = (
    Decision("pipeline", "pipeline stages carved from one mesh axis, their layers and schedule",
             (Option("pipeline_stages", positive_int, "stages (1: no pipeline)"),
              Option("pipeline_axis", mesh_axis, "the mesh axis the stages are carved from"),
              Option("schedule", one_of(SCHEDULES, fold_case=True), "gpipe, 1f1b, interleaved-1f1b, zero-bubble"),
              Option("virtual_stages", positive_int, "model chunks per rank (interleaved)")),
             ("pipeline_stages", "pipeline_axis", "schedule", "virtual_stages", "stages", "sliced_sends"),
             "pipeline",
             summary="pipeline"),
    Decision("micro_batches", "micro-batches per step: gradient accumulation, or a pipeline's",
             (Option("micro_batches", positive_int, "micro-batches per step"),),
             ("micro_batches",), "micro_batches", summary="micro-batches"),
    Decision("zero", "ZeRO stage and the mesh axes it shards over",
             (Option("zero_stage", zero_stage, "0, 1, 2 or 3"),
              Option("zero_axes", zero_axes_value, "a mesh axis or several")),
             ("zero_stage", "zero_axis"), "zero", summary="ZeRO"),
    Decision("zero_kept", "ZeRO-3 layers kept gathered from forward to backward",
             (Option("reshard_after_forward", flag, "True: re-gather every layer in backward"),),
             ("zero_kept",), "zero"),
    Decision("zero_reduce_once", "ZeRO-3 under accumulation reduce-scatters once a step",
             (), ("zero_reduce_once",), "zero"),
    Decision("recompute", "layers whose activations are recomputed in backward",
             (Option("recompute", layer_names, "layer keys, e.g. ['blocks.0']"),),
             ("recompute",), "recompute", summary="recompute"),
    Decision("grad_buckets", "the data-parallel gradient buckets (MG-WFBP)",
             (Option("bucket_bytes", positive_int, "fixed-size buckets of this many bytes"),),
             ("grad_buckets",), "buckets", summary="grad buckets"),
    Decision("grad_buffers", "the gradient buckets' buffers kept between steps, as DDP's",
             (Option("keep_grad_buffers", flag, "True: keep; False: a new buffer each step"),),
             ("grad_buffers_kept",), "buckets"),
    Decision("grad_compression", "data-parallel gradients sent in bf16 or low rank (changes "
             "the numbers: searched only under grad_compression='auto')",
             (Option("grad_compression", one_of(GRAD_COMPRESSIONS, none=True), "none, bf16, powersgd or auto"),
              Option("compression_rank", positive_int, f"PowerSGD's rank (default {POWERSGD_RANK})")),
             ("grad_compression", "compression_rank"), "compression",
             summary="compression", summary_if=lambda d: d.grad_compression != "none"),
    Decision("copies", "each micro-batch as two copies interleaved, one's collectives beside "
             "the other's compute (multi-copy overlap)",
             (Option("copies", copies_check, "2 or auto"),),
             ("copies",), "copies", summary="copies", summary_if=lambda d: d.copies > 1),
    Decision("offload", "optimizer state (and ZeRO-3 parameter shards) kept in host memory",
             (Option("offload", one_of(OFFLOADS, none=True), "none, optimizer, params or auto"),),
             ("offload",), "offload", summary="offload", summary_if=lambda d: d.offload != "none"),
    Decision("gather_chunks", "ZeRO-1/2's gathers after the step split into chunks sent in "
             "forward order, each waited for by its own layers (the next forward's first layers first)",
             (Option("split_gathers", flag, "True: in chunks; False: one blocking gather"),),
             ("gather_chunks",), "gathers",
             summary="gathers", summary_if=lambda d: bool(d.gather_chunks)),
    Decision("precision", "the dtypes the step computes in (autocast's casts in the graph; "
             "never searched, since it changes the numbers the model computes)",
             (Option("precision", precision, "native, bf16-mixed or fp16-mixed"),),
             ("precision",), forced_only=True),
    Decision("context_parallel", "attention on sequence chunks (its placements are the nodes')",
             (Option("context_parallel", one_of(CONTEXT_PARALLEL, none=True), "off, gather-kv or exchange"),),
             ()),
    Decision("compile", "runs through torch.compile, its pointwise chains priced as inductor fuses them",
             (Option("compile", flag, "True: priced and run compiled"),), ("compile",), forced_only=True,
             explain="compile"),
    Decision("pack", "right-padded batches run packed: their padding dropped, sequences back to back",
             (Option("pack", flag, "True: packed"),), ("pack",), forced_only=True),
    Decision("batch", "who passes which samples: the whole batch everywhere, or each rank its part",
             (), ("batch", "local_axes")),
)
"""Every plan-level decision."""

RESULT_FIELDS: tuple[str, ...] = (
    "global_batch", "stage_seconds", "stage_memory", "step_seconds", "why", "stage_parts",
    "breakdown", "collectives", "mesh_shapes", "host_memory")
""":class:`Decisions` fields that are no decision: the numbers that justify them (the
mesh shapes weighed justify ``Plan.request.mesh_shape``, which the ``mesh`` argument, not a
keyword, forces)."""

SEARCH_KNOBS: tuple[str, ...] = ("explore", "blocks", "progress")
"""Keywords that steer the search without deciding anything of the plan."""


EXPLAIN_SYNONYMS: dict[str, str] = {"optimizer": "zero", "accumulation": "micro_batches",
                                    "gradient_accumulation": "micro_batches"}
"""Words a user may pass to ``plan.explain`` for a decision besides its keywords and fields."""


def explain_keys() -> list[str]:
    """The decisions ``plan.explain`` says why of (each entry's ``explain`` key), and
    ``"shapes"``."""
    return sorted({d.explain for d in DECISIONS if d.explain}) + ["shapes"]


def explain_aliases() -> dict[str, str]:
    """Every keyword and field of a decision (and :data:`EXPLAIN_SYNONYMS`), mapped to
    the key ``plan.explain`` says why under."""
    out = {name: d.explain for d in DECISIONS if d.explain
           for name in (*(o.name for o in d.options), *d.fields)}
    return {**out, **EXPLAIN_SYNONYMS}


def decision_options() -> dict[str, Option]:
    """Every forcing keyword, by name."""
    return {o.name: o for d in DECISIONS for o in d.options}


def decision_fields() -> tuple[str, ...]:
    """Every :class:`Decisions` field a decision records, in registry order."""
    return tuple(dict.fromkeys(f for d in DECISIONS for f in d.fields))


def decision_key(decisions: Decisions) -> tuple[tuple[str, Any], ...]:
    """What ``decisions`` decided, hashable: ``(field, value)`` for each
    :func:`decision_fields` entry (lists as tuples, dicts as sorted items), so two plans
    compare by every decision the registry knows, a new one's fields included."""
    return tuple((f, _frozen(getattr(decisions, f))) for f in decision_fields())


def forced_values(opts: PlanOptions) -> dict[str, Any]:
    """The :class:`Decisions` field of each forced-only decision, as ``opts`` forces it."""
    return {d.fields[0]: getattr(opts, d.options[0].name) for d in DECISIONS if d.forced_only}


def _frozen(value: Any) -> Any:
    """``value`` (a JSON-like field) hashable: lists as tuples, dicts as sorted items."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def check_options(given: dict[str, Any]) -> None:
    """Check the forced values in ``given`` (``None`` is "search it")."""
    options = decision_options()
    for name, value in given.items():
        if value is not None and name in options:
            options[name].check(name, value)
    for name in ("blocks",):
        if given.get(name) is not None:
            positive_int(name, given[name])


__all__ = ["DECISIONS", "RESULT_FIELDS", "SEARCH_KNOBS", "EXPLAIN_SYNONYMS", "explain_aliases",
           "explain_keys", "Decision", "Decisions", "Option", "PlanOptions", "applies", "check_options",
           "decision_fields", "decision_key", "decision_options", "forced_values", "prices", "zero_axes"]
