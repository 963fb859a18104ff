"""What crosses a pipeline stage boundary: the values' shape headers, and
slice-and-gather sends (a replicated value crosses as one slice per rank, and the
receiving stage all-gathers it).

Across a stage boundary each rank sends to the rank with its own sub-mesh coordinate
in the next stage (:mod:`autopar.runtime.pipeline`).  A value replicated over some
sub-mesh axes (a tensor-parallel stage's residual stream) is then the same tensor on
each of those ranks, and sending it whole from each carries it ``t`` times over the
link between the stages, which on a cluster is the slow one (between nodes).  As
Megatron-LM's scatter/gather optimisation (Narayanan et al., SC'21) and Alpa's
cross-mesh resharding do, each of the ``t`` ranks instead sends its ``1/t`` slice
(slice ``i`` by its coordinate ``i`` along those axes), and the receiving ranks
all-gather the slices over the same axes inside their stage, where the link is fast.
Gradients flow back as the dual of that (:mod:`autopar.runtime.collectives`' convention:
a replicated value's gradient is a partial sum on each rank): the receiving stage
reduce-scatters the gradient over the axes, each rank sends its slice back, and the
sending stage holds it as a partial sum (the slice in its place, zeros elsewhere).  A value sharded over an
axis (sequence-parallel activations) is already ``1/t`` per rank: it is sent as it is.

The slices are of the flattened value, padded to a multiple of ``t``, so any shape
divides; the all-gather reassembles them in coordinate order (group ranks need not be
in that order), so the value received is bit for bit the one sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.runtime.collectives import reduce_scatter_flat
from autopar.runtime.mesh import current
from autopar.runtime.tls import issue

# dtypes a boundary value may have, by header code
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
MAX_DIMS = 8
HEADER = 3 + MAX_DIMS  # dtype code, requires_grad, ndim, dims


@dataclass
class Meta:
    """Shape, dtype and whether a boundary value carries a gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def encode(metas: list[Meta]) -> torch.Tensor:
    """The header announcing ``metas`` (one row of ints per value)."""
    h = torch.zeros(len(metas) * HEADER, dtype=torch.int64, device=current().device)
    for j, m in enumerate(metas):
        if len(m.shape) > MAX_DIMS:
            raise ValueError(f"boundary value with {len(m.shape)} dims (at most {MAX_DIMS})")
        if m.dtype not in DTYPES:
            raise ValueError(f"boundary value of dtype {m.dtype} cannot be sent")
        row = [DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
        h[j * HEADER: j * HEADER + len(row)] = torch.tensor(row, device=h.device)
    return h


def decode(h: torch.Tensor, n: int) -> list[Meta]:
    """The ``n`` metas a header announces."""
    out = []
    for j in range(n):
        row = h[j * HEADER:(j + 1) * HEADER].tolist()
        out.append(Meta(tuple(row[3:3 + row[2]]), DTYPES[row[0]], bool(row[1])))
    return out


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it is sent: detached, contiguous, a bool as bytes (gloo has no bool
    point-to-point)."""
    t = t.detach()
    return (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()


@dataclass
class BoundarySlices:
    """Per boundary value's name, the sub-mesh axes its ranks each send a slice over
    (absent: sent whole)."""

    axes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _order: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def _parts(self, name: str) -> tuple[tuple[int, ...], int]:
        a = self.axes.get(name, ())
        return a, (current().size_of(a) if a else 1)

    def cut(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """What this rank sends of activation ``value``: all of it, or its slice."""
        axes, t = self._parts(name)
        if t == 1:
            return value
        c, flat = self._padded(value, t)
        i = current().coord_of(axes)
        return flat[i * c:(i + 1) * c].contiguous()

    def reduce_cut(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """What this rank sends back of ``grad``, the gradient of a received value: all
        of it, or, for a sliced value, its slice of the gradient summed over the value's
        axes (a replicated value's gradient is held as a partial sum on each rank,
        :mod:`autopar.runtime.collectives`): a reduce-scatter."""
        axes, t = self._parts(name)
        if t == 1:
            return grad
        c, flat = self._padded(grad, t)
        group = current().group_of(axes)
        order = self._coords(axes, group)  # group rank of each coordinate
        by_rank = [None] * t
        for coord, g in enumerate(order):
            by_rank[g] = flat[coord * c:(coord + 1) * c]
        out = torch.empty(c, dtype=flat.dtype, device=flat.device)
        reduce_scatter_flat(out, torch.cat(by_rank), group)
        return out

    @staticmethod
    def _padded(value: torch.Tensor, t: int) -> tuple[int, torch.Tensor]:
        """The slice length and ``value`` flat, padded to ``t`` slices of it."""
        flat = wire(value).reshape(-1)
        c = -(-flat.numel() // t)
        if c * t != flat.numel():
            flat = torch.nn.functional.pad(flat, (0, c * t - flat.numel()))
        return c, flat

    def buffer_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of what arrives for a value of ``shape``."""
        _, t = self._parts(name)
        return shape if t == 1 else (-(-math.prod(shape) // t),)

    def join(self, name: str, part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole activation of ``shape`` from this rank's received ``part``:
        gathered over the value's axes (blocking: the stage computes on it next)."""
        axes, t = self._parts(name)
        if t == 1:
            return part
        group = current().group_of(axes)
        got = [torch.empty_like(part) for _ in range(t)]
        issue(dist.all_gather, got, part, group=group)
        order = self._coords(axes, group)
        whole = torch.cat([got[order[i]] for i in range(t)])
        return whole[:math.prod(shape)].view(shape)

    def spread(self, name: str, part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The gradient of a sent value of ``shape`` from this rank's received slice of
        it, as the partial sum a replicated value's gradient is held as: the slice in
        its place, zeros elsewhere (the ranks' sum is the whole gradient, exactly)."""
        axes, t = self._parts(name)
        if t == 1:
            return part
        c = part.numel()
        whole = part.new_zeros(c * t)
        i = current().coord_of(axes)
        whole[i * c:(i + 1) * c] = part
        return whole[:math.prod(shape)].view(shape)

    def _coords(self, axes: tuple[int, ...], group) -> list[int]:
        """For each coordinate along ``axes``, the group rank that holds it."""
        if axes not in self._order:
            mesh = current()
            lead = 1 if mesh.stages > 1 else 0
            grid = mesh.device_mesh.mesh
            by_coord = {}
            for g, r in enumerate(dist.get_process_group_ranks(group)):
                where = (grid == r).nonzero()[0].tolist()
                i = 0
                for a in sorted(axes):
                    i = i * mesh.shape[a] + where[a + lead]
                by_coord[i] = g
            self._order[axes] = [by_coord[i] for i in range(len(by_coord))]
        return self._order[axes]


__all__ = ["HEADER", "BoundarySlices", "Meta", "decode", "encode", "wire"]
