"""What :func:`~autopar.cost_models.calibrate.calibrate` times on the running group: collectives,
compute rates and the optimizer step (what ranks do to one another in a step, overlap,
idle reuse, the straggler and the drift, is in :mod:`.measure_sync`).

Every function here is collective over its group (every rank calls it with the same
arguments, in the same order) and returns numbers that are identical on every rank, as
every rank must derive the same MeshSpec to plan the same: collective timings are
all-reduced with MAX (the slowest rank paces a collective), compute rates averaged.

Everything is timed while every rank does the same thing at once, as training does:
on a host whose ranks share cores (gloo on a CPU) a matmul timed on one idle rank runs
twice as fast as it does in training, which is what the first calibration got wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["Sample", "collective_samples", "compute_rates", "iqr", "max_over_ranks",
           "matmul_block", "mean_over_ranks", "median", "optimizer_rates", "timed_rounds",
           "timed_samples"]

Sync = Callable[[], None]


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def iqr(xs: Sequence[float]) -> float:
    """Interquartile range (75th - 25th percentile, linear interpolation) of ``xs``."""
    s = sorted(xs)

    def q(f: float) -> float:
        pos = f * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return q(0.75) - q(0.25)


@dataclass(frozen=True)
class Sample:
    """One measured point: ``seconds`` is the median over repetitions on the slowest rank,
    ``spread`` the interquartile range / median of those repetitions (the largest on any
    rank; not max - min, which one descheduled repetition on a shared host dominates)."""

    nbytes: int
    seconds: float
    spread: float


def max_over_ranks(values: Sequence[float], group: Any, device: Any) -> list[float]:
    """Element-wise MAX of ``values`` over the ranks of ``group`` (identical on every rank)."""

    if not values:
        return []
    vec = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    return [float(x) for x in vec.cpu().tolist()]


def timed_samples(fn: Callable[[], Any], repeats: int, sync: Sync,
                  barrier: Callable[[], None] | None = None) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn`` after one warm-up run; ``barrier`` before
    each run so no rank's timer includes waiting for a late peer."""
    return timed_rounds([fn], repeats, sync, barrier)[0]


def timed_rounds(fns: Sequence[Callable[[], Any]], repeats: int, sync: Sync,
                 barrier: Callable[[], None] | None = None) -> list[list[float]]:
    """:func:`timed_samples` of several functions side by side: ``repeats`` rounds, each
    running every one of ``fns`` once in turn (one warm-up run of each first), so load
    that comes and goes touches them alike; one list of times per function."""
    for fn in fns:
        fn()
    sync()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for times, fn in zip(out, fns):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
    return out


def _collective(kind: str, group: Any, nbytes: int, device: Any) -> tuple[Callable[[], None], int]:
    """A closure issuing one ``kind`` collective of about ``nbytes`` (the module table's
    meaning: full bytes for all-gather / reduce-scatter, per-rank bytes for all-to-all, the
    message for send/recv, which is a ring: each rank sends to the next and receives from
    the last), and the bytes it really moves (fp32 elements, divisible by the ranks)."""
    group = group if group is not None else dist.group.WORLD
    p = dist.get_world_size(group)
    n = max(p, nbytes // 4 // p * p)  # fp32 elements, divisible by the ranks
    return _issue(kind, group, p, n, device), 4 * n


def _issue(kind: str, group: Any, p: int, n: int, device: Any) -> Callable[[], None]:
    """The closure of :func:`_collective` on ``n`` fp32 elements."""

    f32 = torch.float32
    if kind == "all_reduce":
        buf = torch.ones(n, dtype=f32, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        full, part = torch.empty(n, dtype=f32, device=device), torch.ones(n // p, dtype=f32, device=device)
        # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: ag(full, part, group=group)
    if kind == "reduce_scatter":
        full, part = torch.ones(n, dtype=f32, device=device), torch.empty(n // p, dtype=f32, device=device)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: rs(part, full, group=group)
    if kind == "all_to_all":
        src, dst = torch.ones(n, dtype=f32, device=device), torch.empty(n, dtype=f32, device=device)
        return lambda: dist.all_to_all_single(dst, src, group=group)
    if kind == "send_recv":
        me = dist.get_group_rank(group, dist.get_rank())
        nxt = dist.get_global_rank(group, (me + 1) % p)
        prv = dist.get_global_rank(group, (me - 1) % p)
        src, dst = torch.ones(n, dtype=f32, device=device), torch.empty(n, dtype=f32, device=device)

        def ring() -> None:
            # batched: NCCL would block a plain isend before the irecv to the same peer
            ops = [dist.P2POp(dist.isend, src, nxt, group), dist.P2POp(dist.irecv, dst, prv, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return ring
    raise ValueError(f"cannot measure collective kind {kind!r}")


def collective_samples(kind: str, group: Any, sizes: Sequence[int], repeats: int,
                       device: Any, sync: Sync, job: Any = None) -> list[Sample]:
    """``kind`` over ``group`` timed at each of ``sizes`` bytes: median and spread over
    ``repeats``, the MAX taken over ``job`` (default: the world), which holds every group
    of a mesh axis: each rank times its own axis group, and every rank must still derive
    the same numbers."""
    meds, spreads, moved = [], [], []
    for nb in sizes:
        fn, real = _collective(kind, group, nb, device)
        moved.append(real)
        ts = timed_samples(fn, repeats, sync, barrier=lambda: dist.barrier(group=group))
        m = median(ts)
        meds.append(m)
        spreads.append(iqr(ts) / m if m > 0 else 0.0)
    shared = max_over_ranks([*meds, *spreads], job, device)
    k = len(sizes)
    return [Sample(moved[i], max(shared[i], 1e-9), shared[k + i]) for i in range(k)]


def _rate(fn: Callable[[], Any], work: float, min_seconds: float, sync: Sync) -> float:
    """``work`` units per second of ``fn``, run until ``min_seconds`` have passed (one
    warm-up run first): long enough that every rank's run overlaps the others'."""
    fn()
    sync()
    k, t0 = 0, time.perf_counter()
    while True:
        fn()
        k += 1
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return work * k / dt


def compute_rates(group: Any, device: Any, dtype: Any, sizes: Sequence[int], copy_bytes: int,
                  min_seconds: float, sync: Sync, tokens: int = 512) -> dict[str, Any]:
    """Matmul FLOP/s per square size, a training block's per width (:func:`_block_rate`,
    at ``sizes`` and at a quarter and half the smallest, as models' small Linear layers
    run; ``matmul_curve`` pairs each block's FLOPs per kernel with its rate and
    ``peak_flops`` is the fastest), the bandwidth the block's elementwise ops reach in
    training per width (:func:`_activation_bandwidth`; ``mem_bandwidth`` is their median),
    copy bandwidth and the time of a tiny elementwise kernel, each timed with every rank
    running it at once (barrier first) and averaged over the ranks: where ranks share cores, the slowest rank over a
    fraction of a second is the scheduler's noise (21-46 GFLOP/s between runs here, 4
    ranks on 2 cores), while over a training step every rank gets its share."""

    rates = []
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        dist.barrier(group=group)
        rates.append(_rate(lambda a=a, b=b: torch.mm(a, b), 2.0 * n**3, min_seconds, sync))
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dist.barrier(group=group)
    copy = _rate(lambda: dst.copy_(src), 2.0 * copy_bytes, min_seconds, sync)  # read + write
    tiny = torch.ones(256, dtype=torch.float32, device=device)
    dist.barrier(group=group)
    # 100 adds between synchronisations: on a GPU one add and a sync would time the
    # launch and the sync, not the kernel

    def adds() -> None:
        for _ in range(100):
            torch.add(tiny, tiny)
    per_op = 1.0 / _rate(adds, 100.0, min_seconds / 2, sync)
    widths = sorted({max(1, min(sizes) // 4), max(1, min(sizes) // 2), *sizes})
    blocks = [_block_rate(group, device, dtype, d, tokens, min_seconds, sync) for d in widths]
    acts = [_activation_bandwidth(group, device, dtype, d, tokens, min_seconds, sync) for d in sizes]
    mean = mean_over_ranks([*rates, copy, per_op, *blocks, *acts], group, device)
    k, b = len(rates), len(widths)
    mm, blk, act = mean[:k], mean[k + 2:k + 2 + b], mean[k + 2 + b:]
    # one kernel of the block: Linear(d, 4d) forward on ``tokens`` rows (the others are
    # of its size); mean_over_ranks keeps every rank's curve identical
    curve = [(2.0 * tokens * d * 4 * d, r) for d, r in zip(widths, blk)]
    return {"matmul_flops": dict(zip((int(n) for n in sizes), mm)),
            "block_flops": dict(zip((int(n) for n in widths), blk)), "matmul_curve": curve,
            "peak_flops": max(blk),
            "activation_bandwidth": dict(zip((int(n) for n in sizes), act)),
            "copy_bandwidth": mean[k], "mem_bandwidth": median(act), "kernel_floor": mean[k + 1]}


def matmul_block(d: int) -> Any:
    """The module :func:`_block_rate` trains: a layer's two matmuls, Linear(d, 4d) and
    Linear(4d, d), and nothing between them.  No norm and no activation: the cost model
    prices those as nodes of their own (roofline on their bytes), so a rate that timed
    them as matmul FLOPs counted them twice (with a LayerNorm and a GELU in the block,
    matmul-heavy models were priced ~30% slow on their matmuls)."""
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d))


def _block_rate(group: Any, device: Any, dtype: Any, d: int, tokens: int, min_seconds: float,
                sync: Sync) -> float:
    """FLOP/s of a training layer's matmuls: forward and backward of :func:`matmul_block`
    on ``tokens`` rows, autograd included (3 x the forward's FLOPs).  It is the rate the
    model's matmuls reach inside a real backward, with non-square shapes and weight
    gradients, unlike square matmuls alone."""

    blk = matmul_block(d).to(device=device, dtype=dtype)
    x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
    seed = torch.ones(tokens, d, device=device, dtype=dtype)

    def step() -> None:
        # a given output gradient: a sum's backward would add an expand the model's
        # matmuls do not have
        blk(x).backward(seed)
    dist.barrier(group=group)
    return _rate(step, 3 * 2 * 2 * tokens * d * 4 * d, min_seconds, sync)


def _activation_bandwidth(group: Any, device: Any, dtype: Any, d: int, tokens: int,
                          min_seconds: float, sync: Sync, backward_factor: float = 2.0) -> float:
    """Bytes/s of a training layer's elementwise ops in the cost model's own terms: forward
    and backward of LayerNorm(d) on ``tokens`` rows and GELU on ``tokens`` rows of ``4d``
    (what :func:`matmul_block` leaves out), each op's inputs and outputs counted once
    (``bytes_moved`` of :func:`autopar.capture.annotate.annotate`) times ``1 + backward_factor``,
    as :meth:`autopar.search.node_prices.CostModel.op_time` prices them.

    A copy of a large buffer streams at 30 GB/s on one CPU core here, but in a training
    step the norms, activations, products and residual adds of both a GPT and a Llama
    ran at 12 GB/s in these terms (profiled on one rank: their backward reads tensors
    saved long before, GELU and SiLU are bound by their arithmetic, not by memory), and
    this block measures 12-16 GB/s; priced at the copy's rate, every model's elementwise
    work came out 2.5x fast, most for a model made of many small ops."""

    norm = torch.nn.LayerNorm(d).to(device=device, dtype=dtype)
    x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
    h = torch.randn(tokens, 4 * d, device=device, dtype=dtype, requires_grad=True)
    gx, gh = torch.ones_like(x), torch.ones_like(h)

    def step() -> None:
        norm(x).backward(gx)
        torch.nn.functional.gelu(h).backward(gh)
    size = torch.empty((), dtype=dtype).element_size()
    # layer_norm reads x, weight and bias and writes its output; gelu reads h, writes its output
    moved = size * (2 * tokens * d + 2 * d + 2 * tokens * 4 * d)
    dist.barrier(group=group)
    return _rate(step, (1.0 + backward_factor) * moved, min_seconds, sync)


def mean_over_ranks(values: Sequence[float], group: Any, device: Any) -> list[float]:
    """Element-wise mean of ``values`` over the ranks of ``group`` (identical on every rank)."""

    vec = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(vec, group=group)  # SUM
    return [float(x) / dist.get_world_size(group) for x in vec.cpu().tolist()]


def _step_seconds(step: Callable[[], Any], between: Callable[[], Any], min_seconds: float,
                  sync: Sync) -> float:
    """Mean seconds of ``step`` run after ``between`` each time (``between`` not timed),
    until ``min_seconds`` of wall time have passed (one warm-up first)."""
    between()
    step()
    sync()
    spent, k, t_start = 0.0, 0, time.perf_counter()
    while True:
        between()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        spent += time.perf_counter() - t0
        k += 1
        if time.perf_counter() - t_start >= min_seconds:
            return spent / k


def optimizer_rates(group: Any, device: Any, elements: int, min_seconds: float,
                    sync: Sync, width: int = 128, tokens: int = 512, dtype: Any = None,
                    small: int = 64) -> dict[str, float]:
    """A foreach AdamW step in :func:`~autopar.cost_models.compute.optimizer_step_time`'s
    terms over replicated DTensor parameters (what a ParallelModule's optimizer steps),
    each step timed after a forward and backward of :func:`matmul_block` (not
    timed), as it runs after a training step's: ``bandwidth``, bytes/s of ``elements``
    fp32 parameters in 8 tensors (it reads the parameters, gradients and two states and
    writes parameters and states, ``3 P + 2 S`` with ``P = 4`` and ``S = 8`` bytes per
    element, 28 bytes per element), and ``tensor_seconds``, what each parameter tensor
    costs beyond its bytes, from ``small`` tensors of 1024 elements.

    On a CPU the foreach kernels loop over the tensors, a dozen small kernels each (on a
    GPU one fused launch covers many): 64 tensors of 2048 elements took 1.1-1.9 ms here,
    15x their bytes' time, and the 4-layer GPT's 69 and the Llama's 21 tensors stepped in
    6.1 and 2.0 ms of a training loop, priced 3.1 and 0.7 from the bandwidth of 8 large
    tensors timed back to back, whose caches a training step's activations flush."""

    blk = matmul_block(width).to(device=device, dtype=dtype or torch.float32)
    x = torch.randn(tokens, width, device=device, dtype=dtype or torch.float32, requires_grad=True)
    seed = torch.ones_like(x)

    def train() -> None:
        blk(x).backward(seed)

    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD,
                                 torch.device(device).type)

    def held(size: int) -> Any:
        # what a ParallelModule's optimizer steps: a DTensor (replicated on the group's
        # mesh), whose dispatch costs each tensor 50-75 us a step beyond a plain one's on
        # 4 gloo ranks of 2 cores (3.6-5.2 ms for the 4-layer GPT's 69 tensors); ZeRO
        # shrinks the bytes, not that
        return DTensor.from_local(torch.randn(size, device=device), mesh, (Replicate(),),
                                  run_check=False)

    def adamw(n: int, size: int) -> tuple[Callable[[], Any], int]:
        params = [torch.nn.Parameter(held(size)) for _ in range(n)]
        for q in params:
            q.grad = held(size)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)

        def step() -> None:
            with torch.no_grad():
                opt.step()
        return step, n * size

    dist.barrier(group=group)
    try:
        big, n_big = adamw(8, elements // 8)
        t_big = _step_seconds(big, train, min_seconds, sync)
        few, n_few = adamw(small, 1024)
        t_few = _step_seconds(few, train, min_seconds, sync)
    finally:
        # DTensor's sharding caches keep this mesh alive past the calibration, and with
        # it the group: a script that then calls destroy_process_group() and exits
        # aborted at exit now and then ("terminate called without an active exception",
        # autopar/runtime/mesh.py release_groups says why).  Nothing uses the mesh again.
        mesh._pg_registry.clear()
    # the slowest rank's (a MAX of negated rates: the smallest bandwidth)
    bw_neg, t_few = max_over_ranks([-28.0 * n_big / t_big, t_few], group, device)
    bandwidth = -bw_neg
    return {"bandwidth": bandwidth,
            "tensor_seconds": max(0.0, (t_few - 28.0 * n_few / bandwidth) / small)}
