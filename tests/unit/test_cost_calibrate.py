"""``calibrate`` on a real 2-rank gloo process group: both ranks must return the identical
MeshSpec (deterministic planning) with positive, finite measured numbers, a fit per
collective kind, and a JSON record of what was measured that loads as a MeshSpec."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math

import pytest
import torch.distributed as dist
from autopar.cost_models import MeshSpec, calibrate, measure_cluster

WORLD = 2


def calibrations(_case: dict) -> list[dict[str, str]]:
    """On each rank of tests/dist/harness.py's 2-rank group: calibrate a 1-D mesh (the
    preset as base) and a 2x1 one; every rank's results, gathered."""
    base = MeshSpec.preset("cpu-gloo")
    based = calibrate(sizes=(2**10, 2**18), repeats=2, base=base)
    # a 2x1 mesh: axis 0 measured over its own groups, axis 1 (one rank) keeps base's
    # link; with a straggler estimate far too high (4), whose drift must still be
    # measured beyond the chain's own (mean) compute, never beyond more compute than
    # the chain ran (the module patched: the package's ``calibrate`` is the function)
    cal = importlib.import_module("autopar.cost_models.calibrate")
    measured = cal.straggler
    cal.straggler = lambda *a, **k: {"straggler": 4.0, "window": 0.05}
    try:
        record = measure_cluster(sizes=(2**10, 2**16), repeats=2, base=base, shape=(2, 1))
    finally:
        cal.straggler = measured
    mine = {"based": based.to_json(), "record": record.to_json(), "table": record.table()}
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


@pytest.mark.slow  # two calibrations on 2 ranks (the drift alone takes 24 rounds each)
def test_calibrate_two_ranks_agree() -> None:
    from tests.dist.harness import run_fn_cases

    ranks = run_fn_cases(WORLD, "tests.unit.test_cost_calibrate:calibrations", [{"id": "c"}])["c"]
    assert not (isinstance(ranks, dict) and "error" in ranks), ranks
    based = [MeshSpec.from_json(r["based"]) for r in ranks]
    assert based[0] == based[1]
    m = based[0]
    assert m.name == "calibrated" and m.shape == (WORLD,) and m.ndim == 1
    (link,) = m.links
    for v in (link.alpha, link.beta, m.peak_flops, m.mem_bandwidth, m.mem_capacity):
        assert 0 < v < math.inf
    # communication beside compute keeps a measured fraction of its speed (2 ranks
    # computing on 2 cores: gloo's threads share them, measured 0.3-0.4 here)
    assert 0 < m.overlap <= 1
    # base supplies what calibrate does not measure; the kernel floor and the optimizer's
    # bytes/s are measured
    assert m.mem_capacity == MeshSpec.preset("cpu-gloo").mem_capacity
    assert 0 < m.kernel_floor < 1e-2 and 0 < m.optimizer_bandwidth < math.inf
    # every measured kind but the all-reduce (the link's own numbers) has its own fit
    assert [k for k, _, _ in link.kinds] == ["all_gather", "all_to_all", "reduce_scatter", "send_recv"]
    assert all(0 < a < math.inf and 0 < b < math.inf for _, a, b in link.kinds)

    records = [r["record"] for r in ranks]
    assert records[0].count('"axis0/') == 5 and '"axis1/' not in records[0]
    spec = MeshSpec.from_json(records[0])  # the record is a MeshSpec JSON
    assert spec == MeshSpec.from_json(records[1]) and spec.shape == (2, 1)
    assert spec.links[1] == MeshSpec.preset("cpu-gloo").links[0]
    cal = json.loads(records[0])["calibration"]
    assert cal["world"] == WORLD and cal["repeats"] == 2 and cal["when"]
    for samples in cal["curves"].values():
        assert [s["nbytes"] for s in samples] == [2**10, 2**16]
        assert all(s["seconds"] > 0 and s["spread"] >= 0 and s["fitted"] > 0 for s in samples)
    assert "axis0/reduce_scatter" in ranks[0]["table"]
    # idle reuse is 2 (1 - (mean rate, every rank busy) / (mean rate, half of them busy)),
    # clamped to [0, 0.95], from the rates the record keeps
    r = cal["compute"]["idle_reuse"]
    assert r["all"] > 0 and r["half"] > 0
    assert r["idle_reuse"] == pytest.approx(min(0.95, max(0.0, 2 * (1 - r["all"] / r["half"]))))
    assert spec.idle_reuse == r["idle_reuse"]

    # the drift is what a chained round took beyond its compute (the ranks' mean) and the
    # lone all-reduce: with the straggler's share subtracted instead, a straggler of 4
    # took away four times the chain's compute (chunk > chained) and the drift came out 0
    lagged = json.loads(records[0])
    assert lagged["straggler"] == 4.0
    drift = lagged["calibration"]["compute"]["sync"]
    assert 0 < drift["chunk"] <= drift["chained"], drift
    # the compute each drift was measured after, which a longer wait is scaled from
    assert lagged["sync_window"] == drift["chunk"]


def test_calibrate_needs_process_group() -> None:
    if dist.is_initialized():  # pragma: no cover - another test leaked a group
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="process group"):
        calibrate()


def test_calibration_keeps_what_it_does_not_measure() -> None:
    """A calibrated mesh measures links and rates per axis, not the reserve or how the
    backend runs a collective over several axes: those come from the base preset, else
    from the preset kind of the device (NCCL's flat-ring all-gather and reduce-scatter on
    GPUs; every kind on a gloo host).  Before, a calibrated GPU mesh lost the flat rings."""
    from autopar.cost_models.calibrate import _unmeasured

    gpu = MeshSpec.preset("multinode-a100-40gb")
    kept = _unmeasured(gpu, True, gpu.mem_capacity)
    assert kept["flat_ring"] == gpu.flat_ring == ("all_gather", "reduce_scatter")
    assert (kept["reserve_bytes"], kept["reserve_fraction"]) == (gpu.reserve_bytes, gpu.reserve_fraction)
    assert _unmeasured(None, True, 80 * 2**30)["flat_ring"] == ("all_gather", "reduce_scatter")
    # gloo runs every collective over a multi-axis group as one flat algorithm
    assert _unmeasured(None, False, 8 * 2**30)["flat_ring"] == ("all_reduce", "all_gather", "reduce_scatter")
    # a small host keeps at least half its memory for the plan
    assert _unmeasured(None, False, 0.6 * 2**30)["reserve_bytes"] == 0.3 * 2**30
    # the zero-bubble split's factor: the base's, else the device kind's preset
    assert _unmeasured(None, False, 8 * 2**30)["split_backward"] == MeshSpec.preset("cpu-gloo").split_backward > 1
    assert _unmeasured(None, True, 80 * 2**30)["split_backward"] == 1.0
    assert _unmeasured(dataclasses.replace(gpu, split_backward=1.4), True, gpu.mem_capacity)["split_backward"] == 1.4


@pytest.mark.parametrize("bad", [0.9, float("inf"), float("nan"), True])
def test_split_backward_is_validated_and_kept_in_json(bad) -> None:
    gloo = MeshSpec.preset("cpu-gloo")
    with pytest.raises(ValueError, match="split_backward"):
        dataclasses.replace(gloo, split_backward=bad)
    spec = dataclasses.replace(gloo, split_backward=1.37)
    assert MeshSpec.from_json(spec.to_json()).split_backward == 1.37
