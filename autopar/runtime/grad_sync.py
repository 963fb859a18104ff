"""Data-parallel gradient synchronisation with bucketing.

A parameter replicated on some mesh axes has a Partial gradient there (dual
placement convention), so its gradient is all-reduced (summed) over exactly those
axes.  Gradients are fused into buckets (seed idea: tensor fusion) of parameters that
share the same axes; a bucket is launched asynchronously as soon as all its gradients
are ready, but buckets launch strictly in bucket order, so every rank issues the same
collectives in the same order and the reduction overlaps the rest of backward.

As DDP's ``gradient_as_bucket_view``, a gradient is copied into its bucket's flat buffer
as soon as it is ready and ``.grad`` becomes a view of it: the reduction runs in place,
nothing is copied back, and the step holds one copy of the gradients (copying them into
a bucket at launch and back after the reduction held two until the end of backward).

As DDP's buckets, the buffers outlive the step where the plan's memory allows
(:attr:`autopar.plans.Decisions.grad_buffers_kept`): the next backward fills the same
ones (a fresh 11 MB buffer and 69 views a step cost a 4-layer GPT's data parallel
about 1.5 ms of CPU per rank against DDP).  A buffer is reused only
when nothing but the runtime holds it: a ``.grad`` kept from an earlier step
(``old = p.grad`` before ``zero_grad()``), a view or ``to_local()`` of one, keeps its
values and that bucket takes a new buffer (:meth:`GradSync._reusable`).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.compression import Bf16Pending, Bf16Sum, PowerSgd
from autopar.runtime.mesh import current
from autopar.runtime.tls import issue

T = TypeVar("T")

def _grad_reference() -> int:
    """Python references a tensor gains by being a parameter's ``.grad``: 1 on torch
    2.13 (a C++ owner makes the tensor hold its Python object), 0 on torches before
    that; probed, so :meth:`GradSync._reusable` counts right on either."""
    p, g = nn.Parameter(torch.zeros(1)), torch.zeros(1)
    before = sys.getrefcount(g)
    p.grad = g
    return sys.getrefcount(g) - before


_GRAD_REF = _grad_reference()

BUCKET_BYTES = 4 << 20
"""Bucket size where no plan chose the buckets (gradients without a planned bucket,
ZeRO-1/2's reduction)."""


def _fills(sizes: Iterable[float], cap: int) -> Iterator[tuple[int, float]]:
    """(where each bucket ends, its bytes) for ``sizes`` in launch order: a bucket closes
    as soon as its bytes reach ``cap``; the rule of :func:`fill_buckets` and :func:`fill_sums`."""
    size, start, end = 0, 0, 0
    for end, x in enumerate(sizes, 1):
        size += x
        if size >= cap:
            yield end, size
            size, start = 0, end
    if end > start:
        yield end, size


def fill_buckets(items: Iterable[T], nbytes: Callable[[T], int], cap: int = BUCKET_BYTES) -> list[list[T]]:
    """``items`` (in launch order: back to front) cut into consecutive buckets, each
    closed as soon as its bytes reach ``cap``; the rule :class:`GradSync`,
    ``runtime/zero.py`` and ``plan.collectives()`` share."""
    items = list(items)
    out, start = [], 0
    for end, _ in _fills(map(nbytes, items), cap):
        out.append(items[start:end])
        start = end
    return out


def fill_sums(sizes: Iterable[float], cap: int = BUCKET_BYTES) -> list[float]:
    """The bytes of each bucket :func:`fill_buckets` cuts ``sizes`` into (summed in the
    same order), without building the buckets: the split search asks for them for
    every stage range it prices."""
    return [size for _, size in _fills(sizes, cap)]


def runs_by_axes(items: Iterable[T], axes_of: Callable[[T], tuple[int, ...]]) -> list[tuple[tuple[int, ...], list[T]]]:
    """``items`` grouped by their (non-empty) ``axes_of``, the groups in order of first
    appearance and the items in order within each: a planned bucket mixing axes is split
    so (:class:`GradSync`), and ZeRO-1/2 reduces a bucket's part over the parameters'
    other replicated axes with one all-reduce per such group (it issued one per
    parameter: 69 blocking all-reduces a step for a 4-layer GPT under HSDP); the runtime
    and ``plan.collectives()`` share the rule."""
    runs: dict[tuple[int, ...], list[T]] = {}
    for it in items:
        axes = axes_of(it)
        if axes:
            runs.setdefault(axes, []).append(it)
    return list(runs.items())


def folded_axes(others: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The other replicated axes a ZeRO-1 bucket's all-reduce spans besides the ZeRO
    axes: those every parameter in the bucket shares (empty when they differ or there
    are none; the bucket's part is then reduced over each set apart, :func:`runs_by_axes`)."""
    first = others[0] if others else ()
    return first if all(o == first for o in others) else ()


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together over ``axes``."""

    params: list[nn.Parameter]
    axes: tuple[int, ...]
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object = None
    launched: bool = False
    offsets: list[int] = field(default_factory=list)
    """Start of each parameter's gradient in ``flat``."""
    dtype: torch.dtype | None = None
    """``flat``'s type: the one its gradients promote to."""
    own: set[int] = field(default_factory=set)
    """Indices of the parameters whose ``.grad`` kept its own tensor (another layout or
    type): the reduced values are copied back into those after the reduction."""
    fresh: set[int] = field(default_factory=set)
    """Indices whose gradient a hook already put in ``flat`` in this reducing backward:
    the launch fills only the others (it filled every one again, a view and a pointer
    check per parameter on the hot path)."""

    views: list[torch.Tensor] = field(default_factory=list)
    """Each parameter's slot in ``flat``, shaped like it (made with ``flat``)."""
    kept: bool = False
    """``flat`` is an earlier backward's, not yet checked for other holders in this one
    (:meth:`GradSync._reusable`)."""
    reduced: bool = False
    """The gradients hold sums already reduced over ``axes`` (a reducing backward ended
    and no backward since): :meth:`GradSync.restart` divides them before another adds."""
    ranks: int = 1
    """How many ranks the reduction sums over (set at the first launch)."""

    def __post_init__(self) -> None:
        """Lay the gradients out back to back, in ``params`` order."""
        off = 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.dtype = functools.reduce(torch.promote_types, (p.dtype for p in self.params))

    def allocate(self, device: torch.device) -> None:
        """Make ``flat`` and every parameter's view of it, at once (not a method call
        per gradient in the hooks)."""
        self.flat = torch.empty(self.offsets[-1] + self.params[-1].numel(), dtype=self.dtype,
                                device=device)
        self.views = [self._narrow(i) for i in range(len(self.params))]

    def _narrow(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat.narrow(0, self.offsets[i], p.numel()).view(p.shape)

    def renew(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot in ``flat`` as a new view, kept in :attr:`views`.  A
        backward that builds its graph (``create_graph=True``, grad mode on) copies
        gradients that require grad into the slots, which makes ``flat`` a non-leaf:
        a view taken before that refuses the next in-place copy, so such a backward
        takes each slot's view anew, as it is filled."""
        self.views[i] = v = self._narrow(i)
        return v

    def view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient slot in ``flat``, shaped like the parameter."""
        return self.views[i]


class OrderedBuckets:
    """Launch gradient buckets strictly in bucket order as they fill, and finish the
    rest at the end of backward: every rank issues the same collectives in the same
    order while the reduction overlaps the rest of backward.  Subclasses keep
    ``_order`` (the buckets, each with ``ready`` and ``params``), an ``enabled`` switch,
    and implement ``_launch(bucket)`` and ``_complete()``."""

    _order: list
    enabled: bool

    def _start_order(self, buckets: list) -> None:
        self._order = buckets
        self._next = 0
        self._armed = False

    def _ready(self, bucket) -> None:
        """One more gradient of ``bucket`` is ready (call from a post-accumulate hook)."""
        if not self.enabled:
            return
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket.ready += 1
        while self._next < len(self._order) and \
                self._order[self._next].ready == len(self._order[self._next].params):
            self._launch(self._order[self._next])
            self._next += 1

    def _finish(self) -> None:
        while self._next < len(self._order):
            self._launch(self._order[self._next])
            self._next += 1
        self._complete()
        self._next = 0
        self._armed = False

    def flush(self) -> None:
        """Reduce every bucket now, from the gradients as they are (a backward that
        ran with the hooks off: the zero-bubble schedule's ``W`` writes ``.grad``
        without hooks).  Not in grad mode: the fills then take the kept views, as a
        backward's do (grad mode is how they spot a backward building its graph)."""
        with torch.no_grad():
            self._finish()

    def _launch(self, bucket) -> None:
        raise NotImplementedError

    def _complete(self) -> None:
        raise NotImplementedError


class GradSync(OrderedBuckets):
    """Hooks that all-reduce replicated parameters' gradients after backward."""

    def __init__(self, params: list[tuple[str, nn.Parameter, tuple[int, ...]]],
                 planned: list[list[str]] | None = None, bucket_bytes: int = BUCKET_BYTES,
                 keep: bool = True, compression: str = "none", rank: int = 0) -> None:
        """``params``: (name, parameter, axes it is replicated on), in forward order.
        ``planned``: the plan's buckets (parameter names in launch order,
        :attr:`autopar.plans.Decisions.grad_buckets`); names not on this rank are
        skipped, a bucket mixing axes is split by axes.  Parameters in no planned
        bucket (a plan made before buckets were planned, ZeRO-3 shards reduced over
        their other axes) follow in ``bucket_bytes`` buckets, back to front.  ``keep``:
        the buffers serve every step (:attr:`autopar.plans.Decisions.grad_buffers_kept`;
        else each backward takes new ones, freed with the gradients).  ``compression``:
        ``"bf16"`` or ``"powersgd"`` (at ``rank``) reduce the buckets compressed
        (:mod:`autopar.runtime.compression`, :attr:`autopar.plans.Decisions.grad_compression`)."""
        self.keep = keep
        self.compression = compression
        self._powersgd = None
        if compression == "powersgd":
            self._powersgd = PowerSgd(rank)
        self.buckets: list[Bucket] = []
        self.enabled = True
        by_name = {n: (p, axes) for n, p, axes in params if axes}
        placed: set[str] = set()
        for names in planned or []:
            mine = [n for n in dict.fromkeys(names) if n in by_name and n not in placed]
            placed.update(mine)
            self.buckets.extend(Bucket([by_name[n][0] for n in run], axes)
                                for axes, run in runs_by_axes(mine, lambda n: by_name[n][1]))
        groups: dict[tuple[int, ...], list[nn.Parameter]] = {}
        # reverse forward order: gradients become ready roughly back to front
        for n, p, axes in reversed(params):
            if axes and n not in placed:
                groups.setdefault(axes, []).append(p)
        for axes, ps in groups.items():
            self.buckets.extend(Bucket(b, axes) for b in
                                fill_buckets(ps, lambda p: p.numel() * p.element_size(), bucket_bytes))
        # (bucket, index) per parameter: the hook's one lookup
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._index = {id(b): k for k, b in enumerate(self.buckets)}  # PowerSGD's state key
        self._start_order(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook)
                         for b in self.buckets for p in b.params]
        self._touched = False  # a hook ran since the last restart (_undo_unless_touched)
        self.holders: Callable[[nn.Parameter, torch.Tensor], int] = lambda p, v: 0
        """How many references to ``v`` (``p``'s gradient slot) the runtime holds
        besides the bucket and ``p.grad``: the DTensor gradient a
        :class:`~autopar.runtime.dparams.DParams` keeps for the next step."""

    def _hook(self, p: nn.Parameter) -> None:
        # one Python call per gradient on the backward's path (69 a step for a 4-layer
        # GPT): kept to a lookup, the copy and the counting
        b, i = self._slot[id(p)]
        self._touched = True
        # also while disabled (accumulation, pipeline micro-batches): the gradient then
        # accumulates in place in its bucket, and the last backward copies nothing
        self._fill(b, i, p)
        if self.enabled:
            b.fresh.add(i)
        self._ready(b)

    def _fill(self, b: Bucket, i: int, p: nn.Parameter) -> None:
        """Put ``p``'s (parameter ``i`` of ``b``) gradient in ``b.flat`` (zeros when it
        has none) and make ``.grad`` a view of it when the layouts agree (the reduction
        then lands in it)."""
        if b.kept:  # the first gradient of this backward in an earlier step's buffer
            b.kept = False
            if not self._reusable(b):
                b.flat = None
        if b.flat is None:
            b.allocate(p.device)
        # the engine runs a backward in grad mode only when it builds its graph
        view = b.renew(i) if torch.is_grad_enabled() else b.views[i]
        g = p.grad
        if g is view:  # accumulated in place into its slot
            return
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.dtype != view.dtype:
            view.copy_(g)
            if g.dtype == view.dtype and g.layout == torch.strided and p.is_contiguous():
                p.grad = view
                b.own.discard(i)
            else:
                b.own.add(i)

    def _launch(self, b: Bucket) -> None:
        for i, p in enumerate(b.params):
            if i not in b.fresh:  # not ready (no gradient this backward, or no hooks ran)
                self._fill(b, i, p)
        m = current()
        b.ranks = math.prod(m.shape[a] for a in b.axes)
        group = m.group_of(b.axes)
        if self.compression == "bf16" and b.ranks > 1:
            b.work = Bf16Sum.launch(b.flat, b.ranks, group)
        elif self._powersgd is not None and b.ranks > 1:
            self._powersgd.reduce(b.flat, b.views, self._index[id(b)], b.ranks, group)
            b.work = None
        else:
            # every replicated axis at once, asynchronously (one group spanning them)
            b.work = issue(dist.all_reduce, b.flat, group=group, async_op=True)
        b.launched = True

    def _complete(self) -> None:
        # bf16: every bucket's sums gathered in bucket order, on every rank alike
        gathers = {id(b): Bf16Sum.gather(b.work) for b in self.buckets
                   if isinstance(b.work, Bf16Pending)}
        for b in self.buckets:
            if id(b) in gathers:
                Bf16Sum.finish(b.flat, *gathers[id(b)])
            elif b.work is not None:
                b.work.wait()
            for i in b.own:  # the others are views: the reduction landed in them
                if b.params[i].grad is not None:
                    b.params[i].grad.copy_(b.view(i))
            b.ready, b.work, b.launched, b.own, b.fresh = 0, None, False, set(), set()
            if not self.keep or b.flat is not None and b.flat.requires_grad:
                # the views keep the buffer alive until zero_grad(set_to_none=True);
                # a backward that built its graph (create_graph=True) left it a
                # non-leaf of that graph: the next backward takes a new one
                b.flat, b.views = None, []
            b.kept = b.flat is not None
            b.reduced = True

    def watch(self, outs: Sequence, dparams=None) -> Sequence:
        """The forward's flat outputs, each that requires grad hooked so that a
        backward through it first mirrors a ``zero_grad()`` made after the forward
        (``out = pm(x); opt.zero_grad(); out.backward()``: ``dparams``'
        ``before_forward``) and calls :meth:`restart`."""
        first = dparams.before_forward if dparams is not None else None
        if torch.is_grad_enabled() and (self.buckets or first is not None):
            hook = functools.partial(self._backward_starts, first)
            for o in outs:
                if isinstance(o, torch.Tensor) and o.requires_grad:
                    o.register_hook(hook)
        return outs

    def _backward_starts(self, first: Callable[[], None] | None, _grad: torch.Tensor) -> None:
        if first is not None:
            first()
        divided = self.restart()
        if divided:
            # a backward that accumulates into no .grad (autograd.grad, backward(inputs=)
            # of other tensors) runs no hook and reduces nothing: undo the division
            self._touched = False
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._undo_unless_touched, divided))

    def _undo_unless_touched(self, divided: list[Bucket]) -> None:
        if self._touched:
            return
        for b in divided:
            b.reduced = True
            for p in b.params:
                if p.grad is not None:
                    p.grad.mul_(b.ranks)

    def restart(self) -> list[Bucket]:
        """Before a backward that adds to the gradients a reducing backward left (a loop
        that accumulates over several ``backward()`` calls without ``zero_grad()``):
        divide them by the ranks the reduction sums over.  They are equal on every
        rank, so this backward's sum counts them once; they were counted once per rank
        (the second backward's gradients came out ``ranks`` times too large).  Exact
        for a power-of-two rank count, a rounding otherwise.  Returns the buckets
        divided."""
        divided = []
        for b in self.buckets:
            if not b.reduced:
                continue
            b.reduced = False
            if b.ranks > 1:
                divided.append(b)
                for p in b.params:
                    if p.grad is not None:
                        p.grad.div_(b.ranks)
        return divided

    def _reusable(self, b: Bucket) -> bool:
        """Whether ``b``'s buffer from an earlier backward may take this one's gradients:
        only the bucket, its views, the parameters' ``.grad`` and the holders
        :attr:`holders` names refer to it.  Anything else (a gradient the user kept
        across ``zero_grad()``, a view or ``to_local()`` of one) would see its values
        overwritten, so the bucket then takes a new buffer and leaves the old one to
        them."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:  # a private counter; without it, never reuse
            return False
        # the buffer, each view, and the temporary storage object asked
        if use_count(b.flat.untyped_storage()._cdata) != 2 + len(b.views):
            return False
        views = b.views
        for i, p in enumerate(b.params):
            # the list of views and getrefcount's argument (no loop variable holds the
            # view), .grad, the named holders
            known = 2 + _GRAD_REF * (p.grad is views[i]) + self.holders(p, views[i])
            if sys.getrefcount(views[i]) != known:
                return False
        return True
