"""The pipeline split search given the step of a plan in hand (``price(..., cut=)``,
:mod:`autopar.search.stages.split_search`), and the per-class parameter views the stage prices
read (:func:`autopar.search.stages.memory.param_views`).

The cut must never change a config that can beat it: priced with ``cut`` set to its own
step, every config comes back exactly as priced without a cut (a bound that were too
tight, over some split's true step, would report it bounded instead).  Under a lower cut
a config is either priced as without it or bounded by no more than its step.  Random
layers with ZeRO-able parameters, budgets that bind, every schedule."""

from __future__ import annotations

import math
import random

import pytest

from autopar import MeshSpec
from autopar.plan.decisions import Schedule, zero_axes
from autopar.runtime.grad_sync import fill_buckets
from autopar.search.stages import split_search
from autopar.search.stages.dp import Config, price
from autopar.search.stages.layer_stats import LayerStat, ParamStat, grad_bytes, on_zero, zero_price
from autopar.search.stages.memory import gradient_arrivals, param_views

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
                    yield Config(stages, micro, sched, zero, 1 if zero else None, virtual=virtual)


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
    cfg = Config(4, 8, Schedule.ONE_F_ONE_B.value)
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
        cfg = Config(2, micro, Schedule.ONE_F_ONE_B.value, zero, (1,) if zero else None,
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
