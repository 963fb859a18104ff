"""Plan-level decisions forced by the user (:class:`~autopar.plans.decisions.PlanOptions`)
that cannot mean anything are errors before any search, never ignored."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from autopar.cost_models import MeshSpec
from autopar.errors import PlanError
from autopar.plans.decisions import PlanOptions
from autopar.plans.kinds import Schedule
from autopar.plans.schedules import conflict
from autopar.plans.splits import pipeline_splits


def check_forced(opts: PlanOptions, mesh: MeshSpec) -> None:
    """Raise :class:`PlanError` naming the first forced decision ``opts`` cannot run on
    ``mesh`` (a schedule without stages, stages that do not divide the mesh, ...)."""
    o = opts
    if o.zero_stage is not None and o.zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"zero_stage must be 0, 1, 2 or 3, got {o.zero_stage!r}")
    for name in ("pipeline_stages", "micro_batches", "blocks"):
        v = getattr(o, name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise PlanError(f"{name} must be an int >= 1, got {v!r}")
    if o.copies == 2 and (o.micro_batches not in (None, 2) or o.pipeline_stages not in (None, 1)):
        raise PlanError(f"copies=2 runs the step as two interleaved halves of the batch, with no "
                        f"pipeline: micro_batches={o.micro_batches!r} and "
                        f"pipeline_stages={o.pipeline_stages!r} cannot go with it")
    if o.split_gathers and ((o.pipeline_stages or 1) > 1 or o.zero_stage in (0, 3)):
        raise PlanError(f"split_gathers=True sends ZeRO-1/2's gathers after the step in chunks, "
                        f"on one pipeline stage: zero_stage={o.zero_stage!r} and "
                        f"pipeline_stages={o.pipeline_stages!r} cannot go with it")
    piped = (Schedule.GPIPE.value, Schedule.ONE_F_ONE_B.value, Schedule.INTERLEAVED.value,
             Schedule.ZERO_BUBBLE.value)
    if o.schedule is not None:
        if o.schedule not in piped:
            raise PlanError(f"schedule must be one of {list(piped)}, got {o.schedule!r}")
        if o.pipeline_stages == 1:
            raise PlanError(f"schedule={o.schedule!r} needs pipeline_stages > 1")
        why = conflict(o.schedule, bool(o.recompute), o.zero_stage)
        if why:
            raise PlanError(f"schedule={o.schedule!r} with {why}; use another schedule, or "
                            "drop that decision")
    if o.virtual_stages is not None:
        if not isinstance(o.virtual_stages, int) or o.virtual_stages < 1:
            raise PlanError(f"virtual_stages must be an int >= 1, got {o.virtual_stages!r}")
        if o.virtual_stages > 1 and o.schedule not in (None, Schedule.INTERLEAVED.value):
            raise PlanError(f"virtual_stages={o.virtual_stages} needs schedule="
                            f"{Schedule.INTERLEAVED.value!r}, not {o.schedule!r}")
    if o.schedule == Schedule.INTERLEAVED.value and o.pipeline_stages and o.micro_batches \
            and o.micro_batches % o.pipeline_stages:
        raise PlanError(f"the interleaved schedule runs micro-batches in groups of the "
                        f"pipeline stages: micro_batches={o.micro_batches} is not a multiple "
                        f"of pipeline_stages={o.pipeline_stages}")
    if o.pipeline_axis is not None:
        if not isinstance(o.pipeline_axis, int) or not 0 <= o.pipeline_axis < mesh.ndim:
            raise PlanError(f"pipeline_axis must be an axis of the mesh {tuple(mesh.shape)} "
                            f"(0 to {mesh.ndim - 1}), got {o.pipeline_axis!r}")
        if o.pipeline_stages == 1:
            raise PlanError(f"pipeline_axis={o.pipeline_axis} names the axis pipeline stages are "
                            "carved from, but pipeline_stages=1 asks for none")
    if o.pipeline_stages is not None and o.pipeline_stages > 1 and not any(
            p == o.pipeline_stages and o.pipeline_axis in (None, a)
            for p, a in pipeline_splits(tuple(mesh.shape))):
        where = f"mesh axis {o.pipeline_axis} of size {mesh.shape[o.pipeline_axis]}" \
            if o.pipeline_axis is not None else f"any axis of the mesh {tuple(mesh.shape)}"
        raise PlanError(f"{o.pipeline_stages} pipeline stages do not divide {where} (stages are "
                        "carved out of one mesh axis)")
    if o.zero_axes is not None and o.zero_stage == 0:
        raise PlanError(f"zero_axes={list(o.zero_axes)} names the axes ZeRO shards over, but "
                        "zero_stage=0 turns ZeRO off: give zero_stage=1, 2 or 3, or leave it out")
    stage_size = mesh.size // (o.pipeline_stages or 1)
    if o.zero_stage and (mesh.size == 1 or stage_size == 1):
        where = f"the mesh {mesh.shape}" if mesh.size == 1 else \
            f"each of the {o.pipeline_stages} pipeline stages (one device each)"
        raise PlanError(f"zero_stage={o.zero_stage} shards over the data-parallel devices, but "
                        f"{where} has a single device: use zero_stage=0, or more devices")



def zero_groups(shape: tuple[int, ...], forced: tuple[int, ...] | None,
                params: Iterable[tuple[tuple[int, ...], float]] | None = None,
                ) -> list[int | tuple[int, ...]]:
    """The axis sets ZeRO may shard over on a (stage) sub-mesh of ``shape``: each axis
    of more than one device alone, then every set of two or more of them (one group
    spanning them: ZeRO over a whole 2-D data-parallel mesh; HSDP is one axis, the
    others replicated); only ``forced`` when the caller named the axes.

    ``params`` ((axes a parameter is replicated on, its bytes) for the plan's
    parameters) keeps a set of two or more axes only where the parameters replicated on
    every one of them hold at least half the bytes: ZeRO shards a parameter only over
    axes that replicate it, so where tensor parallelism splits the block weights on one
    of the axes, the set would shard little more than the norms, as one of its axes
    alone does, and each set is a full pricing of every pipeline split (pricing every
    set made planning 2-4x slower on the published suites)."""
    axes = [a for a, n in enumerate(shape) if n > 1]
    if forced is not None:
        bad = [a for a in forced if a >= len(shape) or shape[a] == 1]
        if bad:
            raise PlanError(f"zero_axes={list(forced)} names axis {bad[0]}, which has a single "
                            f"device (or none) in the mesh {tuple(shape)} ZeRO shards over (a "
                            "pipeline stage's, under a pipeline): name axes of more than one device")
        return [forced[0] if len(forced) == 1 else tuple(sorted(forced))]
    sets = [c for k in range(2, len(axes) + 1) for c in itertools.combinations(axes, k)]
    if params is not None:
        params = list(params)
        total = sum(b for _, b in params)
        sets = [c for c in sets
                if 2 * sum(b for rep, b in params if set(c) <= set(rep)) >= total > 0]
    return [*axes, *sets]


__all__ = ["check_forced", "zero_groups"]
