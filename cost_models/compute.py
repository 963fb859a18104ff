"""Roofline compute cost of one kernel on one device of a :class:`~autopar.cost_models.mesh.MeshSpec`.

``time = straggler * max(flops / (peak_flops * flops_efficiency), bytes_moved / mem_bandwidth, kernel_floor)``.
A node that moves no bytes and does no FLOPs (a view) is free.
"""

from __future__ import annotations

import math
import numbers

import torch

from .mesh import MeshSpec

__all__ = ["compute_time", "kernel_rate", "matmul_flops", "optimizer_step_time"]


def _check_amount(name: str, value: float) -> None:
    """Raise ValueError unless ``value`` is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def compute_time(mesh: MeshSpec, flops: float, bytes_moved: float,
                 dtype: torch.dtype | None = None, launch: bool = True) -> float:
    """Seconds one device of ``mesh`` needs for a kernel doing ``flops`` in ``dtype`` and
    moving ``bytes_moved``.

    The max of the compute-bound time (at ``flops_efficiency`` of the dtype's peak,
    :meth:`MeshSpec.peak_for`), the memory-bound time, and the per-kernel launch floor,
    times ``mesh.straggler`` (the slowest rank paces the step); 0.0 when both amounts are
    zero, since views launch nothing.  ``launch=False``: an op fused into a kernel
    another op launches (a compiled graph's pointwise chain), no floor of its own.
    """
    _check_amount("flops", flops)
    _check_amount("bytes_moved", bytes_moved)
    if flops == 0 and bytes_moved == 0:
        return 0.0
    return mesh.straggler * max(
        flops / kernel_rate(mesh, flops, dtype),
        bytes_moved / mesh.mem_bandwidth,
        mesh.kernel_floor if launch else 0.0,
    )


def kernel_rate(mesh: MeshSpec, flops: float, dtype: torch.dtype | None = None) -> float:
    """FLOP/s a kernel doing ``flops`` in ``dtype`` reaches on ``mesh``: the dtype's peak
    times ``flops_efficiency``, scaled by ``mesh.matmul_curve`` where calibration measured
    one (its rate at this size over ``peak_flops``; log-linear between its points, the
    end points' rates beyond them).  Small matmuls run well below a large one's rate (a
    layer's Linear layers forward and backward on one CPU core: 68 GFLOP/s at 4 MFLOP a
    kernel, 88 at 17, 94 at 150), so one rate prices a model of small matmuls fast and
    one of large matmuls slow.  Never above the peak, so :func:`autopar.search.node_prices.compute_floor`
    stays a lower bound."""
    rate = mesh.peak_for(dtype) * mesh.flops_efficiency
    curve = mesh.matmul_curve
    if not curve or flops <= 0:
        return rate
    if flops <= curve[0][0]:
        r = curve[0][1]
    elif flops >= curve[-1][0]:
        r = curve[-1][1]
    else:
        i = next(i for i in range(1, len(curve)) if curve[i][0] >= flops)
        (f0, r0), (f1, r1) = curve[i - 1], curve[i]
        w = math.log(flops / f0) / math.log(f1 / f0)
        r = r0 + w * (r1 - r0)
    return rate * r / mesh.peak_flops


def matmul_flops(m: int, k: int, n: int, batch: int = 1) -> float:
    """FLOPs of ``batch`` products of an (m, k) by a (k, n) matrix: ``2 * batch * m * k * n``
    (one multiply and one add per inner-product term)."""
    for name, v in (("m", m), ("k", k), ("n", n), ("batch", batch)):
        _check_amount(name, v)
    return float(2 * batch * m * k * n)


def optimizer_step_time(mesh: MeshSpec, param_bytes: float, state_bytes: float,
                        tensors: int = 1) -> float:
    """Seconds one device of ``mesh`` spends updating ``param_bytes`` of parameters in
    ``tensors`` tensors with ``state_bytes`` of optimizer state (AdamW: two fp32 states
    per element).

    An elementwise update is memory-bound: it reads the parameters, their gradients and
    the states and writes the parameters and the states back, ``3 * param_bytes + 2 *
    state_bytes`` at ``mesh.optimizer_bandwidth`` (what calibration measured for a real
    step), else ``mesh.mem_bandwidth``.  Each tensor adds ``mesh.optimizer_tensor_seconds``:
    on a GPU the fused (foreach) kernels launch a few kernels per step whatever the
    tensors (0 on the presets), but a CPU's foreach kernels loop over the tensors, a
    dozen small kernels each, which calibration measures.
    """
    _check_amount("param_bytes", param_bytes)
    _check_amount("state_bytes", state_bytes)
    _check_amount("tensors", tensors)
    stream = (3.0 * param_bytes + 2.0 * state_bytes) / (mesh.optimizer_bandwidth or mesh.mem_bandwidth)
    return mesh.straggler * (stream + tensors * mesh.optimizer_tensor_seconds)
