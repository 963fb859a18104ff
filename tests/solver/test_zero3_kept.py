"""ZeRO-3's per-layer choice to keep a layer's whole parameters gathered from its forward
to its backward (autopar.search.stages.memory.kept_layers, priced by
autopar.search.stages.price.price_stage): each kept layer saves its backward re-gather and
holds its bytes at the activation peak; the planner keeps the most that fit the
budget, from the last layer; ``reshard`` forces none or all."""

from __future__ import annotations

import pytest

from autopar import MeshSpec
from autopar.search.stages.layer_stats import LayerStat, ParamStat
from autopar.search.stages.memory import kept_layers
from autopar.search.stages.price import price_stage
from autopar.search.stages.priced import Config
from autopar.search.stages.zero_price import zero_price

MESH = MeshSpec.preset("cpu-gloo", shape=(4,))
MIB = 2.0**20


def _layers(n: int = 4) -> list[LayerStat]:
    # 8 MiB of replicated parameters and 20 MiB of activations per layer
    return [LayerStat(key=f"l{k}", seconds=0.01, forward=0.003, compute=0.01, activations=20 * MIB,
                      out_bytes=2 * MIB, params=[ParamStat(8 * MIB, (0,), f"w{k}")]) for k in range(n)]


def _price(budget: float = float("inf"), reshard: bool | None = None, stage: int = 3):
    cfg = Config(zero_stage=stage, zero_axis=0, reshard=reshard)
    return price_stage(_layers(), 0, cfg, MESH, lambda b: 0.0, budget, "adamw")


def test_each_kept_layer_saves_its_regather():
    none, every = _price(reshard=True), _price(reshard=False)
    assert none.kept == [] and every.kept == ["l0", "l1", "l2", "l3"]
    regather = zero_price(_layers()[0], MESH, 3, 0, "adamw").regather
    # the collective alone: 6 MiB gathered over the link, more than its latency
    assert regather > 0.0
    assert none.seconds - every.seconds == pytest.approx(4 * regather)
    # the whole parameters of every kept layer are alive at the end of the forward
    assert every.total_memory > none.total_memory


def test_unbounded_memory_keeps_every_layer():
    assert _price().kept == ["l0", "l1", "l2", "l3"]


@pytest.mark.parametrize("fit", [0, 1, 2, 3, 4])
def test_the_most_layers_that_fit_from_the_last(fit):
    keys, saves = [f"l{k}" for k in range(4)], [1e-3] * 4
    asked = []

    def fits(ks: frozenset[str]) -> bool:
        asked.append(ks)
        return len(ks) <= fit

    kept = kept_layers(keys, saves, set(), None, fits)
    assert kept == {f"l{k}" for k in range(4 - fit, 4)}
    # bisected: every set asked about is a run of last layers, and few are asked
    assert all(ks == {f"l{k}" for k in range(4 - len(ks), 4)} for ks in asked)
    assert len(asked) <= 3


def test_recomputed_layers_and_those_that_save_nothing_are_not_kept():
    keys = [f"l{k}" for k in range(4)]
    # l0 re-gathers nothing in backward (its weights only cast: their copies are saved)
    assert kept_layers(keys, [0.0, 1e-3, 1e-3, 1e-3], {"l3"}, False, lambda ks: True) == {"l1", "l2"}
    assert kept_layers(keys, [0.0, 1e-3, 1e-3, 1e-3], {"l3"}, None, lambda ks: True) == {"l1", "l2"}


def test_a_budget_between_keeps_some_and_fits():
    lo, hi = _price(reshard=True).total_memory, _price(reshard=False).total_memory
    assert hi > lo
    for budget in (lo + 0.25 * (hi - lo), lo + 0.6 * (hi - lo)):
        sp = _price(budget=budget)
        assert sp.total_memory <= budget
        assert 0 < len(sp.kept) < 4 and sp.kept[-1] == "l3", sp.kept
    # under what re-gathering everything needs: recomputation makes it fit first, and
    # no recomputed layer is kept (its recomputation gathers again)
    sp = _price(budget=lo - 1.0)
    assert sp.recompute and sp.total_memory <= lo - 1.0
    assert not set(sp.recompute) & set(sp.kept)


def test_no_layer_is_kept_outside_zero3():
    assert _price(stage=2).kept == [] and _price(stage=2, reshard=False).kept == []


def test_reducing_once_under_accumulation_drops_the_earlier_reduce_scatters():
    """ZeRO-3 over 4 micro-batches reducing once a step: no reduce-scatter in the first
    three backwards (their share of ``gather_mb``), whole gradients until the last."""
    st = _layers()[0]
    every = zero_price(st, MESH, 3, 0, "adamw", micro_batches=4)
    once = zero_price(st, MESH, 3, 0, "adamw", micro_batches=4, reduce_once=True)
    assert every.gather_mb - once.gather_mb == pytest.approx(every.zero_sync * 3 / 4)
    assert once.grads == pytest.approx(4 * every.grads)  # whole, not a quarter
    assert once.sync == every.sync  # the last reduce-scatter, as before
    # one micro-batch: the same either way
    assert zero_price(st, MESH, 3, 0, "adamw", 1, True) == zero_price(st, MESH, 3, 0, "adamw", 1)
