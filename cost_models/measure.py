"""What :func:`~autopar.cost_models.calibrate.calibrate` times on the running group.

Every function here is collective over its group (every rank calls it with the same
arguments, in the same order) and returns numbers that are identical on every rank:
per-rank timings are all-reduced with MAX, because the slowest rank paces a collective
program and every rank must derive the same MeshSpec to plan the same.

Everything is timed while every rank does the same thing at once, as training does:
on a host whose ranks share cores (gloo on a CPU) a matmul timed on one idle rank runs
twice as fast as it does in training, which is what the first calibration got wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Sample", "collective_samples", "compute_rates", "iqr", "max_over_ranks", "median",
           "optimizer_bandwidth", "overlap_fraction", "timed_samples"]

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
    import torch
    import torch.distributed as dist

    if not values:
        return []
    vec = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    return [float(x) for x in vec.cpu().tolist()]


def timed_samples(fn: Callable[[], Any], repeats: int, sync: Sync,
                  barrier: Callable[[], None] | None = None) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn`` after one warm-up run; ``barrier`` before
    each run so no rank's timer includes waiting for a late peer."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _collective(kind: str, group: Any, nbytes: int, device: Any) -> Callable[[], None]:
    """A closure issuing one ``kind`` collective of ``nbytes`` (the module table's meaning:
    full bytes for all-gather / reduce-scatter, per-rank bytes for all-to-all, the message
    for send/recv, which is a ring: each rank sends to the next and receives from the last)."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    p = dist.get_world_size(group)
    n = max(p, nbytes // 4 // p * p)  # fp32 elements, divisible by the ranks
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
            works = [dist.isend(src, nxt, group=group), dist.irecv(dst, prv, group=group)]
            for w in works:
                w.wait()
        return ring
    raise ValueError(f"cannot measure collective kind {kind!r}")


def collective_samples(kind: str, group: Any, sizes: Sequence[int], repeats: int,
                       device: Any, sync: Sync) -> list[Sample]:
    """``kind`` timed at each of ``sizes`` bytes: median and spread over ``repeats``."""
    import torch.distributed as dist

    meds, spreads = [], []
    for nb in sizes:
        ts = timed_samples(_collective(kind, group, nb, device), repeats, sync,
                           barrier=lambda: dist.barrier(group=group))
        m = median(ts)
        meds.append(m)
        spreads.append(iqr(ts) / m if m > 0 else 0.0)
    shared = max_over_ranks([*meds, *spreads], group, device)
    k = len(sizes)
    return [Sample(int(nb), max(shared[i], 1e-9), shared[k + i]) for i, nb in enumerate(sizes)]


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
                  min_seconds: float, sync: Sync) -> dict[str, Any]:
    """Matmul FLOP/s per square size, the median of them, copy bandwidth and the time of a
    tiny elementwise kernel, each timed with every rank running it at once (barrier
    first) and the slowest rank's rate kept."""
    import torch
    import torch.distributed as dist

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
    per_op = 1.0 / _rate(lambda: torch.add(tiny, tiny), 1.0, min_seconds / 2, sync)
    # MAX over ranks of times is MIN of rates: negate the rates
    shared = max_over_ranks([-r for r in rates] + [-copy, per_op], group, device)
    mm = [-x for x in shared[:len(rates)]]
    return {"matmul_flops": dict(zip((int(n) for n in sizes), mm)), "peak_flops": median(mm),
            "mem_bandwidth": -shared[len(rates)], "kernel_floor": shared[len(rates) + 1]}


def optimizer_bandwidth(group: Any, device: Any, elements: int, min_seconds: float,
                        sync: Sync) -> float:
    """Bytes/s of a foreach AdamW step on ``elements`` fp32 parameters in 8 tensors, in
    :func:`~autopar.cost_models.compute.optimizer_step_time`'s terms: it reads the
    parameters, gradients and two states and writes parameters and states, ``3 P + 2 S``
    with ``P = 4`` and ``S = 8`` bytes per element, i.e. 28 bytes per element."""
    import torch
    import torch.distributed as dist

    params = [torch.nn.Parameter(torch.randn(elements // 8, device=device)) for _ in range(8)]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    dist.barrier(group=group)
    with torch.no_grad():
        rate = _rate(opt.step, 28.0 * (elements // 8) * 8, min_seconds, sync)
    return -max_over_ranks([-rate], group, device)[0]


def overlap_fraction(group: Any, nbytes: int, device: Any, dtype: Any, mm_n: int,
                     repeats: int, sync: Sync) -> dict[str, float]:
    """``MeshSpec.overlap`` fitted to a measurement in the terms the bucket model uses.

    ``A``: an ``nbytes`` all-reduce alone; ``C``: matmuls alone, about ``A / 2`` of them;
    ``T``: the all-reduce started asynchronously, the same matmuls, then its wait.  The
    model (:func:`autopar.solve.buckets._end`) says a reduction runs at ``overlap`` of its
    speed while compute lasts and at full speed after, and compute is not slowed, so
    ``T = C + A - C * overlap`` while ``C < A``; hence ``overlap = (C + A - T) / C``.  On
    GPUs ``T ~ A`` (overlap 1); where ranks share cores, communication also takes the
    compute's cycles and ``T`` nears ``C + A`` (overlap near 0)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    a = torch.randn(mm_n, mm_n, dtype=dtype, device=device)
    b = torch.randn(mm_n, mm_n, dtype=dtype, device=device)

    def bar() -> None:
        dist.barrier(group=group)

    alone = median(timed_samples(lambda: dist.all_reduce(buf, group=group), repeats, sync, bar))
    one = median(timed_samples(lambda: torch.mm(a, b), repeats, sync, bar))
    # the same count on every rank (MAX), so every rank computes as long as the others
    k = max(1, int(max_over_ranks([alone / 2 / max(one, 1e-9)], group, device)[0]))

    def compute() -> None:
        for _ in range(k):
            torch.mm(a, b)

    def both() -> None:
        work = dist.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()

    c = median(timed_samples(compute, repeats, sync, bar))
    t = median(timed_samples(both, repeats, sync, bar))
    a_s, c_s, t_s = max_over_ranks([alone, c, t], group, device)
    fraction = (c_s + a_s - t_s) / c_s if c_s > 0 else 1.0
    # (0, 1]: beside compute a collective is never faster, and a measurement slower than
    # both in series still leaves it a sliver (MeshSpec.overlap must be > 0)
    return {"overlap": min(1.0, max(0.02, fraction)), "alone": a_s, "compute": c_s, "both": t_s}
