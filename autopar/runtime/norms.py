"""Local form of batch norm with its input sharded: SyncBatchNorm's semantics.

Training normalises every channel by the statistics of the whole batch (and every
spatial position).  With the batch or a spatial dim sharded over ``stat_axes``, each
rank sums its own elements and the sums are all-reduced (differentiably, so the
backward all-reduces the statistics' gradients exactly as ``nn.SyncBatchNorm``
does).  With the channels sharded over ``channel_axes`` each rank normalises its own
channels; the running statistics stay whole and equal on every rank: each rank
writes its channels' update into a zero vector and the vectors are summed over the
channel axes.  Evaluation reads the running statistics: no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopar.runtime.collectives import all_reduce, all_reduce_nograd
from autopar.runtime.ops import shard_offset


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view(1, -1, *([1] * (ndim - 2)))


def _sync_stats(x: torch.Tensor, stat_axes: tuple[int, ...],
                count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of every channel over the whole (sharded) batch, by
    two all-reduced passes (the second about the global mean: no cancellation)."""
    dims = [0, *range(2, x.ndim)]
    s1 = x.sum(dims)
    for a in stat_axes:
        s1 = all_reduce(s1, a)
    mean = s1 / count
    d = x - _per_channel(mean, x.ndim)
    s2 = (d * d).sum(dims)
    for a in stat_axes:
        s2 = all_reduce(s2, a)
    return mean, s2 / count


def _update_running(buf: torch.Tensor, local: torch.Tensor, off: int,
                    channel_axes: tuple[int, ...]) -> None:
    """Write this rank's channels (``local``, already updated) into the whole buffer
    on every rank of the channel axes."""
    if not channel_axes:
        buf.copy_(local)
        return
    full = torch.zeros_like(buf)
    full[off:off + local.shape[0]] = local
    buf.copy_(all_reduce_nograd(full, channel_axes))


def batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               training: bool, momentum: float, eps: float, stat_axes: tuple[int, ...],
               channel_axes: tuple[int, ...], count: int) -> torch.Tensor:
    """``aten.batch_norm`` on a rank's shard (see the module docstring): ``x`` has its
    batch/spatial dims sharded over ``stat_axes`` and its channels over
    ``channel_axes``; ``weight``/``bias`` are this rank's channels; the running
    statistics are whole; ``count`` is the global number of elements per channel."""
    c = x.shape[1]
    off = shard_offset(channel_axes, c) if channel_axes else 0
    rm = running_mean.narrow(0, off, c) if running_mean is not None else None
    rv = running_var.narrow(0, off, c) if running_var is not None else None
    if not training or not stat_axes:
        if not training or rm is None:
            return F.batch_norm(x, rm, rv, weight, bias, training, momentum, eps)
        rm, rv = rm.clone(), rv.clone()  # F.batch_norm updates them; spread below
        y = F.batch_norm(x, rm, rv, weight, bias, True, momentum, eps)
    else:
        mean, var = _sync_stats(x, stat_axes, count)
        y = (x - _per_channel(mean, x.ndim)) * _per_channel(torch.rsqrt(var + eps), x.ndim)
        if weight is not None:
            y = y * _per_channel(weight, x.ndim)
        if bias is not None:
            y = y + _per_channel(bias, x.ndim)
        if rm is None:
            return y
        with torch.no_grad():
            unbiased = var.detach() * (count / max(count - 1, 1))
            rm = rm * (1 - momentum) + mean.detach() * momentum
            rv = rv * (1 - momentum) + unbiased * momentum
    with torch.no_grad():
        _update_running(running_mean, rm, off, channel_axes)
        _update_running(running_var, rv, off, channel_axes)
    return y


batch_norm._autopar_train_arg = 5  # passes/train_mode.py flips it with the module's mode
batch_norm._autopar_stats_arg = 3  # ... unless the running mean there is None (batch statistics)

__all__ = ["batch_norm"]
