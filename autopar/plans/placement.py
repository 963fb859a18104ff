"""Placements on a device mesh and the arithmetic on them.

A tensor on an n-axis mesh has one :class:`Placement` per mesh axis (the public
``torch.distributed.tensor`` classes ``Shard(dim)``, ``Replicate()`` and
``Partial()``); the tuple is called ``Placements``.  When several mesh axes shard the
same tensor dim, the earlier axis shards first and the later one shards each chunk
again (DTensor's order), so the local chunk index along that dim is the row-major
index of the mesh coordinates of those axes.  Only even sharding is used: a dim is
sharded only if every mesh axis that shards it divides it exactly, so every rank
holds the same local shape.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]

R = Replicate()
P = Partial()

__all__ = ["P", "R", "Placements", "fmt_placements", "is_partial", "is_replicate", "is_shard",
           "local_shape", "normalize_dim", "parse_placements", "replicated_axes", "shard_factor",
           "valid_for_shape"]


# placement kinds by class: since torch 2.13 the placement classes check instances
# through a metaclass (0.27 us an isinstance, against 0.05 for a dict lookup), and the
# intra-op search checks placements millions of times (a few % of a large search)
_KINDS: dict[type, type | None] = {}


def _kind(p: Placement) -> type | None:
    """``Shard``, ``Replicate`` or ``Partial``: the one of the three ``p`` is an instance of."""
    t = type(p)
    try:
        return _KINDS[t]
    except KeyError:
        k = next((c for c in (Shard, Replicate, Partial) if issubclass(t, c)), None)
        _KINDS[t] = k
        return k


def is_shard(p: Placement, dim: int | None = None) -> bool:
    """True when ``p`` is ``Shard`` (of ``dim`` when given)."""
    return _kind(p) is Shard and (dim is None or p.dim == dim)


def is_replicate(p: Placement) -> bool:
    """True when ``p`` is ``Replicate``."""
    return _kind(p) is Replicate


def is_partial(p: Placement) -> bool:
    """True when ``p`` is ``Partial`` (a pending sum)."""
    return _kind(p) is Partial


def replicated_axes(placements: Placements, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The mesh axes of more than one rank that ``placements`` replicate on (where a
    gradient is all-reduced, or a boundary value can be sent as slices)."""
    return tuple(a for a, p in enumerate(placements) if is_replicate(p) and mesh_shape[a] > 1)


def normalize_dim(dim: int, ndim: int) -> int:
    """Map a possibly negative dim to ``0..ndim-1``."""
    return dim + ndim if dim < 0 else dim


def shard_factor(placements: Placements, mesh_shape: Sequence[int], dim: int) -> int:
    """How many pieces tensor dim ``dim`` is cut into by ``placements``."""
    f = 1
    for p, n in zip(placements, mesh_shape):
        if is_shard(p, dim):
            f *= n
    return f


def valid_for_shape(placements: Placements, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim exists and is divided evenly by its mesh axes."""
    factors: dict[int, int] | None = None
    for p, n in zip(placements, mesh_shape):
        k = _KINDS.get(type(p)) or _kind(p)  # (inlined: the search calls this ~2M times)
        if k is Shard:
            d = p.dim
            if not 0 <= d < len(shape):
                return False
            if factors is None:
                factors = {d: n}
            else:
                factors[d] = factors.get(d, 1) * n
    if factors is None:
        return True
    for d, f in factors.items():
        if shape[d] % f:
            return False
    return True


def local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape each rank holds (even sharding, so the same on every rank)."""
    out = list(shape)
    for p, n in zip(placements, mesh_shape):
        if (_KINDS.get(type(p)) or _kind(p)) is Shard:
            if out[p.dim] % n:
                raise ValueError(
                    f"mesh axis of size {n} does not divide tensor dim {p.dim} of size "
                    f"{out[p.dim]} (global shape {tuple(shape)})"
                )
            out[p.dim] //= n
    return tuple(out)


def fmt_placement(p: Placement) -> str:
    """Short form: ``S(1)``, ``R`` or ``P``."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P"
    return "R"


@functools.lru_cache(maxsize=4096)
def fmt_placements(ps: Placements) -> str:
    """Short form of a placement tuple, e.g. ``S(0)R``; one entry per mesh axis.
    Cached: assembling a plan formats every strategy's placements (tens of thousands on
    a deep model), and ``isinstance`` on DTensor's placement types is slow."""
    return "".join(fmt_placement(p) for p in ps)


def parse_placement(s: str) -> Placement:
    """Inverse of :func:`fmt_placement`."""
    s = s.strip()
    if s == "R":
        return Replicate()
    if s == "P":
        return Partial()
    if s.startswith("S(") and s.endswith(")"):
        return Shard(int(s[2:-1]))
    raise ValueError(f"cannot parse placement {s!r}; expected R, P or S(dim)")


def parse_placements(s: str) -> Placements:
    """Inverse of :func:`fmt_placements` (``"S(0)R"`` -> ``(Shard(0), Replicate())``)."""
    out: list[Placement] = []
    i = 0
    while i < len(s):
        if s[i] in "RP":
            out.append(parse_placement(s[i]))
            i += 1
        elif s[i] == "S":
            j = s.index(")", i)
            out.append(parse_placement(s[i : j + 1]))
            i = j + 1
        else:
            raise ValueError(f"cannot parse placements {s!r}")
    return tuple(out)


def returned_placement(src: Placements, shape: Sequence[int], local_rows: int | None) -> Placements:
    """Where a model output is returned to the caller: replicated on every mesh axis; with
    ``batch="local"`` (``local_rows`` = the planned global batch) an output whose dim 0 is
    the batch keeps its ``Shard(0)`` axes, so each data-parallel rank gets its own rows, as
    DDP returns them, and is replicated on the other axes (no gather of, e.g., the logits)."""
    if local_rows is None or not shape or shape[0] != local_rows:
        return (R,) * len(src)
    return tuple(p if isinstance(p, Shard) and p.dim == 0 else R for p in src)


def graph_batch(gm) -> int | None:
    """The planned global batch of a captured graph: dim 0 of its first tensor input with
    a dim (the convention of :func:`autopar.runtime.inputs.data_parallel_axes`)."""
    for n in gm.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if v is not None and hasattr(v, "shape") and len(v.shape) > 0:
            return int(v.shape[0])
    return None
