"""What calibration's compute rates time, in the cost model's own terms (issue 12): the
matmul rate times matmuls only, and ``mem_bandwidth`` is what a training layer's
elementwise ops reach forward and backward, counted in the bytes the cost model prices
them by.  Timing is replaced by the work each measurement reports, so the tests check
what is measured and how it is counted, not this host's speed."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from autopar.cost_models import measure, measure_sync
from torch import nn

from autopar.capture.annotate import annotate
from autopar.capture.trace import capture

aten = torch.ops.aten


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    """A 1-rank gloo group: the measurements barrier and average over their group."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.fixture
def work_as_rate(monkeypatch):
    """Every ``_rate`` returns the work it was given (one second per run, nothing run)
    and records it."""
    seen: list[float] = []

    def fake(fn, work, min_seconds, sync):
        seen.append(work)
        return work
    monkeypatch.setattr(measure, "_rate", fake)
    return seen


def test_matmul_block_times_matmuls_only() -> None:
    # the cost model prices norms and activations as nodes of their own: timed as
    # matmul FLOPs they would be counted twice (the block had a LayerNorm and a GELU)
    blk = measure.matmul_block(8)
    assert [type(m) for m in blk] == [nn.Linear, nn.Linear]
    assert (blk[0].in_features, blk[0].out_features, blk[1].out_features) == (8, 32, 8)


class _NormAndActivation(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.norm(x).sum() + nn.functional.gelu(h).sum()


def test_elementwise_bandwidth_counts_the_cost_models_bytes(work_as_rate) -> None:
    d, tokens = 8, 4
    measure._activation_bandwidth(None, torch.device("cpu"), torch.float32, d, tokens, 0.0,
                                  lambda: None)
    (work,) = work_as_rate
    cap = capture(_NormAndActivation(d), (torch.randn(tokens, d), torch.randn(tokens, 4 * d)))
    annotate(cap.gm)
    nodes = [n for n in cap.gm.graph.nodes
             if n.op == "call_function" and n.target in (aten.layer_norm.default, aten.gelu.default)]
    assert len(nodes) == 2
    # forward + backward: the cost model's 1 + backward_factor (2) times the forward's bytes
    assert work == pytest.approx(3.0 * sum(n.meta["autopar"].bytes_moved for n in nodes))


def test_compute_rates_plan_elementwise_ops_at_the_measured_training_rate(work_as_rate) -> None:
    sizes, tokens = (8, 16, 32), 4
    rates = measure.compute_rates(None, torch.device("cpu"), torch.float32, sizes, 1024, 0.0,
                                  lambda: None, tokens=tokens)
    act = [3.0 * 4 * (2 * tokens * d + 2 * d + 8 * tokens * d) for d in sizes]
    assert rates["activation_bandwidth"] == {d: pytest.approx(a) for d, a in zip(sizes, act)}
    # not the copy's (read + write of 1024 bytes): a copy streams faster than a training
    # layer's norms and activations run, which priced every elementwise op 2.5x fast
    assert rates["copy_bandwidth"] == pytest.approx(2048.0)
    assert rates["mem_bandwidth"] == pytest.approx(act[1])
    # the block at a quarter and half the smallest width too: small Linear layers run slower
    widths = (2, 4, 8, 16, 32)
    assert rates["matmul_curve"] == [(pytest.approx(2.0 * tokens * d * 4 * d),
                                      pytest.approx(3 * 2 * 2 * tokens * d * 4 * d)) for d in widths]
    assert rates["peak_flops"] == pytest.approx(3 * 2 * 2 * tokens * 32 * 4 * 32)


def test_optimizer_rates_split_bytes_from_tensors(monkeypatch) -> None:
    # 8 large tensors give the bandwidth; many small ones what each tensor costs beyond
    # its bytes (a CPU's foreach kernels loop over the tensors, a dozen kernels each)
    bw, per_tensor, elements, small = 10e9, 20e-6, 2**16, 64
    times = iter([28.0 * elements / bw, small * per_tensor + 28.0 * small * 1024 / bw])
    monkeypatch.setattr(measure, "_step_seconds", lambda step, between, min_s, sync: next(times))
    r = measure.optimizer_rates(None, torch.device("cpu"), elements, 0.0, lambda: None,
                                width=8, tokens=4, small=small)
    assert r["bandwidth"] == pytest.approx(bw)
    assert r["tensor_seconds"] == pytest.approx(per_tensor)


def test_optimizer_rates_step_what_a_parallel_module_holds(monkeypatch) -> None:
    # a ParallelModule's optimizer steps DTensor parameters, whose dispatch costs each
    # tensor 50-75 us a step beyond a plain one's on 4 gloo ranks of 2 cores: timed over
    # plain tensors, the per-tensor cost (which ZeRO does not shrink) came out short
    from torch.distributed.tensor import DTensor

    stepped: list[list[bool]] = []

    class Recording(torch.optim.AdamW):
        def __init__(self, params, **kw):
            params = list(params)
            stepped.append([isinstance(q, DTensor) and isinstance(q.grad, DTensor) for q in params])
            super().__init__(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    r = measure.optimizer_rates(None, torch.device("cpu"), 2**12, 0.0, lambda: None,
                                width=8, tokens=4, small=4)
    assert len(stepped) == 2 and all(all(f) for f in stepped), stepped
    assert r["bandwidth"] > 0 and r["tensor_seconds"] >= 0


def test_optimizer_step_pays_per_tensor() -> None:
    from autopar.cost_models import MeshSpec, optimizer_step_time

    base = MeshSpec.preset("cpu-gloo", shape=(1,))
    assert base.optimizer_tensor_seconds == 0.0
    mesh = MeshSpec.from_dict({**base.to_dict(), "optimizer_tensor_seconds": 2e-5})
    assert mesh.optimizer_tensor_seconds == 2e-5
    stream = optimizer_step_time(base, 1e6, 2e6)
    assert optimizer_step_time(mesh, 1e6, 2e6) == pytest.approx(stream + 2e-5)
    assert optimizer_step_time(mesh, 1e6, 2e6, tensors=3) == pytest.approx(stream + 6e-5)
    with pytest.raises(ValueError, match="optimizer_tensor_seconds"):
        MeshSpec.from_dict({**base.to_dict(), "optimizer_tensor_seconds": -1.0})


def test_plan_prices_the_optimizer_per_parameter_tensor() -> None:
    import dataclasses

    from autopar.cost_models import MeshSpec

    import autopar

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                          nn.Linear(16, 4))  # 6 parameter tensors
    x = torch.randn(8, 16)
    base = MeshSpec.preset("cpu-gloo", shape=(1,))
    slow = dataclasses.replace(base, optimizer_tensor_seconds=1e-3)
    seconds = [autopar.plan(model, (x,), mesh=m).decisions.breakdown["optimizer_seconds"]
               for m in (base, slow)]
    assert seconds[1] - seconds[0] == pytest.approx(6e-3)


def _curved(curve):
    from autopar.cost_models import MeshSpec

    base = MeshSpec.preset("cpu-gloo", shape=(1,))
    return MeshSpec.from_dict({**base.to_dict(), "peak_flops": 100e9, "flops_efficiency": 1.0,
                               "matmul_curve": curve})


def test_kernel_rate_follows_the_measured_curve() -> None:
    from autopar.cost_models import MeshSpec, compute_time, kernel_rate

    mesh = _curved([[4e6, 60e9], [16e6, 80e9], [256e6, 100e9]])
    assert mesh.matmul_curve == ((4e6, 60e9), (16e6, 80e9), (256e6, 100e9))
    assert MeshSpec.from_json(mesh.to_json()) == mesh
    assert kernel_rate(mesh, 16e6) == pytest.approx(80e9)
    assert kernel_rate(mesh, 8e6) == pytest.approx(70e9)  # halfway in log(FLOPs)
    assert kernel_rate(mesh, 1e3) == pytest.approx(60e9)  # beyond the ends: their rates
    assert kernel_rate(mesh, 1e12) == pytest.approx(100e9)
    # a small matmul priced at its own size's rate, not the large ones'
    assert compute_time(mesh, 4e6, 1.0) == pytest.approx(4e6 / 60e9)
    # no curve (the presets): every kernel at peak x efficiency
    plain = MeshSpec.preset("cpu-gloo", shape=(1,))
    assert kernel_rate(plain, 4e6) == pytest.approx(plain.peak_flops * plain.flops_efficiency)


@pytest.mark.parametrize("curve", [[[4e6, 120e9]], [[16e6, 80e9], [4e6, 60e9]], [[0.0, 1e9]]])
def test_matmul_curve_is_validated(curve) -> None:
    # above peak_flops compute_floor would no longer be a lower bound
    with pytest.raises(ValueError, match="matmul_curve"):
        _curved(curve)


def test_timed_rounds_run_the_functions_side_by_side() -> None:
    calls: list[str] = []
    fns = [lambda k=k: calls.append(k) for k in "act"]
    times = measure.timed_rounds(fns, 3, lambda: None, barrier=lambda: calls.append("|"))
    # one warm-up of each, then rounds a c t, each run after a barrier
    assert "".join(calls) == "act" + "|a|c|t" * 3
    assert [len(t) for t in times] == [3, 3, 3] and all(x >= 0 for t in times for x in t)


# One calibration's overlap rounds on 4 gloo ranks of the 2-core host (2026-11-25, a
# 4 MiB all-reduce alone A, matmuls alone C, both T; ms, the slowest rank per round):
# the rounds' fractions scatter from -1.5 to +0.7 and their median is 0.47, while the
# nine other calibrations of that run gave medians of -0.28 to 0.24.
_HOST_A = [14.48, 15.07, 11.8, 12.73, 11.92, 12.91, 5.87, 9.3, 11.09, 8.03, 7.7, 10.4, 5.2, 12.07, 14.11]
_HOST_C = [7.85, 10.21, 10.2, 3.89, 8.0, 7.97, 9.55, 7.94, 3.9, 3.89, 7.98, 3.9, 4.01, 8.0, 12.18]
_HOST_T = [13.61, 18.1, 16.44, 13.99, 16.15, 17.11, 18.95, 12.4, 18.77, 17.86, 17.3, 12.53, 18.29,
           11.14, 22.04]


def test_overlap_is_not_claimed_from_noise() -> None:
    """The recorded rounds' median (0.47) lies about two standard errors from zero: the
    overlap planned with is near the floor, not 0.47 (the median alone priced a GPT's
    gradient reduction as hidden behind its backward, which this host never does).
    0.05: two standard errors leave 0.025 of this, the worst of the ten calibrations."""
    est = measure_sync.overlap_estimate(_HOST_A, _HOST_C, _HOST_T)
    assert est["median"] == pytest.approx(0.47, abs=0.005)
    assert est["stderr"] == pytest.approx(0.22, abs=0.01)
    assert 0.02 <= est["overlap"] < 0.05


def test_overlap_kept_where_the_rounds_agree() -> None:
    """On a device that overlaps (T ~ A, rounds within a few percent, as GPUs time them),
    the bound is the median to within its small error."""
    a = [10.0 + 0.1 * (i % 3) for i in range(15)]
    c = [5.0 + 0.05 * (i % 2) for i in range(15)]
    t = [x + 0.5 + 0.05 * (i % 4) for i, x in enumerate(a)]  # 0.5-0.65 ms of C not hidden
    est = measure_sync.overlap_estimate(a, c, t)
    assert 0.85 < est["median"] < 0.92
    assert est["stderr"] < 0.01
    assert est["overlap"] == pytest.approx(est["median"] - 2 * est["stderr"])
    # and a true overlap above 1 (noise) is capped at full speed
    assert measure_sync.overlap_estimate([10.0] * 5, [5.0] * 5, [9.0] * 5)["overlap"] == 1.0


def test_overlap_estimate_needs_matching_rounds() -> None:
    with pytest.raises(ValueError, match="as many"):
        measure_sync.overlap_estimate([1.0, 2.0], [1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        measure_sync.overlap_estimate([], [], [])


# A chain of 16 rounds on 4 gloo ranks sharing 2 cores (2026-11-25), per collective:
# matmul chunks of 20.9 ms alone, a 4 KiB all-reduce alone after a barrier 5.26 ms, the
# two chained 29.41 ms: each collective cost 3.26 ms beyond the two (the ranks' drift).
_CHAIN = 16


def test_sync_estimate_is_what_the_chain_adds() -> None:
    """The recorded chain: the penalty per collective is what chaining adds beyond the
    compute and the collective alone (3.26 ms), the median over rounds, so one
    descheduled round (the 60 ms one) does not move it."""
    alone = [5.26e-3, 5.1e-3, 5.4e-3, 5.26e-3, 5.3e-3]
    compute = [_CHAIN * 20.89e-3] * 5
    chained = [_CHAIN * x for x in (29.41e-3, 29.0e-3, 29.9e-3, 60.0e-3, 29.41e-3)]
    est = measure_sync.sync_estimate(alone, compute, chained, _CHAIN)
    assert est["sync_seconds"] == pytest.approx(3.26e-3, abs=1e-5)
    assert est["chunk"] == pytest.approx(20.89e-3)
    assert est["alone"] == pytest.approx(5.26e-3)


def test_sync_estimate_is_never_negative() -> None:
    """A chain faster than its parts (a GPU queues the collective behind the kernels)
    costs no drift, not a credit."""
    est = measure_sync.sync_estimate([1e-3] * 3, [4e-3] * 3, [4.5e-3] * 3, 4)
    assert est["sync_seconds"] == 0.0
    with pytest.raises(ValueError, match="as many"):
        measure_sync.sync_estimate([1e-3], [1e-3, 2e-3], [1e-3], 4)
    with pytest.raises(ValueError, match="chain"):
        measure_sync.sync_estimate([1e-3], [1e-3], [1e-3], 0)
    with pytest.raises(ValueError, match="alone"):
        measure_sync.sync_estimate([], [1e-3], [1e-3], 4)


def test_sync_estimate_pools_the_lone_collective() -> None:
    """The lone all-reduce is pooled over every round (several samples a round), not
    paired with its round's chain: it is uncorrelated with the chain, and its noise
    (a standard deviation of 3-8 ms on a busy 2-core host) came into each paired round.
    Here every chain adds 9 ms to its compute and the lone collective takes 5 ms in
    most of its 20 samples: the few that came out slow or fast (as preemption makes
    them) leave the penalty at 9 - 5 = 4 ms.  Paired with one lone sample per round,
    three rounds of a 12 ms sample would have given 0."""
    chain = 4
    compute = [chain * 20e-3] * 5
    chained = [chain * 29e-3] * 5
    alone = [5e-3] * 14 + [12e-3, 12e-3, 12e-3, 1e-3, 1e-3, 1e-3]  # 4 samples x 5 rounds
    est = measure_sync.sync_estimate(alone, compute, chained, chain)
    assert est["sync_seconds"] == pytest.approx(4e-3)
    assert est["rounds"] == 5 and est["alone_samples"] == 20


def _unpreempted(measure, plausible, tries: int = 3):
    """``measure()`` again (at most ``tries`` times) while its wall-clock result is not
    ``plausible``: the suite runs beside other tests (two pytest workers on 2 cores), and
    a measurement the scheduler preempted throughout says nothing about the code (its
    logic is what these tests check; the numbers' sizes only bound it).  The last
    measurement is returned either way, and the test's own asserts judge it."""
    for _ in range(tries):
        est = measure()
        if plausible(est):
            break
    return est


def test_sync_penalty_runs_on_a_group() -> None:
    """The measurement itself on a real (1-rank) gloo group: the chunk is about the
    2 ms asked for, and what a chained collective adds is a part of one chained round
    per collective (the arithmetic divided by the chain, not the chain's total).  Not
    bounded by the chunk: even with nobody to drift from, a blocking collective after
    compute waits for its worker thread's turn on a loaded host (8-43 ms beyond its
    price with three more busy processes on 2 cores, against a 2 ms chunk), which is
    what the penalty is for."""
    est = _unpreempted(lambda: measure_sync.sync_penalty(
        None, torch.device("cpu"), torch.float32, 64, 3, lambda: None, chunk_seconds=0.002, chain=4),
        lambda e: e["chunk"] < 0.05, tries=5)
    assert set(est) == {"sync_seconds", "alone", "chunk", "chained", "rounds", "alone_samples"}
    assert est["rounds"] == 3 and est["alone_samples"] == 12  # 4 lone collectives a round
    # about the 2 ms asked for; the upper bound is loose because CI's second pytest
    # worker on 2 cores stretched the chunk's median to 54 ms in three tries in a row
    # (2026-11-28); a unit slip in the sizing (a 1000x chunk) still fails it, and the
    # count itself is checked under preemption by the test below
    assert 0.0005 < est["chunk"] < 0.25
    assert 0.0 <= est["sync_seconds"] < est["chained"]


def test_sync_chunk_is_sized_from_unpreempted_samples(monkeypatch) -> None:
    """The chunk's matmul count comes from the fastest sizing sample: with three more
    busy processes on 2 cores the scheduler preempted most of them, and sized from their
    median the 2 ms chunk ran 10 us (a loop of one matmul), every time.  Every sizing
    sample but the fastest is made 100x slow here, as a preemption makes them."""
    real = measure_sync.timed_samples

    def preempted(fn, repeats, sync, barrier=None):
        ts = real(fn, repeats, sync, barrier)
        return [t if t == min(ts) else 100 * t for t in ts]
    monkeypatch.setattr(measure_sync, "timed_samples", preempted)
    est = _unpreempted(lambda: measure_sync.sync_penalty(
        None, torch.device("cpu"), torch.float32, 64, 3, lambda: None, chunk_seconds=0.002, chain=4),
        lambda e: e["chunk"] < 0.05)
    assert 0.0005 < est["chunk"] < 0.05, est  # about the 2 ms asked for


def test_straggler_of_one_rank_is_one() -> None:
    """Nobody to wait for: the slowest rank is the mean, whatever the host's noise."""
    est = _unpreempted(lambda: measure_sync.straggler(
        None, torch.device("cpu"), torch.float32, 32, 64, 3, lambda: None, window=0.002),
        lambda e: e["window"] < 0.05)
    assert est["straggler"] == 1.0
    assert 0 < est["window"] < 0.05


def test_optimizer_rates_leave_no_mesh_holding_a_group() -> None:
    # the DeviceMesh it steps DTensors on outlived the calibration in DTensor's caches,
    # holding the group; a script that destroyed the group and exited then aborted now
    # and then in gloo's worker threads (CI's docs/tutorial.md block, stop 34)
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, DeviceMesh)}
    measure.optimizer_rates(None, torch.device("cpu"), 2**10, 0.0, lambda: None,
                            width=8, tokens=4, small=2)
    gc.collect()
    held = [o for o in gc.get_objects()
            if isinstance(o, DeviceMesh) and id(o) not in before and o._pg_registry]
    assert held == []
