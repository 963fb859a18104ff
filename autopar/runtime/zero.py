"""Optimizer (ZeRO) parallelism over mesh axes, with the user's own ``torch.optim``.

A parameter replicated on the ZeRO axes ``z`` (one or several: ``d`` ranks in all,
one group spanning them) gets a *shard*: an ``nn.Parameter`` holding this rank's rows
of its local tensor (dim 0, as FSDP2 cuts: :mod:`autopar.runtime.zero_layout`), a view
of a flat padded buffer the collectives move.  ``ParallelModule.parameters()`` yields
them as DTensors of the parameter's own shape (``Shard(0)`` on the ZeRO axes), so any
optimizer keeps state for its shard only and sees the parameter's shape.

=========  ==========================  =================================  ==================
stage      whole parameter             gradient                           after the step
=========  ==========================  =================================  ==================
1          kept (non-Parameter)        all-reduced over ``z``, sliced     all-gathered
2          kept (non-Parameter)        reduce-scattered over ``z``        all-gathered
3          gathered before each use,   reduce-scattered (backward of the  nothing: only the
           freed after, re-gathered    gather)                            shard exists
           in backward
=========  ==========================  =================================  ==================

Gradients are Partial on every replicated axis (dual-placement convention), so they
are reduced over ``z`` as above and all-reduced over the other replicated axes.
Stages 1 and 2 reduce in fixed-order buckets launched asynchronously as gradients
become ready (like :mod:`autopar.runtime.grad_sync`); the all-gather after the
optimizer step runs lazily at the next forward, when a shard's version counter or the
process's count of optimizer steps shows that it may have changed.  Every rank steps the same shards, so every rank takes
the same decision and issues the same collectives.

Stage 3 frees gathered parameters: a ``saved_tensors_hooks`` pair replaces any tensor
saved for backward that lives in a gathered parameter's storage by a handle, and
re-gathers it when backward unpacks it (autograd unpacks in the same order on every
rank, so the re-gathers line up).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from autopar.runtime.collectives import reduce_scatter_flat
from autopar.runtime.grad_sync import (
    BUCKET_BYTES,
    OrderedBuckets,
    fill_buckets,
    folded_axes,
    runs_by_axes,
)
from autopar.runtime.mesh import current
from autopar.runtime.tls import issue

# stage 3 lives in autopar.runtime.zero3 (one gather per layer, prefetched)
from autopar.runtime.zero3 import (
    Group,
    launch_gather,
    register,
    zero_gather,
)
from autopar.runtime.zero_chunks import Chunks, copy_out, new_key, replace_reads, zero_fetch
from autopar.runtime.zero_chunks import register as register_chunks
from autopar.runtime.zero_layout import Cut, pack, unpack


def _all_gather_flat(shard: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """Concatenate every rank's ``shard`` over the ZeRO axes, rank order."""
    m = current()
    out = torch.empty(shard.numel() * m.size_of(axes), dtype=shard.dtype, device=shard.device)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    issue(fn, out, shard.contiguous(), group=m.group_of(axes))
    return out


def _reduce_other_axes(mine: torch.Tensor, params: list[ZeroParam]) -> None:
    """Sum ``mine`` (this rank's part of a bucket: each parameter's shard gradient, back
    to back in ``params`` order) over the parameters' other replicated axes, in place:
    one all-reduce over a group spanning those axes per distinct set of them
    (:func:`~autopar.runtime.grad_sync.runs_by_axes`), in place when one set covers the
    whole bucket (HSDP: every parameter replicated on the same other axes)."""
    m = current()
    offsets = list(itertools.accumulate((zp.cut.size for zp in params), initial=0))
    runs = runs_by_axes(range(len(params)), lambda i: params[i].other_axes)
    for axes, idx in runs:
        group = m.group_of(axes)
        if len(idx) == len(params):
            issue(dist.all_reduce, mine, group=group)
            continue
        parts = [mine[offsets[i]:offsets[i + 1]] for i in idx]
        flat = torch.cat(parts)
        issue(dist.all_reduce, flat, group=group)
        for part, red in zip(parts, flat.split([p.numel() for p in parts])):
            part.copy_(red)


_GROUP_IDS = itertools.count()


# ---------------------------------------------------------------- bookkeeping
# Optimizer steps taken in this process.  Users step DTensor views of the shards
# (autopar.runtime.dparams), and in-place ops dispatched through DTensor do not bump
# the shard's version counter, so the lazy all-gather also watches optimizer steps.
_STEPS = [0]


def _count_step(*_args) -> None:
    _STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


@dataclass
class ZeroParam:
    """One parameter under ZeRO: its graph target, layout, flat padded buffer and shard
    (this rank's rows, a view of ``flat``)."""

    target: str
    cut: Cut
    flat: torch.Tensor
    shard: nn.Parameter
    other_axes: tuple[int, ...]
    full: torch.Tensor | None = None  # stages 1 and 2

    @property
    def shape(self) -> torch.Size:
        """The local whole parameter's shape."""
        return self.cut.shape

    @property
    def numel(self) -> int:
        """Elements of the local whole parameter."""
        return math.prod(self.shape)


@dataclass
class _Bucket:
    params: list[ZeroParam]
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object = None
    folded: tuple[int, ...] = ()
    """Stage 1: the other replicated axes every parameter shares, reduced together with
    the ZeRO axes in the bucket's one all-reduce (:func:`~autopar.runtime.grad_sync.folded_axes`)."""


def shard_name(target: str) -> str:
    """Attribute name of a parameter's ZeRO shard on the generated module."""
    return "zshard_" + target.replace(".", "_")


def _owner(root: nn.Module, target: str) -> tuple[nn.Module, str]:
    *path, leaf = target.split(".")
    return (root.get_submodule(".".join(path)) if path else root), leaf


@dataclass
class Zero(OrderedBuckets):
    """ZeRO state of one ParallelModule (see the module docstring)."""

    stage: int
    axes: tuple[int, ...]
    params: list[ZeroParam] = field(default_factory=list)
    bucket_bytes: int = BUCKET_BYTES
    enabled: bool = True

    def __post_init__(self) -> None:
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._start_order(self._buckets)
        self._done = 0  # buckets of this backward already finished (_launch)
        self._versions: list[int] = []
        self._steps = _STEPS[0]
        self._by_target = {zp.target: zp for zp in self.params}
        self.group_keys: list[str] = []  # stage 3: the groups _rewrite_gathers registered
        self.chunks: Chunks | None = None  # stages 1-2: the gathers after the step in chunks
        # stages 1-2: what the refresh gathers before the forward (every parameter
        # without chunks), in 4 MiB buckets
        self._whole: list[list[ZeroParam]] = [b.params for b in self._buckets]

    # ------------------------------------------------------------ set-up
    @classmethod
    def install(cls, gm: fx.GraphModule, params: list[tuple[str, tuple[int, ...]]], stage: int,
                axes: tuple[int, ...], layers: dict[str, str] | None = None,
                kept: frozenset[str] = frozenset(), chunks: list[list[str]] | None = None) -> Zero:
        """Move ``params`` (graph target, other replicated axes), in forward order, under
        ZeRO on ``gm``: register shards, demote (stages 1-2) or remove (stage 3) the
        whole parameters and, for stage 3, gather each layer's parameters (``layers``:
        target -> layer key; a target without one is its own group) before their first
        use; the layers in ``kept`` hold theirs from forward to backward
        (:attr:`autopar.plans.Decisions.zero_kept`); stages 1-2 gather ``chunks`` (targets,
        forward order: :attr:`autopar.plans.Decisions.gather_chunks`) one by one in the
        forward."""
        m = current()
        r = m.coord_of(axes)
        sizes = [m.shape[a] for a in sorted(axes)]
        z = cls(stage, axes)
        for target, other in params:
            owner, leaf = _owner(gm, target)
            whole = getattr(owner, leaf).detach()
            cut = Cut.of(whole.shape, sizes)
            flat = cut.chunk(whole, r)
            # the parameter is a view of the flat buffer: the optimizer's in-place step
            # writes what the gathers send
            shard = nn.Parameter(cut.view(flat, r))
            gm.register_parameter(shard_name(target), shard)
            delattr(owner, leaf)
            zp = ZeroParam(target, cut, flat, shard, other)
            if stage < 3:
                zp.full = whole.clone().requires_grad_(True)
                owner.register_buffer(leaf, zp.full, persistent=False)
            z.params.append(zp)
        z.__post_init__()
        z._layers, z._kept = dict(layers or {}), kept
        if stage == 3:
            z._rewrite_gathers(gm, layers or {}, kept)
        else:
            z._make_buckets()
        if stage < 3 and chunks:
            z._install_chunks(gm, chunks)
        z._versions = [zp.shard._version for zp in z.params]
        return z

    def _rewrite_gathers(self, gm: fx.GraphModule, layers: dict[str, str],
                         kept: frozenset[str] = frozenset()) -> None:
        """One :func:`~autopar.runtime.zero3.zero_gather` per layer, right before the
        layer's first use of any of its parameters (so whole parameters are not all
        alive from the top of the forward); groups are chained in use order for
        prefetching."""
        members = self._members(layers)
        layer_of = {t: k for k, ts in members.items() for t in ts}
        uid = next(_GROUP_IDS)

        def call(i: int, targets: list[str], g: fx.Graph) -> fx.Node:
            return g.call_function(zero_gather, (f"zero3.{uid}.{i}", *(g.get_attr(shard_name(t)) for t in targets)))

        chain = replace_reads(gm, list(members.values()), call)
        keys = self.group_keys = [f"zero3.{uid}.{i}" for i in range(len(chain))]
        self._key_of = {tuple(ts): k for k, ts in zip(keys, chain)}
        for i, (key, targets) in enumerate(zip(keys, chain)):
            zps = [self._by_target[t] for t in targets]
            register(Group(key, [zp.flat for zp in zps], [zp.cut for zp in zps], self.axes,
                           next=keys[i + 1] if i + 1 < len(keys) else None,
                           prev=keys[i - 1] if i else None, keep=layer_of[targets[0]] in kept,
                           views=[zp.shard for zp in zps]))

    def _members(self, layers: dict[str, str]) -> dict[str, list[str]]:
        """Layer key -> its parameters' targets, in forward order (a target without a
        layer is its own group)."""
        members: dict[str, list[str]] = {}
        for zp in self.params:
            members.setdefault(layers.get(zp.target, zp.target), []).append(zp.target)
        return members

    def rewrite(self, gm: fx.GraphModule) -> None:
        """Apply this ZeRO's graph rewrites to another lowering of the same plan (the
        model at another shape: :mod:`autopar.module.shapes`): stage 3 gathers each layer
        from the same shards through the planned graph's groups (the same keys, so the
        lowerings of every shape have the same code), stages 1-2 fetch the same chunks."""
        if self.stage == 3:
            for zp in self.params:  # the graph reads the same shards
                gm.register_parameter(shard_name(zp.target), zp.shard)
            members = self._members(getattr(self, "_layers", {}))
            replace_reads(gm, list(members.values()), lambda i, ts, g: g.call_function(
                zero_gather, (self._key_of[tuple(ts)], *(g.get_attr(shard_name(t)) for t in ts))))
        elif self.chunks is not None:
            # each chunk's targets in the order zero_fetch returns its whole parameters
            target = {id(zp.full): zp.target for zp in self.params}
            replace_reads(gm, [[target[id(f)] for f in c] for c in self.chunks.fulls],
                          lambda i, ts, g: g.call_function(zero_fetch, (self.chunks.key, i)))

    def _make_buckets(self) -> None:
        d = current().size_of(self.axes)
        # reverse forward order: gradients become ready roughly back to front; a
        # bucket's bytes are its padded whole gradients (what the reduction moves)
        self._buckets.extend(_Bucket(b, folded=folded_axes([zp.other_axes for zp in b]) if self.stage == 1 else ())
                             for b in fill_buckets(
            reversed(self.params), lambda zp: zp.cut.size * zp.flat.element_size() * d,
            self.bucket_bytes))
        self._bucket_of = {id(zp.full): b for b in self._buckets for zp in b.params}
        self._whole = [b.params for b in self._buckets]
        for b in self._buckets:
            for zp in b.params:
                zp.full.register_post_accumulate_grad_hook(self._hook)

    # ------------------------------------------------------------ stages 1-2: gradients
    def _hook(self, t: torch.Tensor) -> None:
        self._ready(self._bucket_of[id(t)])

    def _rank_major(self, b: _Bucket) -> torch.Tensor:
        """Gradients of a bucket laid out so rank ``r``'s part is contiguous: for each
        rank, the ``r``-th chunk of every parameter in the bucket (zero-padded)."""
        return pack([zp.full.grad for zp in b.params], [zp.cut for zp in b.params],
                    current().size_of(self.axes), b.params[0].full)

    def _launch(self, b: _Bucket) -> None:
        # at most two buckets in flight: finishing the one before the previous here
        # bounds the flat copies of whole gradients alive at once (all of them stayed
        # until the end of backward).  Every rank finishes the same bucket at the same
        # launch, so the other axes' all-reduces keep one order across ranks.
        i = self._next  # OrderedBuckets launches self._order[self._next]
        for done in self._buckets[self._done:max(self._done, i - 1)]:
            self._complete_one(done)
        self._done = max(self._done, i - 1)
        b.flat = self._rank_major(b)
        for zp in b.params:
            zp.full.grad = None  # the bucket holds it now; stage 2 frees it here
        g = current().group_of(self.axes)
        if self.stage == 1:
            # every parameter of the bucket replicated on the same other axes (HSDP): one
            # all-reduce over all of them at once, as many bytes on the wire as the
            # ZeRO axes' all-reduce plus the part's over the others, one latency
            b.work = issue(dist.all_reduce, b.flat, async_op=True,
                           group=current().group_of(self.axes + b.folded) if b.folded else g)
        else:
            out = torch.empty(b.flat.numel() // current().size_of(self.axes), dtype=b.flat.dtype,
                              device=b.flat.device)
            b.work = reduce_scatter_flat(out, b.flat, g, async_op=True)
            b.flat = out

    def _complete_one(self, b: _Bucket) -> None:
        """Wait for ``b``'s reduction and add this rank's part to the shards' gradients
        (reduced over the parameters' other replicated axes first)."""
        m = current()
        b.work.wait()
        mine = b.flat
        if self.stage == 1:
            part, r = mine.numel() // m.size_of(self.axes), m.coord_of(self.axes)
            mine = mine[r * part:(r + 1) * part]
        if not b.folded:
            _reduce_other_axes(mine, b.params)
        off = 0
        for zp in b.params:
            c = zp.cut.size
            g = mine[off:off + zp.shard.numel()].view(zp.shard.shape).clone()
            zp.shard.grad = g if zp.shard.grad is None else zp.shard.grad + g
            off += c
        b.ready, b.flat, b.work = 0, None, None

    def _complete(self) -> None:
        for b in self._buckets[self._done:]:
            self._complete_one(b)
        self._done = 0

    # ------------------------------------------------------------ stages 1-2: parameters
    def refresh(self, lazy: bool = False) -> None:
        """All-gather updated shards into the whole parameters (stages 1-2), when the
        optimizer changed any shard since the last gather.  Under the plan's chunks
        (``lazy``: at the forward's start) only the first chunk's gather is launched;
        the graph fetches each chunk where it first reads it (:mod:`autopar.runtime.zero_chunks`)."""
        if self.stage == 3:
            return
        versions = [zp.shard._version for zp in self.params]
        if versions == self._versions and _STEPS[0] == self._steps:
            if self.chunks is not None and not lazy:
                self.chunks.settle()
            return
        d = current().size_of(self.axes)
        for b in self._whole:  # every bucket, or those no chunk holds
            gathered = launch_gather([zp.flat for zp in b], self.axes, async_op=False)[1]
            copy_out([zp.full for zp in b], [zp.cut for zp in b], gathered, d)
        if self.chunks is not None:
            self.chunks.start()
            if not lazy:
                self.chunks.settle()
        self._versions = [zp.shard._version for zp in self.params]
        self._steps = _STEPS[0]

    def invalidate(self) -> None:
        """Make the next :meth:`refresh` gather (stages 1-2): the shards were written in a
        way their version counters do not show (an in-place write through the DTensor
        parameter wrapping a shard moves only the DTensor's counter)."""
        self._versions = []

    def _install_chunks(self, gm: fx.GraphModule, chunks: list[list[str]]) -> None:
        """Gather the parameters of ``chunks`` (targets, forward order) chunk by chunk at
        their first read in the forward; the rest stay gathered before it."""
        key = new_key()
        order = replace_reads(gm, [[t for t in ts if t in self._by_target] for ts in chunks],
                              lambda i, ts, g: g.call_function(zero_fetch, (key, i)))
        zps = [[self._by_target[t] for t in ts] for ts in order]
        self.chunks = Chunks(key, self.axes, [[zp.flat for zp in c] for c in zps],
                             [[zp.cut for zp in c] for c in zps], [[zp.full for zp in c] for c in zps])
        register_chunks(self.chunks)
        held = {zp.target for c in zps for zp in c}
        rest = [zp for zp in self.params if zp.target not in held]
        d = current().size_of(self.axes)
        self._whole = fill_buckets(reversed(rest), lambda zp: zp.cut.size * zp.flat.element_size() * d,
                                   self.bucket_bytes)

    # ------------------------------------------------------------ whole tensors
    def targets(self) -> set[str]:
        """Graph targets under ZeRO."""
        return set(self._by_target)

    def local_whole(self, target: str, grad: bool = False) -> torch.Tensor | None:
        """This rank's whole (TP-local) parameter or gradient for ``target``
        (collective over the ZeRO axes: every rank must call it)."""
        zp = self._by_target[target]
        src = zp.shard.grad if grad else zp.shard.detach()
        if src is None:
            return None
        return self.whole_of(target, src)

    def whole_of(self, target: str, rows: torch.Tensor) -> torch.Tensor:
        """This rank's whole (TP-local) tensor from every rank's ``rows`` of ``target``
        (the shard itself, its gradient or its optimizer state: the shard's shape);
        collective over the ZeRO axes."""
        zp = self._by_target[target]
        d = current().size_of(self.axes)
        flat = rows.new_zeros(zp.cut.size)
        flat[: rows.numel()].copy_(rows.detach().reshape(-1))
        return unpack(_all_gather_flat(flat, self.axes), d, [zp.cut])[0].clone()

    def start_row(self, target: str) -> int:
        """This rank's first row of ``target``'s local whole."""
        zp = self._by_target[target]
        row = math.prod(zp.shape[1:])
        return zp.cut.starts[current().coord_of(self.axes)] // row if row else 0

    def chunk_of(self, target: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``target``'s whole (TP-local) tensor, in the shard's
        shape (no collective)."""
        zp = self._by_target[target]
        r = current().coord_of(self.axes)
        return zp.cut.view(zp.cut.chunk(whole, r), r)

    def load_whole(self, target: str, whole: torch.Tensor) -> None:
        """Set ``target`` from this rank's whole (TP-local) tensor."""
        zp = self._by_target[target]
        if self.chunks is not None:
            self.chunks.settle()  # a gather left in flight would overwrite what is loaded
        with torch.no_grad():
            zp.shard.copy_(self.chunk_of(target, whole))
            if zp.full is not None:
                zp.full.copy_(whole.view(zp.shape))
        self._versions = [p.shard._version for p in self.params]


__all__ = ["Zero", "ZeroParam", "shard_name"]
