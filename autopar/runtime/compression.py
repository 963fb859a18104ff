"""Compressed reduction of a data-parallel gradient bucket (decision ``grad_compression``;
:class:`autopar.runtime.grad_sync.GradSync` calls these instead of its all-reduce).

Both kinds leave the bucket's flat buffer holding the *sum* over the ranks, as the plain
all-reduce does, so everything after the reduction (the gradient bridge, clipping, the
optimizer) is unchanged.

* :class:`Bf16Sum`: bf16 on the wire, fp32 accumulation.  torch's
  ``bf16_compress_hook`` all-reduces in bf16, so every hop of the ring rounds the partial
  sum to bf16; here each rank casts its bucket to bf16 and sends chunk ``k`` to rank
  ``k`` (an all-to-all, launched as the bucket fills, under the backward), rank ``k``
  sums the chunks it received in fp32 and rounds once, and the sums are gathered in
  bf16 once the backward has ended (:meth:`Bf16Sum.finish`, in bucket order on every
  rank).  Each element of the result is ``bf16(sum_i bf16(g_i))``: two roundings,
  whatever the rank count.
* :class:`PowerSgd`: low rank with error feedback, two all-reduces a bucket (the
  ``P`` factors with the uncompressed gradients, then the ``Q`` factors), issued at
  once in bucket order: the backward waits while a bucket reduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.runtime.tls import issue

POWERSGD_START = 10
"""Steps a bucket is all-reduced whole before PowerSGD starts compressing it (torch's
``start_powerSGD_iter``; its default of 1,000 suits week-long runs, and delays any
gain by as many steps)."""


@dataclass
class Bf16Pending:
    """One bucket's all-to-all in flight and what its finish needs."""

    work: object
    send: torch.Tensor  # kept alive until the all-to-all has read it
    recv: torch.Tensor
    ranks: int
    group: object


class Bf16Sum:
    """bf16 transport, fp32 sums (module docstring)."""

    @staticmethod
    def launch(flat: torch.Tensor, ranks: int, group) -> Bf16Pending:
        """Cast ``flat`` to bf16, padded to a multiple of ``ranks``, and start the
        all-to-all."""
        n = flat.numel()
        padded = n + (-n) % ranks
        send = torch.zeros(padded, dtype=torch.bfloat16, device=flat.device)
        send[:n].copy_(flat.reshape(-1))
        recv = torch.empty_like(send)
        work = issue(dist.all_to_all_single, recv, send, group=group, async_op=True)
        return Bf16Pending(work, send, recv, ranks, group)

    @staticmethod
    def gather(p: Bf16Pending) -> tuple[object, torch.Tensor]:
        """Wait for the all-to-all, sum this rank's chunk in fp32 and start gathering
        the sums (bf16)."""
        p.work.wait()
        chunk = p.recv.numel() // p.ranks
        mine = p.recv.view(p.ranks, chunk).float().sum(0).to(torch.bfloat16)
        p.send = p.recv = None  # the buffers are done with
        out = torch.empty(chunk * p.ranks, dtype=torch.bfloat16, device=mine.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return issue(fn, out, mine, group=p.group, async_op=True), out

    @staticmethod
    def finish(flat: torch.Tensor, work, out: torch.Tensor) -> None:
        """Wait for the gather and put the sums into ``flat``."""
        work.wait()
        flat.reshape(-1).copy_(out[:flat.numel()])


MIN_COMPRESSION_RATE = 2.0
"""A matrix is sent as its low-rank factors only when they are at most half its size
(torch's ``PowerSGDState.min_compression_rate``)."""


def low_rank(shape: tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
    """``(n, m, r)`` of a gradient of ``shape`` viewed as a matrix (``n`` its first dim),
    or None when PowerSGD sends it whole (a vector, or factors over half its size)."""
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape[1:])
    r = min(n, m, rank)
    return (n, m, r) if (n + m) * r * MIN_COMPRESSION_RATE < n * m else None


@dataclass
class _Factors:
    """One bucket's PowerSGD state: its error feedback and each matrix's ``Q``."""

    error: torch.Tensor
    qs: list[torch.Tensor]


class PowerSgd:
    """PowerSGD (Vogels et al., 2019) over GradSync's buckets, rank ``rank``, with error
    feedback and warm-started ``Q``: for each gradient matrix ``M`` (after adding the
    rank's error), ``P = sum_ranks(M Q)`` orthonormalised, ``Q = sum_ranks(M^T P)``,
    and ``P Q^T`` is the sum's approximation; the rank's error becomes ``M - P Q^T / p``
    (the errors sum to what the approximation missed).  Vectors and matrices not worth
    compressing are summed whole, in the same all-reduce as the ``P`` factors.

    Written here rather than calling torch's ``powerSGD_hook``: the hook issues its
    second and third all-reduces from future callbacks on gloo's worker threads, which
    cannot be issued through :func:`autopar.runtime.tls.issue` and aborted a 4-rank gloo
    process at exit ("terminate called without an active exception") in this project's
    first trial; and it clones the bucket for the error feedback, one more pass over it.
    Here every collective is issued from the calling thread, in bucket order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: dict[int, int] = {}
        """Reductions per bucket index so far (the first :data:`POWERSGD_START` are whole)."""
        self._state: dict[int, _Factors] = {}

    def reduce(self, flat: torch.Tensor, views: list[torch.Tensor], index: int,
               ranks: int, group) -> None:
        """Reduce bucket ``index`` now: ``flat`` (whose parts ``views`` are) holds the
        (approximate) sum over the ``ranks`` of ``group`` afterwards."""
        done = self.steps.get(index, 0)
        self.steps[index] = done + 1
        if done < POWERSGD_START:
            issue(dist.all_reduce, flat, group=group)
            return
        mats, whole = [], []
        for v in views:
            nmr = low_rank(tuple(v.shape), self.rank)
            (mats if nmr is not None else whole).append((v, nmr))
        st = self._state.get(index)
        if st is None:
            st = self._state[index] = _Factors(torch.zeros_like(flat), [])
            gen = torch.Generator().manual_seed(index)  # the same Q on every rank
            for _, (_, m, r) in mats:
                q = torch.randn(m, r, generator=gen, dtype=flat.dtype)
                st.qs.append(torch.linalg.qr(q).Q.to(flat.device))
        flat.add_(st.error)
        ms = [v.reshape(nmr[0], nmr[1]) for v, nmr in mats]
        ps = [mat @ q for mat, q in zip(ms, st.qs)]
        sizes = [v.numel() for v, _ in whole] + [p.numel() for p in ps]
        buf = torch.cat([v.reshape(-1) for v, _ in whole] + [p.reshape(-1) for p in ps]) \
            if sizes else flat.new_zeros(0)
        issue(dist.all_reduce, buf, group=group)
        parts = list(buf.split(sizes))
        for (v, _), part in zip(whole, parts):
            v.copy_(part.view_as(v))
        ps = [torch.linalg.qr(part.view_as(p)).Q for part, p in zip(parts[len(whole):], ps)]
        qs = [mat.T @ p for mat, p in zip(ms, ps)]
        qbuf = torch.cat([q.reshape(-1) for q in qs]) if qs else flat.new_zeros(0)
        issue(dist.all_reduce, qbuf, group=group)
        st.error.zero_()  # the gradients sent whole leave none
        errors = self._error_views(st.error, flat, [v for v, _ in mats])
        st.qs = [q.view(-1, p.shape[1]) for q, p in zip(qbuf.split([q.numel() for q in qs]), ps)]
        for mat, p, q, e in zip(ms, ps, st.qs, errors):
            approx = p @ q.T
            torch.sub(mat, approx, alpha=1.0 / ranks, out=e.view_as(mat))
            mat.copy_(approx)

    @staticmethod
    def _error_views(error: torch.Tensor, flat: torch.Tensor,
                     views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parts of ``error`` laid out as ``views`` lie in ``flat``."""
        base = flat.data_ptr()
        size = flat.element_size()
        return [error.narrow(0, (v.data_ptr() - base) // size, v.numel()) for v in views]


__all__ = ["MIN_COMPRESSION_RATE", "POWERSGD_START", "Bf16Pending", "Bf16Sum", "PowerSgd", "low_rank"]
