"""Gradient buckets chosen by the cost model (autopar/search/buckets.py, MG-WFBP)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from autopar.cost_models import MeshSpec
from autopar.cost_models.link import LinkSpec

import autopar
from autopar.search import buckets as bk


def _mesh(alpha: float, beta: float = 1e9, shape: tuple[int, ...] = (4,),
          overlap: float = 1.0) -> MeshSpec:
    return MeshSpec(shape=shape, links=tuple(LinkSpec(alpha=alpha, beta=beta) for _ in shape),
                    axis_names=tuple(f"a{i}" for i in range(len(shape))), peak_flops=1e11,
                    mem_bandwidth=2e10, mem_capacity=16e9, overlap=overlap)


def _items(rng: random.Random, n: int, axes=((0,),)) -> list[bk.GradItem]:
    t, out = 0.0, []
    for k in range(n):
        t += rng.uniform(0.0, 2e-3)
        out.append(bk.GradItem(f"p{k}", rng.choice([1e3, 1e5, 1e6, 4e6]), rng.choice(axes), t))
    return out


def _partitions(items: list[bk.GradItem]):
    """Every split of the items into consecutive buckets that keep one set of axes."""
    n = len(items)
    for mask in itertools.product([False, True], repeat=n - 1):
        cuts, start = [], 0
        for k, cut in enumerate(mask, start=1):
            if cut:
                cuts.append((start, k))
                start = k
        cuts.append((start, n))
        if all(len({x.axes for x in items[i:j]}) == 1 for i, j in cuts):
            yield cuts


@pytest.mark.parametrize("overlap", [1.0, 0.35])
@pytest.mark.parametrize("alpha", [1e-5, 5e-4, 3e-3])
@pytest.mark.parametrize("seed", range(4))
def test_optimal_matches_brute_force(alpha: float, seed: int, overlap: float) -> None:
    """The recurrence's end is the least end over every partition (it is exact, not a
    heuristic), from latency-bound to bandwidth-bound links, with mixed axes, with
    communication slowed beside the backward (overlap 0.35, as gloo on this host) or
    not."""
    rng = random.Random(seed)
    mesh = _mesh(alpha, shape=(2, 2), overlap=overlap)
    items = _items(rng, 9, axes=((0,), (0,), (0, 1)))
    backward = items[-1].ready + 1e-3
    best = min(bk.simulate(items, c, mesh, backward).end for c in _partitions(items))
    got = bk.optimal(items, mesh, backward)
    # the same floating-point sums in another order: relative 1e-12
    assert got.end == pytest.approx(best, rel=1e-12)
    assert bk.simulate(items, got.cuts, mesh, backward).end == pytest.approx(got.end, rel=1e-12)
    # buckets never mix axes
    assert all(len({x.axes for x in items[i:j]}) == 1 for i, j in got.cuts)


def test_optimal_beats_both_extremes_and_fixed_size() -> None:
    """On a latency-bound link one bucket per gradient pays the latency n times; one
    bucket for all waits for the last gradient; the chosen buckets beat both (and 4
    MiB buckets) in the model, and take fewer buckets than one per gradient."""
    rng = random.Random(7)
    mesh = _mesh(2e-3, beta=5e8)
    items = _items(rng, 60)
    backward = items[-1].ready
    got = bk.optimal(items, mesh, backward)
    for cuts in (bk.per_gradient(items), bk.one_bucket(items), bk.fixed_size(items, 4 << 20)):
        assert got.end < bk.simulate(items, cuts, mesh, backward).end
    assert 1 < len(got.cuts) < len(items)


def test_ties_prefer_fewer_buckets() -> None:
    """When the link keeps up with the backward every split ends alike; the chosen one
    merges buckets (fewer latencies) without ending later."""
    items = [bk.GradItem(f"p{k}", 1e3, (0,), 1e-2 * (k + 1)) for k in range(20)]
    mesh = _mesh(1e-5)
    got = bk.optimal(items, mesh, items[-1].ready)
    per = bk.simulate(items, bk.per_gradient(items), mesh, items[-1].ready)
    assert got.end == pytest.approx(per.end, rel=1e-12)
    assert len(got.cuts) < len(items) and got.busy < per.busy


def test_overlap_slows_reductions_under_the_backward_only() -> None:
    """With overlap 0.5 a reduction that starts while the backward computes runs at
    half speed until the backward ends, then at full speed."""
    mesh = _mesh(1e-3, beta=1e9, shape=(2,), overlap=0.5)
    lat = 2 * (2 - 1) * 1e-3  # the all-reduce's latency on 2 ranks
    work = lat + 2 * (2 - 1) / 2 * 1e6 / 1e9  # 1 MB: 2 ms latency + 1 ms bandwidth
    item = [bk.GradItem("a", 1e6, (0,), 0.0)]
    assert bk.simulate(item, [(0, 1)], mesh, 0.0).end == pytest.approx(work)
    # the backward runs 1 ms more: 0.5 ms of work done by then, the rest at full speed
    assert bk.simulate(item, [(0, 1)], mesh, 1e-3).end == pytest.approx(1e-3 + work - 0.5e-3)
    # a long backward: all of it at half speed
    assert bk.simulate(item, [(0, 1)], mesh, 1.0).end == pytest.approx(2 * work)


def test_fixed_items_are_never_merged() -> None:
    """A ZeRO layer's own reduction keeps its bucket; the data-parallel ones around it
    are chosen freely."""
    items = [bk.GradItem("a", 1e6, (0,), 1e-3), bk.GradItem("zero:l1", 0.0, (), 2e-3, fixed=5e-3),
             bk.GradItem("b", 1e6, (0,), 3e-3)]
    got = bk.optimal(items, _mesh(1e-3), 3e-3)
    assert (1, 2) in got.cuts
    assert got.names(items) == [["a"], ["b"]]
    assert bk.fixed_size(items, 1 << 30) == [(0, 1), (1, 2), (2, 3)]


def _gpt_plan(mesh: MeshSpec, **kw) -> autopar.Plan:
    from examples.gpt import GPT, GPTConfig
    m = GPT(GPTConfig(layers=2, dim=64, heads=2, vocab=128, seq=16))
    x = torch.randint(0, 128, (8, 16))
    return autopar.plan(m, (x, x), mesh, **kw)


def test_plan_records_buckets_and_bucket_bytes_override() -> None:
    """The plan lists its buckets (every replicated parameter exactly once), prices
    their exposed tail into the step, and ``bucket_bytes=`` makes fixed-size ones;
    the choice survives plan.json."""
    slow = _mesh(2e-3, beta=5e8)
    chosen = _gpt_plan(slow, zero_stage=0)
    d = chosen.decisions
    names = [n for b in d.grad_buckets for n in b]
    reps = [n.param for n in chosen.nodes.values()
            if n.kind == "param" and "S" not in n.out_placements[0]]
    assert sorted(names) == sorted(reps) and len(set(names)) == len(names)
    assert 1 <= len(d.grad_buckets) < len(names)
    one = _gpt_plan(slow, zero_stage=0, bucket_bytes=1)  # every gradient alone
    assert len(one.decisions.grad_buckets) == len(names)
    # the chosen buckets end no later than one per gradient, in the model
    assert d.stage_parts[0]["sync_exposed"] <= one.decisions.stage_parts[0]["sync_exposed"]
    again = autopar.Plan.from_json(chosen.to_json())
    assert again.decisions.grad_buckets == d.grad_buckets


def test_bucket_bytes_is_validated() -> None:
    """A bucket size that is not a positive integer is refused before any work."""
    with pytest.raises(autopar.errors.ConfigError, match="bucket_bytes"):
        _gpt_plan(_mesh(1e-3), bucket_bytes=0)


def test_runtime_takes_the_planned_buckets_or_falls_back() -> None:
    """GradSync reduces the plan's buckets as listed (a bucket mixing axes is split by
    axes, names not on this rank are skipped); parameters in no planned bucket, or a
    plan made before buckets were planned, get 4 MiB buckets, last parameter first."""
    from torch import nn

    from autopar.runtime.grad_sync import GradSync

    ps = {n: nn.Parameter(torch.zeros(4)) for n in "abcd"}
    axes = {"a": (0,), "b": (0,), "c": (0, 1), "d": (0,)}
    params = [(n, ps[n], axes[n]) for n in "abcd"]
    planned = GradSync(params, [["d", "c", "b"], ["a", "elsewhere"]])
    got = [([n for p in b.params for n, q in ps.items() if q is p], b.axes) for b in planned.buckets]
    assert got == [(["d", "b"], (0,)), (["c"], (0, 1)), (["a"], (0,))]
    old = GradSync(params, None)
    got = [([n for p in b.params for n, q in ps.items() if q is p], b.axes) for b in old.buckets]
    assert got == [(["d", "b", "a"], (0,)), (["c"], (0, 1))]
    partial = GradSync(params, [["d"]])
    got = [[n for p in b.params for n, q in ps.items() if q is p] for b in partial.buckets]
    assert got == [["d"], ["c"], ["b", "a"]]  # the rest grouped by axes, first seen first


def test_zero_bubble_reduces_every_gradient_after_the_backward() -> None:
    """Under zero-bubble ``W`` bypasses the hooks that launch buckets and the runtime
    reduces every bucket after the last ``W`` (runtime/pipeline.py): priced so, no
    reduction hides under the backward, where one launched as its gradients were ready
    does on a link that runs beside compute."""
    from autopar.search.stages.layer_stats import LayerStat, ParamStat
    from autopar.search.stages.zero_price import ZeroPrice

    layers = [LayerStat(key=f"l{k}", seconds=0.01, forward=0.003, compute=0.01, activations=1.0,
                        out_bytes=1.0, params=[ParamStat(2.0**20, (0,), f"w{k}")]) for k in range(4)]
    zp = [ZeroPrice(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0) for _ in layers]
    mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
    now, end = bk.stage_items(layers, zp, set(), 0, None)
    late, end2 = bk.stage_items(layers, zp, set(), 0, None, deferred=True)
    assert end == end2 and {it.ready for it in late} == {end}
    assert min(it.ready for it in now) < end
    cuts = [(i, i + 1) for i in range(len(now))]
    hidden = bk.simulate(now, cuts, mesh, end)
    after = bk.simulate(late, cuts, mesh, end)
    assert hidden.exposed < after.exposed
    assert after.exposed == pytest.approx(after.busy)
