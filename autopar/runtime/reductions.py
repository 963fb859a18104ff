"""Local forms of non-linear reductions over a dim split across ranks: the 2-norm (an
all-reduce of the sum of squares) and the variance / standard deviation (two passes:
the global mean, then the global sum of squared deviations, each one all-reduce).

The result is whole (replicated) over the axes the reduced dims were split on.  The
all-reduces are autograd functions (:mod:`autopar.runtime.collectives`), so the
backward is right too.  Low-precision inputs accumulate in float32, as torch's own
kernels do.
"""

from __future__ import annotations

import torch

from autopar.runtime.collectives import all_reduce

_LOW = (torch.float16, torch.bfloat16)


def _summed(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    for a in axes:
        x = all_reduce(x, a)
    return x


def vector_norm2(x: torch.Tensor, dims: list[int], keepdim: bool,
                 axes: tuple[int, ...]) -> torch.Tensor:
    """``linalg_vector_norm(x, 2, dims, keepdim)`` with some of ``dims`` split over
    ``axes``.  A zero vector's gradient is 0, as torch's (not the NaN of sqrt at 0)."""
    xf = x.float() if x.dtype in _LOW else x
    s = _summed((xf * xf).sum(dims, keepdim=keepdim), axes)
    nonzero = s > 0
    out = torch.where(nonzero, s, torch.ones_like(s)).sqrt() * nonzero
    return out.to(x.dtype)


def variance(x: torch.Tensor, dims: list[int], correction: float, keepdim: bool,
             axes: tuple[int, ...], count: int, root: bool,
             with_mean: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``var``/``std`` (``root``) of ``x`` over ``dims``, some split over ``axes``;
    ``count``: the global number of elements reduced per output.  ``with_mean``
    returns ``(var, mean)`` as ``var_mean`` does.  Two passes: exact where the
    one-pass sum of squares loses the digits that a large mean cancels."""
    xf = x.float() if x.dtype in _LOW else x
    mean = _summed(xf.sum(dims, keepdim=True), axes) / count
    dev = xf - mean
    sq = _summed((dev * dev).sum(dims, keepdim=keepdim), axes)
    out = sq / max(count - correction, 0)
    if root:
        out = out.sqrt()
    if not with_mean:
        return out.to(x.dtype)
    m = mean if keepdim else mean.squeeze(dims)
    return out.to(x.dtype), m.to(x.dtype)


__all__ = ["variance", "vector_norm2"]
