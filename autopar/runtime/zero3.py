"""ZeRO-3 parameter gathers, one collective per layer, prefetched.

Each parameter keeps its own shard (this rank's dim-0 rows of its local tensor, in a
flat padded buffer: :mod:`autopar.runtime.zero_layout`), but the parameters of one
layer form a *group* gathered together: their shards are concatenated into one send
buffer, one ``all_gather_into_tensor`` brings every rank's buffer, and each whole
parameter is cut out of it (FSDP2's copy-in / copy-out).  The group's backward
reduce-scatters all of its gradients in one collective, laid out rank-major so each
rank receives exactly its shards.

Prefetch: while a group is gathered in the forward, the next group's gather is launched
asynchronously, so it overlaps the current layer's compute; the next forward use waits
for it.  Memory: at most two layers' whole parameters are alive at once in the forward,
besides the kept layers' (below).

Backward: tensors saved from a gathered parameter are dropped (``saved_tensors_hooks``)
and re-gathered when backward unpacks them, again one collective for the whole group,
kept until the group's own backward (its reduce-scatter) has run, while the previous
group's re-gather is prefetched.  Autograd runs the same nodes in the same order on
every rank, so every rank issues the same collectives in the same order.

A *kept* group (``Group.keep``: FSDP2's ``reshard_after_forward=False``, chosen by the
planner per layer where memory allows) is not dropped: autograd holds its whole
parameters from its forward to its backward, which re-gathers nothing; when its
gradients are done (its backward, before the reduce-scatter), the re-gather of the
nearest group before it that is not kept is launched ahead, as an unpacked group's
is.  Leftovers of a backward that stopped early (a prefetch never used) are dropped
when the next forward begins, so no forward reads parameters from before a step.

Under accumulation the plan may reduce once a step (``Decisions.zero_reduce_once``):
while the pipeline runner keeps gradient sync off (every micro-batch's backward but the
last), a group's backward adds its whole gradients into a buffer of its own and gives
its shards none; the last micro-batch's backward adds the buffer in and
reduce-scatters the sum, one collective per layer a step instead of one per
micro-batch.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd import Function

from autopar.runtime.collectives import reduce_scatter_flat
from autopar.runtime.mesh import current
from autopar.runtime.tls import issue
from autopar.runtime.zero_layout import Cut, pack, unpack


@dataclass
class Group:
    """The parameters of one layer under ZeRO-3 (forward order), and its neighbours."""

    key: str
    shards: list[torch.Tensor]  # the flat padded buffers the gathers send
    cuts: list[Cut]
    axes: tuple[int, ...]  # the ZeRO axes (one group spanning them)
    next: str | None = None  # the group whose forward use comes next
    prev: str | None = None  # the one before: needed next in backward
    keep: bool = False  # whole parameters held from forward to backward (no re-gather)
    views: list[torch.Tensor] = field(default_factory=list)
    """The parameters (this rank's rows, viewing ``shards``): their gradients' shapes."""


_GROUPS: dict[str, Group] = {}
# group key -> (async work, output buffer) of a gather launched ahead of its use
_AHEAD: dict[str, tuple[object, torch.Tensor]] = {}
# group key -> whole parameters re-gathered for backward (kept until its reduce-scatter)
_BACKWARD: dict[str, list[torch.Tensor]] = {}
# storage address -> (weak storage owner, group key, index) for the pack hook
_GATHERED: dict[int, tuple[weakref.ref, str, int]] = {}
# groups whose backward accumulates whole gradients instead of reduce-scattering them,
# and what they have accumulated this step
_DEFER: set[str] = set()
_ACC: dict[str, list[torch.Tensor | None]] = {}


def defer(keys: list[str], on: bool) -> None:
    """Make the backward of groups ``keys`` accumulate their whole gradients (``on``) or
    reduce-scatter them with what was accumulated (off).  Turning it on anew starts a
    step: what an earlier, interrupted step accumulated is dropped."""
    for key in keys:
        if on and key not in _DEFER:
            _ACC.pop(key, None)
            _DEFER.add(key)
        elif not on:
            _DEFER.discard(key)


def register(group: Group) -> None:
    """Make ``group`` known to the generated code's :func:`zero_gather` calls."""
    _GROUPS[group.key] = group


def launch_gather(shards: list[torch.Tensor], axes: tuple[int, ...], async_op: bool):
    """All-gather the concatenated ``shards`` over ``axes`` (copied up first when they
    live in host memory: ``offload="params"``): (work, rank-major buffer, rank ``r``'s
    shards first).  ZeRO-3's layer gathers and ZeRO-1/2's (:mod:`autopar.runtime.zero`,
    :mod:`autopar.runtime.zero_chunks`) both send this way."""
    m = current()
    send = torch.cat([s.detach().reshape(-1) for s in shards])
    if send.device != m.device:
        send = send.to(m.device, non_blocking=True)
    out = torch.empty(send.numel() * m.size_of(axes), dtype=send.dtype, device=send.device)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return issue(fn, out, send, group=m.group_of(axes), async_op=async_op), out


def _launch(g: Group, async_op: bool):
    return launch_gather(g.shards, g.axes, async_op)


def _split(g: Group, out: torch.Tensor) -> list[torch.Tensor]:
    """Whole parameters from the gathered buffer (rank-major: rank r's shards first)."""
    return unpack(out, current().size_of(g.axes), g.cuts)


def _gather(key: str, ahead: bool) -> list[torch.Tensor]:
    """The group's whole parameters: from a prefetched gather when one is waiting, else
    gathered now; then (``ahead``) the next group's gather is launched."""
    g = _GROUPS[key]
    pending = _AHEAD.pop(key, None)
    if pending is not None:
        pending[0].wait()
        out = pending[1]
    else:
        out = _launch(g, async_op=False)[1]
    nxt = g.next if ahead else None
    if nxt is not None and nxt not in _AHEAD:
        _AHEAD[nxt] = _launch(_GROUPS[nxt], async_op=True)
    return _split(g, out)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _GatherGroup(Function):
    """Shards of a group -> whole parameters (one all-gather); backward: one
    reduce-scatter of all their gradients."""

    @staticmethod
    def forward(ctx, key: str, *shards: torch.Tensor):
        # prefetch only in a real forward: a recomputation inside backward gathers one
        # layer, and a launched gather of another would wait for a use that never comes
        fulls = _gather(key, ahead=not _in_backward())
        ctx.key = key
        if _GROUPS[key].keep:
            return tuple(fulls)  # saved as they are: autograd keeps them to the backward
        for i, f in enumerate(fulls):
            # the tensor owning the storage: saved views (a transposed weight) point to it
            root = f if f._base is None else f._base
            _GATHERED[f.untyped_storage().data_ptr()] = (weakref.ref(root), key, i)
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        g = _GROUPS[ctx.key]
        if g.keep:  # nothing was unpacked: launch the next re-gather from here
            _prefetch_before(ctx.key)
        _BACKWARD.pop(ctx.key, None)  # this group's re-gathered parameters are done with
        stale = _AHEAD.pop(ctx.key, None)  # a re-gather prefetched but never unpacked
        if stale is not None:
            stale[0].wait()
        if ctx.key in _DEFER:  # an earlier micro-batch: keep the sum, reduce it later
            acc = _ACC.setdefault(ctx.key, [None] * len(grads))
            for i, gr in enumerate(grads):
                if gr is not None:
                    acc[i] = gr.clone() if acc[i] is None else acc[i].add_(gr)
            return (None,) * (1 + len(grads))
        acc = _ACC.pop(ctx.key, None)
        if acc is not None:
            grads = tuple(a if gr is None else gr if a is None else a.add_(gr) for gr, a in zip(grads, acc))
        m = current()
        d = m.size_of(g.axes)
        like = g.shards[0] if g.shards[0].device == m.device else \
            torch.empty(0, dtype=g.shards[0].dtype, device=m.device)
        send = pack(list(grads), g.cuts, d, like)
        out = torch.empty(send.numel() // d, dtype=send.dtype, device=send.device)
        reduce_scatter_flat(out, send, m.group_of(g.axes))
        if g.shards[0].device != out.device:  # host shards: their gradients go down
            out = out.to(g.shards[0].device)
        # each parameter's gradient: its real rows, in its shape (a view of ``out``)
        parts = out.split([c.size for c in g.cuts])
        return (None, *(p[: v.numel()].view(v.shape) for p, v in zip(parts, g.views)))


def _regathered_before(key: str) -> str | None:
    """The nearest group before ``key`` (backward's next) whose parameters backward
    re-gathers: kept groups are skipped, their parameters are still whole."""
    prev = _GROUPS[key].prev
    while prev is not None and _GROUPS[prev].keep:
        prev = _GROUPS[prev].prev
    return prev


def _prefetch_before(key: str) -> None:
    """Launch the re-gather of the group backward needs after ``key``, unless it is in
    flight or done; every rank runs the same backward, so issues it at the same point."""
    prev = _regathered_before(key)
    if prev is not None and prev not in _AHEAD and prev not in _BACKWARD:
        _AHEAD[prev] = _launch(_GROUPS[prev], async_op=True)


@torch.fx.wrap
def zero_gather(key: str, *shards: torch.Tensor):
    """Generated code's call for a ZeRO-3 group: its whole parameters, as a tuple."""
    return _GatherGroup.apply(key, *shards)


@dataclass
class _Handle:
    """A saved tensor that lived in a gathered parameter: re-gathered on unpack."""

    key: str
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _pack(t: torch.Tensor):
    if not _GATHERED or t.layout != torch.strided:
        return t
    hit = _GATHERED.get(t.untyped_storage().data_ptr())
    root = hit[0]() if hit is not None else None
    if root is None or not (t is root or t._base is root):
        return t
    return _Handle(hit[1], hit[2], t.size(), t.stride(), t.storage_offset())


def _unpack(h):
    if not isinstance(h, _Handle):
        return h
    fulls = _BACKWARD.get(h.key)
    if fulls is None:
        fulls = _BACKWARD[h.key] = _gather(h.key, ahead=False)
        _prefetch_before(h.key)
    return fulls[h.index].as_strided(h.size, h.stride, h.offset)


@contextlib.contextmanager
def free_gathered_params():
    """Context for a forward: tensors saved from gathered parameters are dropped and
    re-gathered in backward; a prefetch the forward did not use (it stopped early) is
    completed and dropped, and so is, on entry, what a backward that stopped early left
    (``autograd.grad`` with ``inputs=``, an error), so no forward reads parameters from
    before a step."""
    _drop_ahead()
    _BACKWARD.clear()
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _GATHERED.clear()
        _drop_ahead()


def _drop_ahead() -> None:
    """Complete every gather launched ahead and drop its result."""
    for key in [k for k in _AHEAD]:
        work, _ = _AHEAD.pop(key)
        work.wait()


__all__ = ["Group", "defer", "free_gathered_params", "launch_gather", "register", "zero_gather"]
