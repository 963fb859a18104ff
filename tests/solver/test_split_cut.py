"""The pipeline split search given the step of a plan in hand (``price(..., cut=)``,
:mod:`autopar.search.stages.split_search`), and the per-class parameter views the stage prices
read (:func:`autopar.search.stages.memory.param_views`).

The cut must never change a config that can beat it: priced with ``cut`` set to its own
step, every config comes back exactly as priced without a cut (a bound that were too
tight, over some split's true step, would report it bounded instead).  Under a lower cut
a config is either priced as without it or bounded by no more than its step.  Random
layers with ZeRO-able parameters, budgets that bind, every schedule."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from autopar import MeshSpec
from autopar.plans.decisions import zero_axes
from autopar.plans.kinds import Schedule
from autopar.runtime.grad_sync import fill_buckets
from autopar.search.stages import split_search
from autopar.search.stages.layer_stats import LayerStat, ParamStat
from autopar.search.stages.memory import gradient_arrivals, param_views
from autopar.search.stages.pipeline_step import price
from autopar.search.stages.priced import Config
from autopar.search.stages.zero_price import grad_bytes, on_zero, zero_price

MESH = MeshSpec.preset("multinode-a100-ib", shape=(2, 8))
GIB = 2.0**30


def _stats(rng: random.Random, n: int, alike: bool = False) -> list[LayerStat]:
    """``n`` layers (``alike``: a stack of identical ones between a first and a last),
    each with a weight replicated on axis 1 (ZeRO-able there) and one on both axes."""
    out = []
    base = rng.getstate()
    for k in range(n):
        if alike and 0 < k < n - 1:
            rng.setstate(base)
        act = rng.uniform(0.5, 4.0) * GIB
        out.append(LayerStat(
            key=f"layers.{k}", seconds=rng.uniform(0.01, 0.05), forward=rng.uniform(0.003, 0.015),
            compute=rng.uniform(0.005, 0.04), activations=act, out_bytes=act * rng.uniform(0.05, 0.3),
            params=[ParamStat(rng.uniform(0.2, 2.0) * GIB, (1,), f"w{k}"),
                    ParamStat(rng.uniform(0.01, 0.2) * GIB, (0, 1), f"b{k}")]))
    return out


def _configs():
    for stages in (2, 3, 4):
        for micro in (3, 8):
            for sched in (Schedule.ONE_F_ONE_B.value, Schedule.GPIPE.value,
                          Schedule.ZERO_BUBBLE.value, Schedule.INTERLEAVED.value):
                if sched == Schedule.INTERLEAVED.value and micro % stages:
                    continue
                virtual = 2 if sched == Schedule.INTERLEAVED.value else 1
                for zero in (0, 1, 3):
                    yield Config(stages=stages, micro_batches=micro, schedule=sched, zero_stage=zero, zero_axis=1 if zero else None, virtual=virtual)


LINK = lambda b: 1e-5 + b / 25e9  # noqa: E731 - a point-to-point message


@pytest.mark.parametrize(("seed", "n", "alike"), [(0, 8, False), (1, 12, True)])
def test_a_cut_at_the_step_changes_nothing_and_a_lower_one_only_bounds(seed: int, n: int,
                                                                      alike: bool) -> None:
    rng = random.Random(seed)
    stats = _stats(rng, n, alike)
    fits = bounded = 0
    for cfg in _configs():
        for budget in (16 * GIB, 40 * GIB):
            full = price(stats, cfg, MESH, LINK, budget, "adamw")
            if not full.feasible:
                for cut in (1.0, 1e3):
                    assert not price(stats, cfg, MESH, LINK, budget, "adamw", cut).feasible
                continue
            fits += 1
            step = full.step_seconds
            # a bound over the step itself would report this config bounded: fails
            assert price(stats, cfg, MESH, LINK, budget, "adamw", step) == full
            assert price(stats, cfg, MESH, LINK, budget, "adamw", 2.0 * step) == full
            for cut in (0.999 * step, 0.8 * step, 0.3 * step):
                got = price(stats, cfg, MESH, LINK, budget, "adamw", cut)
                if got.bound is None:
                    assert got == full
                else:
                    bounded += 1
                    assert not got.stages and not got.feasible
                    assert cut < got.bound <= step * (1 + 1e-12)
    # configs fit, and lower cuts bound some (could be false: a bound that never cuts)
    assert fits > 20 and bounded > 20


def test_a_low_cut_prices_fewer_stages(monkeypatch) -> None:
    stats = _stats(random.Random(7), 16, alike=True)
    cfg = Config(stages=4, micro_batches=8, schedule=Schedule.ONE_F_ONE_B.value)
    calls: list[int] = []
    real = split_search.price_stage

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(split_search, "price_stage", counting)
    full = price(stats, cfg, MESH, LINK, 40 * GIB, "adamw")
    n_full = len(calls)
    calls.clear()
    cut = price(stats, cfg, MESH, LINK, 40 * GIB, "adamw", 0.7 * full.step_seconds)
    assert cut.bound is not None and len(calls) < n_full / 2


def test_a_split_over_the_cut_plans_no_buckets(monkeypatch) -> None:
    """Just under a config's step, the chosen split's step without its buckets is
    already over the cut: the config comes back bounded and no stage is priced with
    its buckets (before, every such split had its buckets planned, then lost).  No
    parameter is replicated, so the buckets expose nothing and that step is the step."""
    stats = [dataclasses.replace(st, params=[dataclasses.replace(q, replicated=()) for q in st.params])
             for st in _stats(random.Random(0), 8)]
    synced: list[bool] = []
    real = split_search.price_stage

    def counting(*a, **k):
        synced.append(k.get("sync", True))
        return real(*a, **k)

    monkeypatch.setattr(split_search, "price_stage", counting)
    checked = 0
    for cfg in _configs():
        full = price(stats, cfg, MESH, LINK, 40 * GIB, "adamw")
        if not full.feasible:
            continue
        synced.clear()
        got = price(stats, cfg, MESH, LINK, 40 * GIB, "adamw", (1 - 1e-6) * full.step_seconds)
        assert got.bound is not None and got.bound <= full.step_seconds * (1 + 1e-12)
        assert not any(synced)
        checked += 1
    assert checked > 20


def _arrivals_per_parameter(layers, zp, cfg, mesh, buckets=None, kept=False):
    """gradient_arrivals as it was written before the views: every parameter's ZeRO
    membership and gradient bytes asked for at each call."""
    out = [z.grads for z in zp]
    zax = zero_axes(cfg.zero_axis)

    def nbytes(q) -> float:
        return grad_bytes(q, mesh, cfg.zero_stage, zax, cfg.micro_batches, cfg.reduce_once)

    params = [(i, q) for i in reversed(range(len(layers))) for q in reversed(layers[i].params)]
    plain = [(i, q) for i, q in params if q.replicated and not on_zero(q.replicated, cfg.zero_stage, zax)]
    shards = [(i, q) for i, q in params if cfg.zero_stage == 3 and on_zero(q.replicated, 3, zax)
              and set(q.replicated) - set(zax)]
    synced = plain + shards
    spike = max((nbytes(q) for _, q in synced), default=0.0)
    if kept:
        for i, q in synced:
            out[i] -= nbytes(q)
        return out, spike, sum(nbytes(q) for _, q in synced)
    groups = fill_buckets(shards, lambda iq: nbytes(iq[1]))
    if buckets:
        where = {q.name: (i, q) for i, q in plain if q.name}
        groups += [[where[n] for n in names if n in where] for names in buckets]
    for g in groups:
        if not g:
            continue
        for i, q in g:
            out[i] -= nbytes(q)
        out[max(i for i, _ in g)] += sum(nbytes(q) for _, q in g)
    return out, spike, 0.0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_views_give_the_per_parameter_arrivals_bit_for_bit(zero: int) -> None:
    mesh = MeshSpec.preset("multinode-a100-ib", shape=(2, 2, 4))
    rng = random.Random(zero)
    layers = _stats(rng, 9, alike=True)
    for st in layers:  # replicated on two axes, one of them the ZeRO axis: ZeRO-3 shards
        st.params.append(ParamStat(0.05 * GIB, (1, 2), f"{st.key}.c"))
    buckets = [[f"b{k}" for k in range(4)], [f"b{k}" for k in range(4, 9)]]
    for micro, once in ((1, False), (4, False), (4, True)):
        cfg = Config(stages=2, micro_batches=micro, schedule=Schedule.ONE_F_ONE_B.value, zero_stage=zero, zero_axis=(1,) if zero else None,
                     reduce_once=once)
        zp = [zero_price(st, mesh, zero, cfg.zero_axis, "adamw", micro, once) for st in layers]
        classes = split_search.layer_classes(layers)
        views = param_views(layers, cfg, mesh, classes)
        assert len(set(map(id, views))) == len(set(classes)) < len(layers)  # one per class
        for kw in ({}, {"kept": True}, {"buckets": buckets}):
            want = _arrivals_per_parameter(layers, zp, cfg, mesh, **kw)
            assert gradient_arrivals(layers, zp, cfg, mesh, views=views, **kw) == want
            assert gradient_arrivals(layers, zp, cfg, mesh, **kw) == want
    assert math.isfinite(sum(v.param_bytes for v in views))


def test_a_config_that_cannot_fit_is_found_out_before_the_search() -> None:
    """``_may_fit`` (a bound on every split's memory) says False only for configs the
    full search finds no split for, and says it for some of them."""
    from autopar.search.stages.split_search import _may_fit, zero_prices
    from autopar.search.stages.step_terms import in_flight

    rng = random.Random(11)
    caught = none = 0
    for n, alike in ((8, False), (12, True)):
        stats = _stats(rng, n, alike)
        for cfg in _configs():
            for budget in (8 * GIB, 16 * GIB, 40 * GIB):
                full = price(stats, cfg, MESH, LINK, budget, "adamw")
                virt = Config(stages=cfg.stages * cfg.virtual, micro_batches=cfg.micro_batches, schedule=cfg.schedule,
                              zero_stage=cfg.zero_stage, zero_axis=cfg.zero_axis, virtual=cfg.virtual)
                zps = zero_prices(stats, split_search.layer_classes(stats), virt, MESH, "adamw")
                ok = _may_fit(stats, zps, [in_flight(virt, s) for s in range(virt.stages)],
                              budget / cfg.virtual)
                assert ok or not full.feasible, cfg
                none += not full.feasible
                caught += not ok
    assert 0 < caught <= none


def test_zero_bubble_stages_with_equal_in_flight_counts_are_priced_apart() -> None:
    """Under zero-bubble two stages may hold as many micro-batches at once and still
    differ in the gradients they keep from B to W (schedules.waiting_w): the split
    search prices each range at each stage as pricing every range by position does
    (the same slowest stage and stage boundaries, budgets that bind)."""
    from autopar.search.stages.price import price_stage
    from autopar.search.stages.step_terms import in_flight, waiting_w

    stats = _stats(random.Random(5), 10, alike=True)
    for st in stats:
        st.weight_grad_inputs = 2.0 * GIB
    shared = fits = 0
    for stages, micro in ((3, 4), (4, 5), (4, 6), (5, 6)):
        cfg = Config(stages=stages, micro_batches=micro, schedule=Schedule.ZERO_BUBBLE.value)
        pairs = {(in_flight(cfg, s), s == 0, s == stages - 1) for s in range(stages)}
        keys = {(*k, waiting_w(cfg, s)) for s, k in enumerate(
            (in_flight(cfg, s), s == 0, s == stages - 1) for s in range(stages))}
        shared += len(keys) > len(pairs)
        for budget in (64 * GIB, 72 * GIB, 80 * GIB):
            got = price(stats, cfg, MESH, LINK, budget, "adamw")
            n, inf = len(stats), (math.inf, math.inf, [])
            best = [[inf] * (n + 1) for _ in range(stages)]
            for s in range(stages):
                for j in range(s + 1, n + 1):
                    for i in range(s, j) if s else (0,):
                        prev = best[s - 1][i] if s else (0.0, 0.0, [])
                        if not math.isfinite(prev[0]):
                            continue
                        sp = price_stage(stats[i:j], s, cfg, MESH, LINK, budget, "adamw", sync=False)
                        if sp.total_memory > budget:
                            continue
                        cand = (max(prev[0], sp.seconds), prev[1] + sp.seconds, prev[2] + [(i, j)])
                        if cand[:2] < best[s][j][:2]:
                            best[s][j] = cand
            slow, _, ranges = best[-1][n]
            assert got.feasible == math.isfinite(slow), (stages, micro, budget)
            if got.feasible:
                fits += 1
                assert [len(sp.layers) for sp in got.stages] == [j - i for i, j in ranges]
    assert shared and fits  # stages that share an in-flight count, not a waiting one
    # where nothing fits, the memory the message quotes is the balanced split's, each
    # stage priced at its own place (before, a stage with the same in-flight count
    # priced earlier stood in for it: 4 stages x 5 micro-batches quoted stage 1's)
    for stages, micro in ((4, 5), (5, 6)):
        cfg = Config(stages=stages, micro_batches=micro, schedule=Schedule.ZERO_BUBBLE.value)
        got = price(stats, cfg, MESH, LINK, 20 * GIB, "adamw")
        cuts = [round(k * len(stats) / stages) for k in range(stages + 1)]
        assert not got.feasible and got.min_memory == max(
            price_stage(stats[cuts[k]:cuts[k + 1]], k, cfg, MESH, LINK, 20 * GIB, "adamw",
                        sync=False).total_memory for k in range(stages))
