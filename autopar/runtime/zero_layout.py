"""How ZeRO cuts a parameter over the ranks of its ZeRO axes: on dim 0, as FSDP2 does.

A parameter under ZeRO keeps its shape for its user: a DTensor of the parameter's
global shape, ``Shard(0)`` on each ZeRO axis (composed with its tensor-parallel
placements on the other axes), so ``p.shape``, ``p.dim()`` and ``numel()`` are the
original ones and shape-aware code (weight-decay grouping on ``p.dim()``, Muon, muP)
sees what it would see in one process.  Each rank holds the rows DTensor gives it:
``torch.chunk`` semantics on dim 0, axis after axis in mesh order (uneven sizes give
the last ranks fewer rows, or none).

The runtime's collectives move equal-sized buffers, so each rank's rows also live in a
*flat* padded buffer of :attr:`Cut.size` elements (FSDP2's padded shard): the gathers
send it, the reduce-scatters fill it; the parameter the optimizer steps is a view of
its first :attr:`Cut.count` elements in the parameter's local shape.  When every rank
but the last ones has full chunks (one ZeRO axis, or sizes that divide), rank ``r``'s
piece starts at element ``r * size`` of the flattened whole (:attr:`Cut.prefix`), and the
buffers concatenate into the whole followed by padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.errors import AutoparError


def _rows(n: int, sizes: Sequence[int], coords: Sequence[int]) -> tuple[int, int]:
    """(first row, rows) of the rank at ``coords`` when ``n`` rows are chunked over axes
    of ``sizes`` one after the other (``torch.chunk``, as DTensor's ``Shard``)."""
    start = 0
    for k, c in zip(sizes, coords):
        step = -(-n // k) if n else 0
        first = min(c * step, n)
        start, n = start + first, min(step, n - first)
    return start, n


@dataclass(frozen=True)
class Cut:
    """One parameter's ZeRO layout over ``d`` ranks (rank order: row-major over the
    sorted ZeRO axes, :meth:`autopar.runtime.mesh.Mesh.coord_of`)."""

    shape: torch.Size  # the local (tensor-parallel) whole parameter
    size: int  # padded elements every rank's flat buffer holds
    starts: tuple[int, ...]  # each rank's first element in the flattened whole
    counts: tuple[int, ...]  # each rank's real elements
    prefix: bool = True
    """Rank ``r``'s piece starts at ``r * size``: the buffers concatenated are the whole,
    then padding (read on every gather, so computed once)."""

    @classmethod
    def of(cls, shape: Sequence[int], sizes: Sequence[int]) -> Cut:
        """The layout of a local whole of ``shape`` over ZeRO axes of ``sizes``
        (mesh order); ``shape`` has at least one dim (0-d parameters stay out of ZeRO:
        ``Shard(0)`` has no dim to cut)."""
        shape = torch.Size(shape)
        row = math.prod(shape[1:])
        spans = [_rows(shape[0], sizes, _coords(r, sizes)) for r in range(math.prod(sizes))]
        size, numel = padded_size(shape, sizes), math.prod(shape)
        starts = tuple(s * row for s, _ in spans)
        return cls(shape, size, starts, tuple(n * row for _, n in spans),
                   all(s == min(r * size, numel) for r, s in enumerate(starts)))

    @property
    def numel(self) -> int:
        """Elements of the local whole."""
        return math.prod(self.shape)

    def local_shape(self, r: int) -> torch.Size:
        """Rank ``r``'s shard shape (its rows of the local whole)."""
        row = math.prod(self.shape[1:])
        return torch.Size((self.counts[r] // row if row else 0, *self.shape[1:]))

    def chunk(self, whole: torch.Tensor, r: int) -> torch.Tensor:
        """Rank ``r``'s flat padded buffer of ``whole`` (a new tensor; no collective)."""
        out = whole.new_zeros(self.size)
        out[: self.counts[r]].copy_(whole.reshape(-1)[self.starts[r]:self.starts[r] + self.counts[r]])
        return out

    def view(self, flat: torch.Tensor, r: int) -> torch.Tensor:
        """Rank ``r``'s rows, in their shape, viewing its flat buffer ``flat``."""
        return flat[: self.counts[r]].view(self.local_shape(r))


def first_rows(rows: int, sizes: Sequence[int]) -> int:
    """The first rank's rows (the most any rank holds) of ``rows`` over ZeRO axes of
    ``sizes``."""
    for k in sizes:
        rows = -(-rows // k)
    return rows


def padded_size(shape: Sequence[int], sizes: Sequence[int]) -> int:
    """:attr:`Cut.size` of a local whole of ``shape`` over ZeRO axes of ``sizes``,
    without listing the ranks."""
    return max(1, first_rows(shape[0], sizes) * math.prod(shape[1:]))


def _coords(r: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for k in reversed(sizes):
        r, c = divmod(r, k)
        out.append(c)
    return out[::-1]


def pack(grads: Sequence[torch.Tensor | None], cuts: Sequence[Cut], d: int,
         like: torch.Tensor) -> torch.Tensor:
    """Whole tensors laid out for a reduce-scatter (or a gather's result) over ``d``
    ranks: rank ``r``'s part is its flat padded buffer of every tensor, in order.  Each
    tensor is copied once, straight into the buffer; a missing one is zeros; ``like``
    gives the type."""
    flat = torch.empty(d, sum(c.size for c in cuts), dtype=like.dtype, device=like.device)
    off = 0
    for g, cut in zip(grads, cuts):
        c = cut.size
        block = flat[:, off:off + c]
        off += c
        if g is None:
            block.zero_()
            continue
        src = g.reshape(-1)
        if not cut.prefix:
            for r in range(d):
                block[r, : cut.counts[r]].copy_(src[cut.starts[r]:cut.starts[r] + cut.counts[r]])
                block[r, cut.counts[r]:].zero_()
            continue
        whole, rest = divmod(cut.numel, c)  # full rows, elements of the next one
        block[:whole].copy_(src[:whole * c].view(whole, c))
        if whole < d:
            block[whole, :rest].copy_(src[whole * c:])
            block[whole, rest:].zero_()
            block[whole + 1:].zero_()
    return flat.reshape(-1)


def unpack(gathered: torch.Tensor, d: int, cuts: Sequence[Cut]) -> list[torch.Tensor]:
    """The whole tensors in a rank-major buffer of ``d`` ranks' flat padded buffers
    (what :func:`pack` lays out, or a gather brings): a strided read ``reshape`` copies."""
    rows = gathered.view(d, -1)
    out, off = [], 0
    for cut in cuts:
        part = rows[:, off:off + cut.size]
        off += cut.size
        if cut.prefix:
            out.append(part.reshape(-1)[: cut.numel].view(cut.shape))
        else:
            out.append(torch.cat([part[r, : cut.counts[r]] for r in range(d)]).view(cut.shape))
    return out


def placements(tp: Sequence, zero_axes: Sequence[int], mesh_shape: Sequence[int]) -> tuple:
    """The DTensor placements of a ZeRO shard: ``tp`` (the parameter's own placements,
    ``Replicate`` on every ZeRO axis) with ``Shard(0)`` on the ZeRO axes.  Where a later
    mesh axis shards dim 0 for tensor parallelism, that split is the outer one (the
    ZeRO rows are cut from the tensor-parallel piece), which DTensor spells
    ``_StridedShard(0, split_factor)``, as FSDP2 does."""
    out = list(tp)
    for a in zero_axes:
        sf = math.prod(mesh_shape[j] for j in range(a + 1, len(tp))
                       if j not in zero_axes and isinstance(tp[j], Shard) and tp[j].dim == 0)
        out[a] = _StridedShard(0, split_factor=sf) if sf > 1 else Shard(0)
    return tuple(out)


def check(target: str, local: torch.Tensor, mesh: DeviceMesh, zero_pl: tuple, tp_pl: tuple,
          shape: Sequence[int], start_row: int) -> None:
    """Raise unless DTensor places this rank's ``local`` rows (the ``start_row``-th row
    on of its tensor-parallel piece) where the runtime keeps them: a layout the
    placements cannot spell would make ``full_tensor``, ``clip_grad_norm_`` and DCP wrong
    silently."""
    want_shape, want_off = compute_local_shape_and_global_offset(shape, mesh, zero_pl)
    _, tp_off = compute_local_shape_and_global_offset(shape, mesh, tp_pl)
    have_off = (tp_off[0] + start_row, *tp_off[1:]) if len(shape) else tuple(tp_off)
    # an empty shard has no place (DTensor puts it at the end, the cut where it starts)
    if tuple(want_shape) != tuple(local.shape) or local.numel() and tuple(want_off) != have_off:
        raise AutoparError(
            f"ZeRO cannot describe parameter {target!r} of shape {tuple(shape)} as a DTensor with "
            f"placements {zero_pl} (rows {tuple(local.shape)} at {have_off}, DTensor expects "
            f"{tuple(want_shape)} at {tuple(want_off)}); plan it with its ZeRO axes after its "
            "tensor-parallel axes, or without ZeRO for it")


__all__ = ["Cut", "check", "first_rows", "pack", "padded_size", "placements", "unpack"]
