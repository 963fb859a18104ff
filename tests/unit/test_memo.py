"""The pricing memos (autopar/cost_models/memo.py) answer exactly what the prices do."""

import dataclasses
import math

import pytest
from autopar.cost_models import MeshSpec, collective_time
from autopar.cost_models import collective_costs as C
from autopar.cost_models.memo import IdentityMemo

from autopar.search.stages import split_search
from autopar.search.stages.layer_stats import LayerStat, ParamStat
from autopar.search.stages.priced import Config
from autopar.search.stages.zero_price import zero_price


def test_a_hit_is_the_same_object_and_the_rest_of_the_key_by_value():
    memo, calls = IdentityMemo(size=2), []

    def make(v):
        calls.append(v)
        return v

    a, b = [1], [1]  # equal lists, different objects: different entries
    assert memo.get((a,), "k", lambda: make("a")) == "a"
    assert memo.get((a,), "k", lambda: make("x")) == "a"
    assert memo.get((b,), "k", lambda: make("b")) == "b"
    assert memo.get((a,), "other", lambda: make("c")) == "c"  # over size: started empty
    assert calls == ["a", "b", "c"]


def test_an_error_is_not_remembered():
    memo = IdentityMemo()
    with pytest.raises(ZeroDivisionError):
        memo.get((), 1, lambda: 1 / 0)
    assert memo.get((), 1, lambda: 2) == 2


def test_collective_prices_are_the_same_remembered_or_not():
    mesh = MeshSpec.preset("multinode-h100-ib", shape=(4, 8))
    for kind in C.CollectiveKind:
        for axes in (0, 1, (0, 1), [1, 0], "a0"):
            for nbytes in (0, 1, 3.5e6, 2 ** 30):
                want = C._collective_time(kind, mesh, axes, nbytes)
                assert collective_time(kind, mesh, axes, nbytes) == want
                assert collective_time(kind.value, mesh, axes, nbytes) == want  # remembered


def test_bad_sizes_still_raise_after_a_good_one_was_remembered():
    mesh = MeshSpec.preset("multinode-h100-ib", shape=(4, 8))
    assert collective_time("all_reduce", mesh, 0, 1) > 0
    # True == 1 and hashes alike: it must not find 1's entry
    for bad in (True, math.nan, math.inf, -1.0, "1"):
        with pytest.raises(ValueError):
            collective_time("all_reduce", mesh, 0, bad)


def test_a_new_mesh_with_other_links_is_priced_anew():
    mesh = MeshSpec.preset("multinode-h100-ib", shape=(4, 8))
    before = collective_time("all_gather", mesh, 1, 1e8)
    link = dataclasses.replace(mesh.links[1], beta=mesh.links[1].beta / 2)
    slower = dataclasses.replace(mesh, links=(mesh.links[0], link))
    assert collective_time("all_gather", slower, 1, 1e8) > before


def test_zero_prices_follow_the_config_and_the_statistics():
    mesh = MeshSpec.preset("multinode-h100-ib", shape=(8, 8))
    stats = [LayerStat(f"l{i}", seconds=1.0, params=[ParamStat(4e8, (0,))]) for i in range(4)]
    cls = split_search.layer_classes(stats)
    assert split_search.layer_classes(stats) is cls and cls == [0, 0, 0, 0]
    for stage, micro in ((1, 1), (3, 4), (3, 1)):
        cfg = Config(zero_stage=stage, zero_axis=0, micro_batches=micro)
        got = split_search.zero_prices(stats, cls, cfg, mesh, "adamw")
        assert got == [zero_price(st, mesh, stage, 0, "adamw", micro) for st in stats]
    # other statistics (equal by value, built anew) are other entries, priced by their own numbers
    more = [LayerStat(f"l{i}", seconds=1.0, params=[ParamStat(8e8, (0,))]) for i in range(4)]
    cfg = Config(zero_stage=3, zero_axis=0)
    assert split_search.zero_prices(more, split_search.layer_classes(more), cfg, mesh, "adamw")[0] \
        == zero_price(more[0], mesh, 3, 0, "adamw")
