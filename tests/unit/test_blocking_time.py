"""``MeshSpec.sync_seconds`` and ``straggler`` (issue 12): a collective a rank waits on
where it issues it pays the ranks' drift once (``blocking_time``), collectives launched
asynchronously do not, and the plans price exactly that: a tensor-parallel layout's
redistributions pay it, data parallelism's gradient buckets do not.  ``straggler``
scales every compute price and nothing else."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from autopar.cost_models import MeshSpec, blocking_time, blocking_times, collective_time

from autopar import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

SYNC = 2e-3


@pytest.fixture(scope="module")
def mesh() -> MeshSpec:
    return MeshSpec.preset("cpu-gloo").with_shape((4,))


def test_blocking_time_adds_the_drift_once(mesh: MeshSpec) -> None:
    synced = dataclasses.replace(mesh, sync_seconds=SYNC)
    for kind, nbytes in (("all_reduce", 4096), ("all_gather", 2**20), ("send_recv", 2**16)):
        plain = collective_time(kind, mesh, 0, nbytes)
        assert collective_time(kind, synced, 0, nbytes) == plain  # async: no drift
        assert blocking_time(kind, synced, 0, nbytes) == pytest.approx(plain + SYNC)
        assert blocking_time(kind, mesh, 0, nbytes) == plain  # the presets: none
    # nothing issued, nothing paid
    assert blocking_time("all_reduce", synced, 0, 0) == 0.0
    one = synced.with_shape((1, 4))
    assert blocking_time("all_reduce", one, 0, 4096) == 0.0


def test_the_vectorized_price_is_the_scalar_one(mesh: MeshSpec) -> None:
    """The edge prices' numpy path pays the drift exactly where the scalar one does:
    every element issued, none for an empty message."""
    import numpy as np

    synced = dataclasses.replace(mesh, sync_seconds=SYNC)
    sizes = np.array([0.0, 4096.0, 2.0**20])
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        got = blocking_times(kind, synced, 0, sizes)
        assert list(got) == [blocking_time(kind, synced, 0, float(b)) for b in sizes]
        assert got[0] == 0.0


def test_sync_seconds_is_kept_and_checked(mesh: MeshSpec) -> None:
    synced = dataclasses.replace(mesh, sync_seconds=SYNC)
    assert MeshSpec.from_json(synced.to_json()).sync_seconds == SYNC
    with pytest.raises(ValueError, match="sync_seconds"):
        dataclasses.replace(mesh, sync_seconds=-1e-3)
    # the compute it was measured after: kept, checked, 0 in JSON written before it
    windowed = dataclasses.replace(synced, sync_window=0.02)
    assert MeshSpec.from_json(windowed.to_json()).sync_window == 0.02
    older = {k: v for k, v in synced.to_dict().items() if k != "sync_window"}
    assert MeshSpec.from_dict(older).sync_window == 0.0
    with pytest.raises(ValueError, match="sync_window"):
        dataclasses.replace(mesh, sync_window=-1.0)


def _gpt() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=32, dim=64, heads=4, layers=2))
    idx = torch.randint(0, 256, (8, 32))
    return model, (idx, idx)


MEGATRON = {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
            "*out_proj.weight": "S(1)", "*fc1.weight": "S(0)", "*fc2.weight": "S(1)"}
DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


def test_tensor_parallel_pays_the_drift_data_parallel_once(mesh: MeshSpec) -> None:
    """The Megatron layout waits on an all-reduce after every row-parallel layer, forward
    and backward (2 layers x 2 x 2 = 8 at least): its step grows by at least 8 drifts.
    Pinned data parallelism reduces its gradients in asynchronous buckets and waits on
    nothing in its forward and backward, only for the last bucket at the step's end: its
    step grows by one drift (tests/solver/test_step_pricing.py has the ZeRO waits)."""
    model, inputs = _gpt()
    synced = dataclasses.replace(mesh, sync_seconds=SYNC)
    tp = [plan(model, inputs, mesh=m, pins=MEGATRON, pipeline_stages=1).decisions
          for m in (mesh, synced)]
    assert tp[1].step_seconds - tp[0].step_seconds >= 8 * SYNC * 0.999
    dp = [plan(model, inputs, mesh=m, pins=DP, pipeline_stages=1).decisions for m in (mesh, synced)]
    assert dp[1].step_seconds == pytest.approx(dp[0].step_seconds + SYNC)


def test_the_slowest_rank_paces_every_compute_price(mesh: MeshSpec) -> None:
    """``straggler`` multiplies kernels, the optimizer step and gradient accumulation
    alike, and nothing else: collectives keep their price."""
    from autopar.cost_models import compute_time, optimizer_step_time

    from autopar.search.stages.step_terms import accumulation_seconds

    slow = dataclasses.replace(mesh, straggler=1.25)
    assert compute_time(slow, 1e9, 1e6) == pytest.approx(1.25 * compute_time(mesh, 1e9, 1e6))
    assert compute_time(slow, 0, 64) == pytest.approx(1.25 * compute_time(mesh, 0, 64))  # the floor
    assert optimizer_step_time(slow, 1e6, 2e6, 7) == pytest.approx(1.25 * optimizer_step_time(mesh, 1e6, 2e6, 7))
    assert accumulation_seconds([1e6, 2e6], 4, slow) == pytest.approx(
        1.25 * accumulation_seconds([1e6, 2e6], 4, mesh))
    assert collective_time("all_reduce", slow, 0, 2**20) == collective_time("all_reduce", mesh, 0, 2**20)
    assert MeshSpec.from_json(slow.to_json()).straggler == 1.25
    with pytest.raises(ValueError, match="straggler"):
        dataclasses.replace(mesh, straggler=0.9)
