"""Measure a :class:`~autopar.cost_models.mesh.MeshSpec` on the running cluster.

:func:`calibrate` times all-reduces of several sizes on an initialised ``torch.distributed``
process group and fits the ring formula ``t(S) = 2(p-1) alpha + 2(p-1)/p * S / beta`` by
least squares, then times a matmul (FLOP/s) and a copy (memory bandwidth) on the local device.
All timings are all-reduced with MAX (the slowest rank paces a collective program) before
anything is derived from them, so every rank returns the identical MeshSpec and plans the same.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .mesh import LinkSpec, MeshSpec

__all__ = ["calibrate", "fit_alpha_beta"]


def fit_alpha_beta(p: int, sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit ``(alpha, beta)`` of the ring all-reduce formula to measured ``times`` at ``sizes``.

    Fits ``t = a + b * S`` by least squares weighted by ``1 / t`` (relative error, so the small
    sizes that carry the latency are not swamped by the large ones), then
    ``alpha = a / (2(p-1))`` and ``beta = 2(p-1)/p / b``. Noise can make ``a`` or ``b``
    non-positive; the fit then falls back to the one-parameter model and finally to
    conservative bounds, so both results are always positive and finite.
    """
    if p < 2:
        raise ValueError(f"fit_alpha_beta needs p >= 2 ranks, got {p}")
    if len(sizes) != len(times) or not sizes:
        raise ValueError("sizes and times must be non-empty and of equal length")
    if any(not math.isfinite(t) or t <= 0 for t in times) or any(s <= 0 for s in sizes):
        raise ValueError(f"sizes and times must be positive and finite, got {sizes}, {times}")
    w = [1.0 / t for t in times]
    # Weighted normal equations for t = a + b x with weights w^2 on the squared residuals.
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, x in zip(w, sizes))
    sxx = sum(wi * wi * x * x for wi, x in zip(w, sizes))
    st = sum(wi * wi * t for wi, t in zip(w, times))
    sxt = sum(wi * wi * x * t for wi, x, t in zip(w, sizes, times))
    det = sw * sxx - sx * sx
    a, b = (-1.0, -1.0) if det <= 0 else ((sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det)
    if a <= 0 or b <= 0:
        # One of the two terms is not visible above the noise; fit the other alone.
        if b > 0:
            a, b = 0.0, sxt / sxx
        else:
            a, b = st / sw, 0.0
    # A term the data could not resolve is bounded by what the extreme sample allows.
    i_small = min(range(len(sizes)), key=lambda i: sizes[i])
    i_large = max(range(len(sizes)), key=lambda i: sizes[i])
    if b <= 0:
        b = times[i_large] / sizes[i_large]
    if a <= 0:
        # Small positive residual: 1% of the smallest message's time, so alpha stays > 0.
        a = 0.01 * times[i_small]
    return a / (2 * (p - 1)), 2 * (p - 1) / p / b


def _median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def _timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up run."""
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return _median(samples)


def _overlapped(group: Any, nb: int, compute: Callable[[], Any], repeats: int,
                sync: Callable[[], None], device: Any) -> float:
    """Median time of an ``nb``-byte all-reduce started asynchronously while this rank
    keeps computing until it completes (every rank does the same)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(nb // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier(group=group)
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, group=group, async_op=True)
        while not work.is_completed():
            compute()
            sync()
        work.wait()
        sync()
        times.append(time.perf_counter() - t0)
    return _median(times[1:])


def _host_memory_bytes() -> float:
    """Physical memory of this host divided among the ranks on it (LOCAL_WORLD_SIZE or 1)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX hosts
        total = 8 * 2**30
    return float(total) / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def calibrate(
    group: Any = None,
    sizes: Sequence[int] = (2**10, 2**16, 2**20, 2**22),
    repeats: int = 5,
    base: MeshSpec | None = None,
) -> MeshSpec:
    """Measure a 1-D MeshSpec named ``"calibrated"`` over ``group`` (default: the world group).

    Every rank of ``group`` must call this with the same arguments: it runs the same
    collectives in the same order (all-reduces of each size in ``sizes`` bytes, median of
    ``repeats``), a square matmul and a large copy locally, then all-reduces the timings with MAX
    so all ranks derive identical numbers; ``overlap`` is the largest all-reduce's time
    alone over its time while every rank keeps computing. ``peak_flops`` is the measured matmul rate (fp32 on
    CPU, bf16 on CUDA) with ``flops_efficiency = 1.0`` because it already is a real kernel's
    rate. ``mem_capacity`` and ``kernel_floor`` come from ``base`` when given, otherwise from
    the device (MIN over ranks). A single-rank group measures no link and keeps ``base``'s
    link, or the cpu-gloo preset's.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("calibrate() needs an initialised torch.distributed process group")
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in sizes):
        raise ValueError(f"sizes must be non-empty ints >= 4 bytes, got {sizes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    world = dist.get_world_size(group)

    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        mm_dtype, mm_n, copy_bytes = torch.bfloat16, 4096, 2**28

        def sync() -> None:
            torch.cuda.synchronize(device)
    else:
        device = torch.device("cpu")
        # Small enough to keep a CPU calibration well under a second per rank.
        mm_dtype, mm_n, copy_bytes = torch.float32, 256, 2**25

        def sync() -> None:
            pass

    # 1. All-reduce at each size; fp32 elements, so the byte count is rounded to a multiple of 4.
    nbytes = [4 * (s // 4) for s in sizes]
    ar_times: list[float] = []
    if world > 1:
        for nb in nbytes:
            buf = torch.ones(nb // 4, dtype=torch.float32, device=device)
            # A barrier first so no rank's timer includes waiting for a late peer.
            dist.barrier(group=group)
            ar_times.append(_timed(lambda b=buf: dist.all_reduce(b, group=group), repeats, sync))

    # 2. Local matmul and copy.
    a = torch.randn(mm_n, mm_n, dtype=mm_dtype, device=device)
    bmat = torch.randn(mm_n, mm_n, dtype=mm_dtype, device=device)
    mm_time = _timed(lambda: torch.mm(a, bmat), repeats, sync)
    # 2b. The largest all-reduce again while every rank computes: how much of its speed
    # communication keeps beside the backward (MeshSpec.overlap)
    busy_time = _overlapped(group, nbytes[-1], lambda: torch.mm(a, bmat), repeats, sync, device) \
        if world > 1 else 0.0
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_time = _timed(lambda: dst.copy_(src), repeats, sync)
    if device.type == "cuda":
        capacity = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        capacity = _host_memory_bytes()

    # 3. MAX over ranks. Capacity is negated so MAX yields the smallest device's capacity.
    # Timer resolution can round a tiny op to 0, which would make rates infinite; floor at 1 ns.
    local = [*ar_times, mm_time, copy_time, busy_time, -capacity]
    vec = torch.tensor([max(x, 1e-9) if i < len(local) - 1 else x for i, x in enumerate(local)],
                       dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    shared = [float(x) for x in vec.cpu().tolist()]
    ar_times, (mm_time, copy_time, busy_time, neg_capacity) = \
        shared[: len(ar_times)], shared[len(ar_times):]

    if world > 1:
        alpha, beta = fit_alpha_beta(world, nbytes, ar_times)
        link = LinkSpec(alpha=alpha, beta=beta)
    else:
        link = (base or MeshSpec.preset("cpu-gloo")).links[0]
        link = LinkSpec(alpha=link.alpha, beta=link.beta)
    peak_flops = 2.0 * mm_n**3 / mm_time
    # A copy reads and writes every byte.
    mem_bandwidth = 2.0 * copy_bytes / copy_time

    spec = MeshSpec(
        shape=(world,),
        axis_names=(),
        links=(link,),
        peak_flops=peak_flops,
        mem_bandwidth=mem_bandwidth,
        mem_capacity=-neg_capacity,
        flops_efficiency=1.0,
        name="calibrated",
        # the same all-reduce alone and beside compute (slowest rank each); capped at 1:
        # beside compute it cannot be faster, whatever the noise says
        overlap=min(1.0, ar_times[-1] / busy_time) if world > 1 and busy_time > 0 else 1.0,
    )
    if base is not None:
        spec = replace(spec, mem_capacity=base.mem_capacity, kernel_floor=base.kernel_floor)
    return spec

