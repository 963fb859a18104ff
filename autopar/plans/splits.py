"""What a (pipeline stages, micro-batches) split means outside the search: the global
batch and its first micro-batch (positional and keyword inputs alike), the stage
sub-mesh carved out of a mesh axis and the ranks that run each stage, and the plan's :class:`~autopar.plans.Request`
read from the graph captured at the micro-batch size."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.utils import _pytree as pytree

from autopar.cost_models import MeshSpec
from autopar.errors import PlanError
from autopar.plans.data import Plan
from autopar.plans.decisions import Decisions


def batch_size(example_inputs) -> int:
    """The global batch: dim 0 of the first tensor in the inputs, a pytree (positional
    arguments, or ``(args, kwargs)`` for models called as ``model(**batch)``)."""
    for x in pytree.tree_leaves(example_inputs):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise PlanError("micro-batching needs a tensor input with a batch dim (dim 0); the "
                    "example inputs (positional and keyword) hold none")


def micro_inputs(example_inputs, micro_batches: int):
    """The first micro-batch of a pytree of inputs: every tensor whose dim 0 is the
    batch, cut to ``B / M``; the structure is kept."""
    b = batch_size(example_inputs)
    if b % micro_batches:
        raise PlanError(f"the batch of {b} does not split into {micro_batches} micro-batches")
    return batch_rows(example_inputs, b // micro_batches)


def batch_rows(example_inputs, rows: int):
    """A pytree of inputs with every tensor whose dim 0 is the batch given ``rows`` rows:
    its first ones (a view) when fewer, its rows repeated in turn when more (a scaling
    curve's larger counts, :mod:`autopar.scaling`); the structure is kept."""
    b = batch_size(example_inputs)

    def resize(x):
        if not (isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == b):
            return x
        return x[:rows] if rows <= b else x[torch.arange(rows, device=x.device) % b]
    return pytree.tree_map(resize, example_inputs)


def pipeline_splits(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(stages, axis)`` for every way to carve pipeline stages out of one mesh axis:
    each factor above one of each axis of more than one device, outermost axis first
    (across nodes, then inside a node).  The same stage count from two axes is two
    splits: their stage sub-meshes keep different links."""
    return [(p, a) for a, n in enumerate(shape) for p in range(2, n + 1) if n % p == 0]


def _carve(shape: tuple[int, ...], stages: int, axis: int) -> tuple[tuple[int, ...], list[int]]:
    """``shape`` with ``axis`` split into ``(stages, rest)`` (stage-major: each stage a
    contiguous block of the axis), and the order of its dims that puts the stages
    first and drops ``rest`` when it is 1."""
    if not 0 <= axis < len(shape):
        raise PlanError(f"pipeline axis {axis} is not an axis of the mesh {tuple(shape)}")
    n = shape[axis]
    if n % stages:
        raise PlanError(f"{stages} pipeline stages do not divide mesh axis {axis} of size {n}")
    split = (*shape[:axis], stages, n // stages, *shape[axis + 1:])
    keep = [d for d in range(len(split)) if d != axis and not (d == axis + 1 and n == stages)]
    return split, [axis, *keep]


def split_mesh(mesh: MeshSpec, stages: int, axis: int = 0) -> tuple[MeshSpec, MeshSpec]:
    """(full mesh with a leading pipeline axis, one stage's sub-mesh) for ``stages``
    pipeline stages carved out of mesh ``axis`` (0: the outermost, slowest one; a later
    axis puts the stages inside a node).  The stage's sub-mesh keeps the other axes,
    and what is left of ``axis`` where the stages do not take all of it; every axis
    keeps the link it has on the cluster (the pipeline axis: the link between stages)."""
    if stages == 1:
        return mesh, mesh
    split, order = _carve(tuple(mesh.shape), stages, axis)
    if mesh.intra is not None:  # links from the node layout of the split shape
        links = mesh.with_shape(split).links
    else:  # both parts of the split axis keep its link
        links = (*mesh.links[:axis + 1], *mesh.links[axis:])
    names = (*mesh.axis_names[:axis + 1], *mesh.axis_names[axis:])
    shape = tuple(split[d] for d in order)
    full = dataclasses.replace(
        mesh, shape=shape, links=tuple(links[d] for d in order),
        # the cluster's names where each axis keeps one (the stages took a whole axis)
        axis_names=tuple(names[d] for d in order) if len(shape) == mesh.ndim else ())
    if len(shape) > 1:
        sub = dataclasses.replace(full, shape=shape[1:], links=full.links[1:],
                                  axis_names=full.axis_names[1:])
    else:
        # one device per stage: a placeholder axis that never communicates, on a plain
        # link (the pipeline link may be a node-spanning one, invalid on one device)
        one = dataclasses.replace(full.links[0], inter=None, group=1)
        sub = dataclasses.replace(full, shape=(1,), links=(one,), axis_names=("a0",))
    return full, sub


def pipeline_mesh(plan: Plan) -> MeshSpec:
    """The whole mesh of a pipelined ``plan``, its pipeline axis first (as
    :func:`split_mesh` returns it): carved again from the requested mesh, so the
    pipeline axis has the link between stages wherever they were carved from."""
    d, mesh = plan.decisions, plan.mesh
    shape = tuple(plan.request.mesh_shape)
    if shape and math.prod(shape) == mesh.size * d.pipeline_stages:
        try:
            return split_mesh(mesh.with_shape(shape), d.pipeline_stages, d.pipeline_axis)[0]
        except (ValueError, PlanError):  # links that cannot be re-derived: as given
            pass
    return mesh.with_shape((d.pipeline_stages, *mesh.shape) if mesh.size > 1 else (d.pipeline_stages,))


def plan_ranks(plan: Plan) -> torch.Tensor:
    """The global rank of every (pipeline stage, sub-mesh coordinate) of ``plan``, shaped
    ``(stages, *plan.mesh.shape)`` (one stage without a pipeline)."""
    d = plan.decisions
    stages, shape = max(1, d.pipeline_stages), tuple(plan.mesh.shape)
    if stages > 1 and d.pipeline_axis:
        return stage_ranks(tuple(plan.request.mesh_shape), stages, d.pipeline_axis).view(stages, *shape)
    return torch.arange(stages * math.prod(shape)).view(stages, *shape)


def split_words(stages: int, axis: int, noun: str = "stage(s)") -> str:
    """``"2 stage(s)"``, or ``"2 stage(s) from mesh axis 1"`` for stages not carved
    from the outermost axis; ``noun="stages"``: ``"stages 2"`` (progress lines)."""
    head = f"stages {stages}" if noun == "stages" else f"{stages} {noun}"
    return head + (f" from mesh axis {axis}" if stages > 1 and axis else "")


def stage_ranks(mesh_shape: tuple[int, ...], stages: int, axis: int = 0) -> torch.Tensor:
    """Global ranks laid out as the runtime's device mesh, ``(stages, *stage sub-mesh)``,
    for stages carved out of ``axis`` of a row-major ``mesh_shape`` (ranks numbered as
    torchrun numbers them: the last axis fastest, so a node's ranks are consecutive).
    Axis 0 gives ``arange(world).view(stages, ...)``; a later axis puts each stage's
    ranks at a stride inside every node."""
    ranks = torch.arange(math.prod(mesh_shape))
    if stages == 1:
        return ranks.view(tuple(mesh_shape))
    split, order = _carve(tuple(mesh_shape), stages, axis)
    full = ranks.view(split).permute(axis, *(d for d in range(len(split)) if d != axis))
    return full.reshape(stages, *(tuple(split[d] for d in order[1:]) or (1,))).contiguous()


def micro_counts(batch: int, stages: int) -> list[int]:
    """The counts of micro-batches that divide ``batch``, ascending, those below
    ``stages`` left out (a pipeline needs a micro-batch per stage) unless none is left."""
    opts = [m for m in range(1, batch + 1) if batch % m == 0]
    return [m for m in opts if m >= stages] or opts[-1:]


def unsplit_axes(size: int, axes: list[int] | tuple[int, ...], mesh_shape) -> list[int]:
    """The mesh axes to take out of a split of a dim of ``size`` over ``axes`` so that it
    divides by the rest: as few as can be, one at a time, each the one that leaves the
    largest split (the smallest axis when none divides yet; ties: the outer axis).  A batch
    of 8 on 2 x 8 ranks: the first axis (rows 8 ways on the second); of 3 on 2: the axis.
    The runtime replicates a shape's activations over these axes
    (:mod:`autopar.module.shapes`) and :meth:`Plan.predict` prices it so."""
    left, out = list(axes), []
    while left and size % math.prod(mesh_shape[a] for a in left):
        def rest(a: int) -> int:
            return math.prod(mesh_shape[x] for x in left if x != a)
        drop = min(left, key=lambda a: (size % rest(a) != 0, -rest(a), a))
        left.remove(drop)
        out.append(drop)
    return out


def sends_sliced(d: Decisions, stage: int) -> bool:
    """Whether (virtual) stage ``stage`` of a plan with decisions ``d`` sends its
    replicated boundary values to the next as slices: its pipeline rank is in
    ``d.sliced_sends`` (the runner and ``plan.collectives()`` both read this)."""
    return stage % max(1, d.pipeline_stages) in d.sliced_sends


__all__ = ["batch_rows", "batch_size", "micro_counts", "micro_inputs", "pipeline_mesh", "pipeline_splits", "plan_ranks",
           "sends_sliced", "split_mesh", "split_words", "stage_ranks", "unsplit_axes"]
