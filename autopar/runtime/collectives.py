"""Collectives that generated code calls, each an autograd function.

Gradients follow the *dual placement* convention: the gradient of a Replicate
tensor is held as a Partial sum, of ``Shard(d)`` as ``Shard(d)``, of Partial as
Replicate.  Under it every local op's ordinary backward is already correct, and each
collective's backward is the collective of the dual redistribution:

============================  ========================  =========================
forward                       collective                backward
============================  ========================  =========================
P -> R                        all-reduce                all-reduce
S(d) -> R                     all-gather                reduce-scatter
P -> S(d)                     reduce-scatter            all-gather
S(a) -> S(b)                  all-to-all                all-to-all back
R -> S(d)                     local slice               zero-padded (autograd)
R -> P                        keep on coordinate 0      autograd
============================  ========================  =========================

Every function takes the mesh axis as a plain int so generated code reads well and
every rank issues the same collectives in graph order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from autopar.runtime.mesh import current
from autopar.runtime.tls import issue


def _group(axis: int) -> tuple[dist.ProcessGroup, int]:
    m = current()
    return m.group(axis), m.shape[axis]


def _all_reduce(x: torch.Tensor, axis: int) -> torch.Tensor:
    g, _ = _group(axis)
    y = x.contiguous().clone()
    issue(dist.all_reduce, y, group=g)
    return y


def _all_gather(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    g, n = _group(axis)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    issue(dist.all_gather, parts, x.contiguous(), group=g)
    return torch.cat(parts, dim=dim)


def reduce_scatter_flat(out: torch.Tensor, flat: torch.Tensor, g: dist.ProcessGroup,
                        async_op: bool = False):
    """Reduce-scatter ``flat`` over group ``g`` into ``out`` (one chunk per group rank, in
    group-rank order); the work handle where ``async_op``."""
    # torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single;
    # looked up per call, so runtime.trace's wrapper of it is seen
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return issue(fn, out, flat, group=g, async_op=async_op)


def _reduce_scatter(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    g, n = _group(axis)
    chunks = [c.contiguous() for c in x.chunk(n, dim=dim)]
    flat = torch.cat([c.reshape(-1) for c in chunks])
    out = torch.empty(chunks[0].numel(), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, flat, g)
    return out.view(chunks[0].shape)


def _all_to_all(x: torch.Tensor, gather_dim: int, scatter_dim: int, axis: int) -> torch.Tensor:
    g, n = _group(axis)
    chunks = [c.contiguous() for c in x.chunk(n, dim=scatter_dim)]
    flat = torch.cat([c.reshape(-1) for c in chunks])
    out = torch.empty_like(flat)
    issue(dist.all_to_all_single, out, flat, group=g)
    pieces = out.chunk(n)
    return torch.cat([p.view(chunks[0].shape) for p in pieces], dim=gather_dim)


class _AllReduceFn(Function):
    @staticmethod
    def forward(ctx, x, axis):  # noqa: D102
        ctx.axis = axis
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _all_reduce(g, ctx.axis), None


class _AllGatherFn(Function):
    @staticmethod
    def forward(ctx, x, dim, axis):  # noqa: D102
        ctx.dim, ctx.axis = dim, axis
        return _all_gather(x, dim, axis)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _reduce_scatter(g, ctx.dim, ctx.axis), None, None


class _ReduceScatterFn(Function):
    @staticmethod
    def forward(ctx, x, dim, axis):  # noqa: D102
        ctx.dim, ctx.axis = dim, axis
        return _reduce_scatter(x, dim, axis)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _all_gather(g, ctx.dim, ctx.axis), None, None


class _AllToAllFn(Function):
    @staticmethod
    def forward(ctx, x, gather_dim, scatter_dim, axis):  # noqa: D102
        ctx.dims, ctx.axis = (gather_dim, scatter_dim), axis
        return _all_to_all(x, gather_dim, scatter_dim, axis)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        a, b = ctx.dims
        return _all_to_all(g, b, a, ctx.axis), None, None, None


class _ScaleGradFn(Function):
    @staticmethod
    def forward(ctx, x, factor):  # noqa: D102
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return g * ctx.factor, None


def all_reduce(x: torch.Tensor, axis: int) -> torch.Tensor:
    """P -> R on ``axis``: sum over the axis' ranks."""
    return _AllReduceFn.apply(x, axis)


def all_gather(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    """S(dim) -> R on ``axis``: concatenate the axis' shards along ``dim``."""
    return _AllGatherFn.apply(x, dim, axis)


def reduce_scatter(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    """P -> S(dim) on ``axis``: sum, keep this rank's chunk along ``dim``."""
    return _ReduceScatterFn.apply(x, dim, axis)


def all_to_all(x: torch.Tensor, gather_dim: int, scatter_dim: int, axis: int) -> torch.Tensor:
    """S(gather_dim) -> S(scatter_dim) on ``axis`` with one all-to-all."""
    return _AllToAllFn.apply(x, gather_dim, scatter_dim, axis)


def local_slice(x: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
    """R -> S(dim) on ``axis``: keep this rank's chunk (no communication)."""
    m = current()
    n = m.shape[axis]
    size = x.shape[dim] // n
    return x.narrow(dim, m.coord[axis] * size, size)


def to_partial(x: torch.Tensor, axis: int) -> torch.Tensor:
    """R -> P on ``axis``: coordinate 0 keeps the value, the others hold zeros, so the
    pending sum equals the value (used e.g. for a bias added after a Partial matmul)."""
    return x if current().coord[axis] == 0 else x * 0


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward; backward multiplies by ``factor``.

    The loss is replicated on ``n`` ranks and each seeds its backward with 1; under the
    dual convention those seeds must sum to 1, hence ``factor = 1/n``.
    """
    return _ScaleGradFn.apply(x, factor)


def all_reduce_nograd(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """Sum a non-differentiable value (e.g. a token count) over several mesh axes."""
    return all_reduce_nograd_async(x, axes)()


def all_reduce_nograd_async(x: torch.Tensor, axes: tuple[int, ...]):
    """Start summing a non-differentiable value over ``axes``; returns a function that
    waits and gives the sum, so the latency hides behind the work done meanwhile (the
    cross-entropy's token count behind its log-softmax).  Several axes are summed by one
    all-reduce over the group spanning them (a second, blocking one per extra axis
    would be one more latency on the step's path than DDP pays)."""
    y = x.detach().clone()
    if not axes:
        return lambda: y
    work = issue(dist.all_reduce, y, group=current().group_of(tuple(axes)), async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return y

    return wait
