"""What the pipeline part of the joint search (:mod:`autopar.search.stages.pipeline_step`) prices and
returns: a :class:`Config` of discrete choices, each stage's :class:`StagePrice`, and
the :class:`Priced` whole with its step-time breakdown.

A :class:`Config` holds one value per plan decision of the registry
(:data:`autopar.plans.decisions.DECISIONS`): :data:`DECIDED_BY` maps each
:class:`~autopar.plans.decisions.Decisions` field to the :class:`Config` field that
decides it, :data:`AFTER_SEARCH` lists the fields no config holds and why, and
``tests/unit/test_config_fields.py`` checks that every field of the registry is in one
of them, so a searched decision cannot be added without its :class:`Config` field.  A
decision whose entry lists its ``choices`` needs nothing more here: each config takes
one of them (:func:`choice_fields`) and the plan records it (:func:`chosen_fields`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from autopar.plans.decisions import DECISIONS, PlanOptions
from autopar.plans.kinds import Schedule


@dataclass(frozen=True, kw_only=True)
class Config:
    """Discrete choices priced together (by keyword: seventeen fields in a row are
    easy to misplace)."""

    stages: int = 1
    micro_batches: int = 1
    schedule: str = Schedule.NONE.value
    zero_stage: int = 0
    zero_axis: int | tuple[int, ...] | None = None  # one axis, or several at once
    recompute: tuple[str, ...] | None = None  # forced recomputed layer keys; None = searched
    bucket_bytes: float | None = None  # fixed gradient bucket size; None = chosen (MG-WFBP)
    virtual: int = 1  # model chunks per pipeline rank (the interleaved schedule)
    pipeline_axis: int = 0  # the mesh axis the stages are carved from
    reshard: bool | None = None  # ZeRO-3 re-gathers in backward: None = per layer, chosen
    # ZeRO-3 under accumulation: gradients reduce-scattered once, after the last
    # micro-batch (whole until then), rather than in every micro-batch's backward
    reduce_once: bool = False
    # the gradient buckets' buffers kept between steps: None = where the memory fits
    keep_buffers: bool | None = None
    # data-parallel gradient buckets sent compressed (GradCompression) and PowerSGD's rank
    compression: str = "none"
    rank: int = 0
    offload: str = "none"  # what lives in host memory (Offload)
    copies: int = 1  # the two micro-batches run as interleaved copies (multi-copy overlap)
    # ZeRO-1/2's gathers after the step in chunks, forward order: None = where they win
    split_gathers: bool | None = None


@dataclass
class StagePrice:
    """One stage under a config: time per micro-batch, step extras, memory, recompute."""

    layers: list[str]
    seconds: float
    extra: float
    memory: dict[str, float]
    recompute: list[str] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)
    """``seconds`` and ``extra`` split for the plan summary: ``compute``, ``recompute``,
    ``accumulate`` (gradient accumulation) and ``comm`` (per micro-batch; they sum to
    ``seconds``), ``sync`` (all gradient
    reduction, mostly hidden under backward), ``sync_exposed`` and ``gather_step`` (the
    step's exposed tail; they sum to ``extra``)."""
    buckets: list[list[str]] = field(default_factory=list)
    """The data-parallel gradient buckets, parameter names in launch order."""
    kept: list[str] = field(default_factory=list)
    """ZeRO-3 layers kept gathered from forward to backward (``Decisions.zero_kept``)."""
    grad_buffers_kept: bool = False
    """The gradient buckets' buffers serve every step (``Decisions.grad_buffers_kept``)."""
    host_memory: float = 0.0
    """Host bytes per device of the offloaded state (``Decisions.host_memory``)."""
    gather_chunks: list[list[str]] = field(default_factory=list)
    """ZeRO-1/2's gathers after the step, parameter names per chunk in forward order
    (``Decisions.gather_chunks``; empty: one blocking gather)."""
    sliced_sends: bool = False
    """The stage sends its replicated boundary values as slices (``Decisions.sliced_sends``)."""

    @property
    def total_memory(self) -> float:
        """Bytes per device."""
        return sum(self.memory.values())


@dataclass
class Priced:
    """A config with its stages and step time (``inf`` when no split fits)."""

    config: Config
    stages: list[StagePrice]
    step_seconds: float
    min_memory: float
    bound: float | None = None
    """Set when the config was not priced because this lower bound on its step time
    (:func:`step_lower_bound`) already exceeded a plan found before it."""
    virtual: list[list[str]] = field(default_factory=list)
    """Under the interleaved schedule, the layer keys of each virtual stage in model
    order (``stages`` are then the ranks, each the sum of its chunks)."""

    @property
    def feasible(self) -> bool:
        """True when every stage fits the budget."""
        return math.isfinite(self.step_seconds)

    def breakdown(self) -> dict[str, float]:
        """``step_seconds`` split as :attr:`autopar.plans.Decisions.breakdown` says: the
        slowest stage's micro-batches (compute + exposed communication), the step's
        exposed tail (gradient sync after the last backward, ZeRO-1/2 gathers, the
        optimizer's update) and the pipeline bubble (the other stages' share of fill and
        drain)."""
        if not self.stages:
            return {}
        m = self.config.micro_batches
        slow = max(self.stages, key=lambda sp: sp.seconds)
        tail = max(self.stages, key=lambda sp: sp.extra)
        p = slow.parts
        copies = tail.parts.get("copy_step", 0.0)  # memory-bound work, not communication
        compute = m * (p.get("compute", 0.0) + p.get("recompute", 0.0) + p.get("accumulate", 0.0)) + copies
        optimizer = tail.parts.get("optimizer_step", 0.0)
        exposed = m * p.get("comm", 0.0) + tail.extra - optimizer - copies
        # one stage has no bubble (what the subtraction leaves then is rounding)
        bubble = max(0.0, self.step_seconds - m * slow.seconds - tail.extra) \
            if self.config.stages > 1 else 0.0
        hidden = max(0.0, tail.parts.get("sync", 0.0) - tail.parts.get("sync_exposed", 0.0))
        return {"compute_seconds": compute, "exposed_comm_seconds": exposed,
                "bubble_seconds": bubble, "optimizer_seconds": optimizer,
                "hidden_comm_seconds": hidden}


DECIDED_BY: dict[str, str] = {
    "pipeline_stages": "stages", "pipeline_axis": "pipeline_axis", "schedule": "schedule",
    "virtual_stages": "virtual", "micro_batches": "micro_batches",
    "zero_stage": "zero_stage", "zero_axis": "zero_axis",
    # forced by the option, else None and chosen while each stage is priced
    "recompute": "recompute", "zero_kept": "reshard", "grad_buckets": "bucket_bytes",
    "grad_buffers_kept": "keep_buffers", "gather_chunks": "split_gathers",
    "zero_reduce_once": "reduce_once", "grad_compression": "compression",
    "compression_rank": "rank", "offload": "offload", "copies": "copies",
}
"""Each :class:`~autopar.plans.decisions.Decisions` field a config decides (or forces,
for those its stages choose): the :class:`Config` field that does."""

AFTER_SEARCH: dict[str, str] = {
    "stages": "each stage's layers: the split search's answer for the config (Priced.stages)",
    "batch": "the caller's contract (whole batch or each rank's part), never searched: "
             "every config shares the options' value",
    "local_axes": "read off the chosen placement under batch='local'",
    "sliced_sends": "each stage's price takes the faster way to send its boundary "
                    "values, whole or as slices (StagePrice.sliced_sends)",
    **{d.fields[0]: f"forced only ({d.doc}): every config of a search shares the keyword's value"
       for d in DECISIONS if d.forced_only},
}
""":class:`~autopar.plans.decisions.Decisions` fields of the registry no :class:`Config`
holds, each with the reason."""

PASSED_THROUGH: tuple[str, ...] = (
    "recompute", "zero_kept", "grad_buckets", "grad_buffers", "gather_chunks")
"""Decisions (registry names) the joint search does not enumerate: the value their one
keyword forces goes into every config as given (``None``: chosen while each stage is
priced)."""


def forced_fields(opts: PlanOptions) -> dict[str, Any]:
    """The :class:`Config` fields of the :data:`PASSED_THROUGH` decisions, read from
    ``opts`` by each registry entry's keyword and recorded field."""
    out = {}
    for d in DECISIONS:
        if d.name in PASSED_THROUGH:
            (option,), (recorded,) = d.options, d.fields
            out[DECIDED_BY[recorded]] = getattr(opts, option.name)
    return out


def choice_fields(opts: PlanOptions) -> list[dict[str, Any]]:
    """The :class:`Config` fields of the decisions the registry lists choices for
    (:attr:`~autopar.plans.decisions.Decision.choices`), one dict per combination: the
    value the keyword forces, else each choice (``[{}]`` when no decision has choices)."""
    values = []
    for d in DECISIONS:
        if d.choices:
            forced = getattr(opts, d.options[0].name)
            values.append([(DECIDED_BY[d.fields[0]], v)
                           for v in ((forced,) if forced is not None else d.choices)])
    return [dict(c) for c in itertools.product(*values)]


def chosen_fields(cfg: Config) -> dict[str, Any]:
    """The :class:`~autopar.plans.decisions.Decisions` fields of the decisions with
    choices, as ``cfg`` took them."""
    return {f: getattr(cfg, DECIDED_BY[f]) for d in DECISIONS if d.choices for f in d.fields}


__all__ = ["AFTER_SEARCH", "DECIDED_BY", "PASSED_THROUGH", "Config", "Priced", "StagePrice",
           "choice_fields", "chosen_fields", "forced_fields"]
