"""Collectives split into a start and a wait, for multi-copy overlap (decision ``copies``,
:mod:`autopar.passes.multi_copy`): a copy's collective is started, the other copy's
ops run, and the result is waited for right before its first use.

``start(kind, x, *args)`` issues the collective asynchronously and returns a token (an
empty tensor carrying the autograd link to ``x``); ``wait(token)`` waits and returns the
result.  In backward the pair runs the other way round: ``wait``'s backward issues the
dual collective on the incoming gradient (the table in :mod:`autopar.runtime.collectives`)
and ``start``'s backward, which autograd runs after whatever became ready meanwhile (the
other copy's backward), waits for it.  Every rank builds the same graph and autograd
orders a backward by its nodes' creation, so every rank issues the same collectives in
the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd import Function

from autopar.runtime.collectives import _group, reduce_scatter_flat
from autopar.runtime.tls import issue

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_DUAL = {"all_reduce": "all_reduce", "all_gather": "reduce_scatter",
         "reduce_scatter": "all_gather", "all_to_all": "all_to_all"}
_PENDING: dict[int, _Handle] = {}


class _Handle:
    """One split collective: what finishes its forward and its backward."""

    def __init__(self, kind: str, args: tuple) -> None:
        self.kind, self.args = kind, args
        self.finish: Callable[[], torch.Tensor] | None = None
        self.back: Callable[[], torch.Tensor] | None = None


def _launch(kind: str, x: torch.Tensor, args: tuple) -> Callable[[], torch.Tensor]:
    """Issue ``kind`` on ``x`` asynchronously; the function returned waits and gives
    the result (what :mod:`autopar.runtime.collectives`' blocking form returns)."""
    axis = args[-1]
    g, n = _group(axis)
    if kind == "all_reduce":
        y = x.contiguous().clone()
        work = issue(dist.all_reduce, y, group=g, async_op=True)
        return lambda: (work.wait(), y)[1]
    if kind == "all_gather":
        dim = args[0]
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
        work = issue(dist.all_gather, parts, x.contiguous(), group=g, async_op=True)
        return lambda: (work.wait(), torch.cat(parts, dim=dim))[1]
    if kind == "reduce_scatter":
        dim = args[0]
        chunks = [c.contiguous() for c in x.chunk(n, dim=dim)]
        flat = torch.cat([c.reshape(-1) for c in chunks])
        out = torch.empty(chunks[0].numel(), dtype=x.dtype, device=x.device)
        work = reduce_scatter_flat(out, flat, g, async_op=True)
        return lambda: (work.wait(), out.view(chunks[0].shape))[1]
    gather_dim, scatter_dim = args[0], args[1]
    chunks = [c.contiguous() for c in x.chunk(n, dim=scatter_dim)]
    flat = torch.cat([c.reshape(-1) for c in chunks])
    out = torch.empty_like(flat)
    work = issue(dist.all_to_all_single, out, flat, group=g, async_op=True)
    return lambda: (work.wait(), torch.cat([p.view(chunks[0].shape) for p in out.chunk(n)],
                                           dim=gather_dim))[1]


def _dual_args(kind: str, args: tuple) -> tuple:
    return (args[1], args[0], args[2]) if kind == "all_to_all" else args


class _Start(Function):
    @staticmethod
    def forward(ctx, x, kind, *args):  # noqa: D102
        h = _Handle(kind, args)
        h.finish = _launch(kind, x, args)
        ctx.h = h
        token = x.new_empty(0)
        _PENDING[id(token)] = h
        return token

    @staticmethod
    def backward(ctx, _token_grad):  # noqa: D102
        h = ctx.h
        grad = h.back() if h.back is not None else None
        h.back = None
        return (grad, None, *([None] * len(h.args)))


class _Wait(Function):
    @staticmethod
    def forward(ctx, token):  # noqa: D102
        h = _PENDING.pop(id(token))
        ctx.h = h
        out = h.finish()
        h.finish = None
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        h = ctx.h
        h.back = _launch(_DUAL[h.kind], grad.contiguous(), _dual_args(h.kind, h.args))
        return grad.new_empty(0)


def start(kind: str, x: torch.Tensor, *args) -> torch.Tensor:
    """Issue collective ``kind`` (:data:`KINDS`, with
    :mod:`autopar.runtime.collectives`' arguments after ``x``) without waiting; returns
    the token :func:`wait` takes."""
    return _Start.apply(x, kind, *args)


def wait(token: torch.Tensor) -> torch.Tensor:
    """The result of the collective :func:`start` issued."""
    return _Wait.apply(token)


__all__ = ["KINDS", "start", "wait"]
