"""Redistribution: the collectives that turn one placement tuple into another.

:func:`plan_redistribution` is the single source of truth used both by the search (to
price an edge) and by the lowering (to emit the nodes), so the plan's predicted
communication is exactly what the generated code issues.

Order matters when several mesh axes shard the same tensor dim (the earlier axis
shards first): pending sums are resolved first, then shards that must go are gathered
innermost-axis-first, then new shards are sliced outermost-axis-first (free), and
finally Replicate -> Partial keeps the value on coordinate 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.plans.placement import Placements


class StepKind(str, Enum):
    """One redistribution step."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    SLICE = "local_slice"
    TO_PARTIAL = "to_partial"


@dataclass(frozen=True)
class Step:
    """A collective (or local op) on one mesh axis.  ``dim`` is the tensor dim it
    gathers/scatters; ``dim2`` the scatter dim of an all-to-all."""

    kind: StepKind
    axis: int
    dim: int | None = None
    dim2: int | None = None

    def __str__(self) -> str:
        d = "" if self.dim is None else f", dim={self.dim}"
        d2 = "" if self.dim2 is None else f"->{self.dim2}"
        return f"{self.kind.value}(axis={self.axis}{d}{d2})"


class RedistributionError(ValueError):
    """The requested change of placement is not expressible (e.g. S -> P)."""


# Placements as small ints inside the planner: Shard(d) -> d, Replicate -> -1, a
# Partial -> -2 - k (k: its reduce op's index).  The search plans tens of thousands of
# pairs on a 3-axis mesh, and isinstance on DTensor's placement types is slow.
_REP = -1
_PARTIAL_OPS: dict[str, int] = {}


def _code(p) -> int:
    t = type(p)
    if t is Shard:
        return p.dim
    if t is Replicate:
        return _REP
    if t is Partial:
        return -2 - _PARTIAL_OPS.setdefault(p.reduce_op, len(_PARTIAL_OPS))
    raise RedistributionError(f"unsupported placement {p!r}: only Shard, Replicate and Partial")


def _shards_dim(ps: Sequence[int], d: int, axes: Sequence[int]) -> bool:
    return any(ps[j] == d for j in axes)


def placement_codes(placements: Placements) -> tuple[int, ...]:
    """``placements`` as the planner's small ints (see ``_code``)."""
    return tuple(_code(p) for p in placements)


def plan_redistribution(src: Placements, dst: Placements,
                        mesh_shape: Sequence[int] | None = None) -> list[Step]:
    """Steps turning ``src`` into ``dst`` (same number of mesh axes).  ``mesh_shape``:
    leave out the steps on axes of one rank, which change nothing (a shard of one piece
    is the whole, a sum over one rank its value) but would still issue a collective on a
    1-rank group (an input pinned ``S(0)S(0)`` on a 4x1 mesh was all-gathered over the
    second axis twice a step); the prices leave them out already (a 1-rank collective
    is priced 0).

    Raises :class:`RedistributionError` for Shard -> Partial, which no plan needs.
    """
    if src == dst:
        return []
    steps = plan_codes(placement_codes(src), placement_codes(dst), (src, dst))
    if mesh_shape is not None:
        steps = [s for s in steps if mesh_shape[s.axis] > 1]
    return steps


def plan_codes(s_: Sequence[int], d_: Sequence[int], names: tuple | None = None) -> list[Step]:
    """:func:`plan_redistribution` on placement codes (:func:`placement_codes`);
    ``names``: the (source, target) placements its errors name (default: the codes)."""
    src, dst = names or (tuple(s_), tuple(d_))
    s_, d_ = list(s_), list(d_)
    n = len(s_)
    cur = list(s_)
    steps: list[Step] = []
    for i in range(n):
        if d_[i] <= -2 and cur[i] >= 0:
            raise RedistributionError(f"cannot turn {src} into {dst}: Shard -> Partial")
    # 1. pending sums
    for i in range(n):
        if cur[i] <= -2 and not d_[i] <= -2:
            if d_[i] >= 0:
                d = d_[i]
                others = [j for j in range(n) if j != i]
                later = [j for j in range(i + 1, n)]
                if not _shards_dim(cur, d, others) and not _shards_dim(d_, d, later):
                    steps.append(Step(StepKind.REDUCE_SCATTER, i, d))
                    cur[i] = d_[i]
                    continue
            steps.append(Step(StepKind.ALL_REDUCE, i))
            cur[i] = _REP
    # 2. which shards must go: changed ones, plus every later axis sharding the same
    # dim (it must be gathered first), plus later axes that already shard a dim an
    # earlier axis is about to shard (slicing would nest in the wrong order).
    need = {i for i in range(n) if cur[i] >= 0 and cur[i] != d_[i]}
    changed = True
    while changed:
        changed = False
        for i in range(n):
            if i in need or cur[i] < 0:
                continue
            d = cur[i]
            outer_changing = any(j < i and j in need and cur[j] == d for j in range(n))
            outer_new = any(j < i and d_[j] == d and cur[j] != d_[j] for j in range(n))
            if outer_changing or outer_new:
                need.add(i)
                changed = True
    # all-to-all where the swap is local to one axis: every other axis that shards
    # either dim is an outer one that keeps its shard (the swap then happens inside
    # its chunk, which is where the inner axis's pieces live: expert parallelism on the
    # inner axis of a (dp, ep) mesh, groups sharded on both); an inner one would
    # interleave the pieces
    done: set[int] = set()
    for i in sorted(need):
        if d_[i] >= 0 and cur[i] >= 0 and not any(j > i and j in need for j in range(n)):
            a, b = cur[i], d_[i]
            touching = [j for j in range(n) if j != i and (cur[j] in (a, b) or d_[j] in (a, b))]
            if all(j < i and cur[j] == d_[j] for j in touching):
                steps.append(Step(StepKind.ALL_TO_ALL, i, a, b))
                cur[i] = d_[i]
                done.add(i)
    for i in sorted(need, reverse=True):
        if i in done:
            continue
        steps.append(Step(StepKind.ALL_GATHER, i, cur[i]))
        cur[i] = _REP
    # 3. new shards, outermost axis first: local slices
    for i in range(n):
        if d_[i] >= 0 and cur[i] == _REP:
            steps.append(Step(StepKind.SLICE, i, d_[i]))
            cur[i] = d_[i]
    # 4. Replicate -> Partial
    for i in range(n):
        if d_[i] <= -2 and cur[i] == _REP:
            steps.append(Step(StepKind.TO_PARTIAL, i))
            cur[i] = d_[i]
    if cur != d_:
        raise RedistributionError(f"internal: could not redistribute {src} -> {dst} (got {cur})")
    return steps


def step_shapes(steps: Sequence[Step], local: Sequence[int], mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Local shape before each step (and after the last), for pricing."""
    shapes = [tuple(local)]
    cur = list(local)
    for s in steps:
        n = mesh_shape[s.axis]
        if s.kind is StepKind.ALL_GATHER:
            cur[s.dim] *= n
        elif s.kind in (StepKind.REDUCE_SCATTER, StepKind.SLICE):
            cur[s.dim] //= n
        elif s.kind is StepKind.ALL_TO_ALL:
            cur[s.dim] *= n
            cur[s.dim2] //= n
        shapes.append(tuple(cur))
    return shapes


def sum_axes(src: Placements, dst: Placements,
             mesh_shape: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The axes ``src -> dst`` all-reduces over when that is all it does (``()`` when it
    does nothing), None when it takes any other step.  A scalar output reached this way
    is left in flight by the lowering (``passes/lower.py``, ``runtime/pending.py``) and
    priced off the step by the cost model: both ask here, so they agree.
    ``mesh_shape``: axes of one rank left out (:func:`plan_redistribution`)."""
    steps = plan_redistribution(src, dst, mesh_shape)
    if any(s.kind is not StepKind.ALL_REDUCE for s in steps):
        return None
    return tuple(s.axis for s in steps)


__all__ = ["RedistributionError", "Step", "StepKind", "placement_codes", "plan_codes",
           "plan_redistribution", "step_shapes", "sum_axes"]
