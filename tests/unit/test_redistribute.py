"""Brute force for :func:`autopar.sharding.redistribute.plan_redistribution`: for every pair of
placements on small meshes, the planned steps, executed on simulated ranks, turn the
source layout of a tensor into the destination layout.

The steps are executed here by their definitions (sum, concatenate, chunk and
exchange over the ranks of one mesh axis), independently of the runtime, so this
checks the plan (which steps, in which order), not the collectives' code.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from rule_sim import Coord, assemble, scatter
from torch.distributed.tensor import Shard

from autopar.plans.placement import P, Placements, R, valid_for_shape
from autopar.sharding.redistribute import RedistributionError, Step, StepKind, plan_redistribution

F64 = torch.float64


def _groups(coords: list[Coord], axis: int) -> list[list[Coord]]:
    """The coordinates that differ only on ``axis``, each list ordered along it."""
    out: dict[Coord, list[Coord]] = {}
    for c in coords:
        out.setdefault(c[:axis] + c[axis + 1:], []).append(c)
    return [sorted(g, key=lambda c: c[axis]) for g in out.values()]


def run_step(local: dict[Coord, torch.Tensor], step: Step, mesh: Sequence[int]) -> dict:
    """Every rank's tensor after ``step`` (by the collective's definition)."""
    n, i = mesh[step.axis], step.axis
    out: dict[Coord, torch.Tensor] = {}
    for g in _groups(list(local), i):
        xs = [local[c] for c in g]
        for r, c in enumerate(g):
            if step.kind is StepKind.ALL_REDUCE:
                out[c] = sum(xs[1:], xs[0])
            elif step.kind is StepKind.REDUCE_SCATTER:
                out[c] = sum(xs[1:], xs[0]).chunk(n, step.dim)[r]
            elif step.kind is StepKind.ALL_GATHER:
                out[c] = torch.cat(xs, step.dim)
            elif step.kind is StepKind.ALL_TO_ALL:  # rank r gets chunk r of every peer
                out[c] = torch.cat([x.chunk(n, step.dim2)[r] for x in xs], step.dim)
            elif step.kind is StepKind.SLICE:
                out[c] = xs[r].chunk(n, step.dim)[r]
            else:
                assert step.kind is StepKind.TO_PARTIAL
                out[c] = xs[r] if r == 0 else torch.zeros_like(xs[r])
    return out


def check_pair(src: Placements, dst: Placements, mesh: tuple[int, ...], seed: int = 0) -> list[Step]:
    """Run the planned steps from ``src`` to ``dst`` and compare with the global tensor."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, 8, dtype=F64, generator=gen)
    if not (valid_for_shape(src, x.shape, mesh) and valid_for_shape(dst, x.shape, mesh)):
        return []  # the planner never makes uneven shards
    try:
        steps = plan_redistribution(src, dst)
    except RedistributionError:
        assert any(isinstance(s, Shard) and d == P for s, d in zip(src, dst)), (src, dst)
        return []
    local = scatter(x, src, mesh, gen)
    for s in steps:
        local = run_step(local, s, mesh)
    got = assemble(local, dst, mesh, f"{src} -> {dst} by {[str(s) for s in steps]}")
    torch.testing.assert_close(got, x, rtol=1e-12, atol=1e-12)
    return steps


_ONE = (R, P, Shard(0), Shard(1), Shard(2))


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
def test_every_pair(mesh: tuple[int, ...]) -> None:
    """All placement pairs on 1-D and 2-D meshes (a 3-D tensor, Partial included)."""
    layouts = list(itertools.product(_ONE, repeat=len(mesh)))
    for k, (src, dst) in enumerate(itertools.product(layouts, repeat=2)):
        check_pair(src, dst, mesh, seed=k)


def test_three_axes() -> None:
    """Shard/Replicate pairs on a (2, 2, 2) mesh, where nesting orders matter most."""
    layouts = list(itertools.product((R, Shard(0), Shard(1)), repeat=3))
    for k, (src, dst) in enumerate(itertools.product(layouts, repeat=2)):
        check_pair(src, dst, (2, 2, 2), seed=k)


def test_expert_parallel_swap_is_one_all_to_all() -> None:
    """Groups sharded on both axes, experts on the inner one: the dispatch
    ``[E, G, C, M]`` goes S(1)S(1) -> S(1)S(0) and back with one all-to-all each,
    inside the outer axis's group chunk."""
    there = check_pair((Shard(1), Shard(1)), (Shard(1), Shard(0)), (2, 2))
    back = check_pair((Shard(1), Shard(0)), (Shard(1), Shard(1)), (2, 2))
    assert [str(s) for s in there] == ["all_to_all(axis=1, dim=1->0)"]
    assert [str(s) for s in back] == ["all_to_all(axis=1, dim=0->1)"]
    # an outer axis that changes its shard of either dim forbids the shortcut
    assert all(s.kind is not StepKind.ALL_TO_ALL
               for s in plan_redistribution((Shard(1), Shard(1)), (Shard(0), Shard(1))))


def test_placements_the_planner_does_not_know_are_refused_clearly() -> None:
    """Placements are planned as small integer codes (Shard, Replicate, Partial by its
    reduce op); a placement of another kind (DTensor's strided shard) is refused by
    name instead of being taken for a plain shard."""
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(RedistributionError, match="unsupported placement"):
        plan_redistribution((_StridedShard(0, split_factor=2),), (R,))
    # two kinds of pending reduction are not the same layout: no step turns one into the other
    from torch.distributed.tensor import Partial

    with pytest.raises(RedistributionError):
        plan_redistribution((Partial("avg"),), (Partial("sum"),))


@pytest.mark.parametrize("mesh", [(3,), (4, 2), (2, 3, 4)])
def test_edge_matrices_price_every_pair_exactly_like_one_at_a_time(mesh) -> None:
    # the vectorized pricer (CostModel.redistribution_matrix) prices each step of every
    # pair with numpy in the scalar arithmetic's order: bit-identical, not approximately;
    # shapes even on every axis, uneven on some (step by step), and impossible pairs (inf)
    import numpy as np
    from autopar.cost_models import MeshSpec

    from autopar.capture.ir import TensorInfo
    from autopar.search.node_prices import CostModel

    spec = MeshSpec.preset("multinode-h100-ib", shape=mesh)
    per_axis = [Shard(0), Shard(1), Shard(2), R, P]
    layouts = list(itertools.product(per_axis, repeat=len(mesh)))
    for shape, dtype in [((48, 24, 96), torch.bfloat16), ((6, 5, 7), torch.float32),
                         ((96, 12, 8), torch.float32)]:
        t = TensorInfo(shape, dtype)
        ok = [p for p in layouts if valid_for_shape(p, shape, mesh)]
        # both cost models share the mesh's tables: the matrix path's (ids, rows) and the
        # scalar path's (prices, programs) are separate caches within them
        got = CostModel(spec).redistribution_matrix(tuple(ok), tuple(layouts), t)
        scalar = CostModel(spec)
        want = np.array([[scalar._redistribution_once(a, b, t) * 2.0 for b in layouts] for a in ok])
        assert np.array_equal(got, want)
        assert np.isinf(got).any() and (got == 0).any() and np.isfinite(got).sum() > got.size // 2
