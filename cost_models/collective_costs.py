"""Alpha-beta cost of collectives on a :class:`~autopar.cost_models.mesh.MeshSpec`.

Ring formulas for ``p`` ranks on one link (latency ``a``, bandwidth ``B``):

=================  ====================================  =========================
collective         time                                  ``nbytes`` means
=================  ====================================  =========================
all-reduce         2(p-1)a + 2(p-1)/p * S/B              the tensor's bytes
all-gather         (p-1)a + (p-1)/p * S/B                the FULL (gathered) bytes
reduce-scatter     (p-1)a + (p-1)/p * S/B                the FULL (input) bytes
all-to-all         (p-1)a + (p-1)/p * S/B                bytes each rank holds
broadcast          min(ceil(log2 p)(a + S/B),            the tensor's bytes
                   (p-1)a + S/B)  (tree or pipelined)
send/recv          a + S/B                               the message's bytes
=================  ====================================  =========================

A collective over several mesh axes at once (a flattened group), or over one hierarchical axis,
is split into flat levels ``(link, ranks)`` and composed hierarchically: the fastest link goes
first with the full message, and each later level sees the message shrunk by the ranks already
covered (all-reduce = reduce-scatter down the levels, all-gather back up)::

    all-reduce over (intra g, inter m) = 2(g-1)a_i + 2(g-1)/g S/B_i
                                       + 2(m-1)a_o + 2(m-1)/m (S/g)/B_o

All-to-all keeps ``S`` at every level (two-phase exchange), broadcast adds the levels, and
send/recv pays the slowest level it crosses. Any group of one rank, or ``nbytes == 0``, costs 0.

A kind listed in ``mesh.flat_ring`` (NCCL's all-gather and reduce-scatter on the GPU
presets) is instead one ring over all ``P`` ranks of a multi-level group, as the backend
runs it: ``P - 1`` steps on the slowest link, whose bandwidth every rank of the faster
levels shares one ring each of (a node's NICs carry a ring each)::

    all-gather over (intra g, inter m), flat = (P-1)a_o + (P-1)/P S/(g B_o),  P = g m

A level counts as faster only at twice the slowest's bandwidth or more (NVLink against
InfiniBand or Ethernet: 6x and beyond): a gloo mesh calibrated per axis on one host has
one medium whose measured bandwidths differ by noise, and a ring per rank of a
"faster" axis would price its flat collectives twice as fast as they run.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence

from ._compat import StrEnum
from .link import LinkSpec
from .memo import IdentityMemo
from .mesh import MeshSpec

__all__ = [
    "CollectiveKind",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "blocking_time",
    "blocking_times",
    "broadcast_time",
    "collective_time",
    "collective_times",
    "drift_after",
    "reduce_scatter_time",
    "send_recv_time",
]

Axes = int | str | Sequence[int | str]
"""One mesh axis or several, by index or by name."""


class CollectiveKind(StrEnum):
    """The collectives the cost model prices."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


# the search prices the same collectives millions of times (module memo.py): prices and
# levels by the mesh's identity (frozen) and the other arguments' values
_TIMES = IdentityMemo()
_LEVELS = IdentityMemo(4096)


def _axes_key(axes: Axes) -> Hashable:
    """``axes`` as a memo key: one axis as it is, several as a tuple."""
    return axes if isinstance(axes, (int, str)) else tuple(axes)


def _levels(mesh: MeshSpec, axes: Axes) -> list[tuple[LinkSpec, int]]:
    """Flat ``(link, ranks)`` levels of the group spanned by ``axes``, fastest link first.

    Levels are listed innermost first (last mesh axis first, a hierarchical axis' in-node part
    before its inter-node part) and then stably sorted by bandwidth, so the hierarchical
    composition gives the largest message to the fastest link. Single-rank levels are dropped.
    """
    return _LEVELS.get((mesh,), _axes_key(axes), lambda: _levels_of(mesh, axes))


def _levels_of(mesh: MeshSpec, axes: Axes) -> list[tuple[LinkSpec, int]]:
    """:func:`_levels`, computed."""
    raw = [axes] if isinstance(axes, (numbers.Integral, str)) else list(axes)
    idx = [mesh.axis_index(a) for a in raw]
    if len(set(idx)) != len(idx):
        raise ValueError(f"mesh axes {tuple(raw)!r} repeat an axis")
    levels: list[tuple[LinkSpec, int]] = []
    for i in sorted(idx, reverse=True):
        levels.extend(mesh.links[i].levels(mesh.shape[i]))
    levels.sort(key=lambda lv: -lv[0].beta)
    return [(link, p) for link, p in levels if p > 1]


def _flat_time(kind: CollectiveKind, link: LinkSpec, p: int, nbytes: float) -> float:
    """Ring / tree time of ``kind`` on ``p > 1`` ranks of one flat link (module table)."""
    a, b = link.for_kind(kind.value)
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (p - 1) * a + 2 * (p - 1) / p * nbytes / b
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        return (p - 1) * a + (p - 1) / p * nbytes / b
    if kind is CollectiveKind.BROADCAST:
        # A binomial tree wins for small messages, a pipelined chain for large ones; NCCL and
        # gloo both switch algorithms, so take the cheaper.
        tree = math.ceil(math.log2(p)) * (a + nbytes / b)
        pipelined = (p - 1) * a + nbytes / b
        return min(tree, pipelined)
    if kind is CollectiveKind.SEND_RECV:
        return a + nbytes / b
    raise ValueError(f"unknown collective kind {kind!r}")  # pragma: no cover


FASTER = 2.0
"""How many times the slowest level's bandwidth a level needs to count as faster in a
flat ring (module docstring)."""


def _flat_ring(levels: list[tuple[LinkSpec, int]]) -> tuple[LinkSpec, int]:
    """The one ring over every rank of ``levels`` (module docstring): the slowest link
    (the last level: levels are sorted fastest first), its bandwidth times the ranks of
    the levels at least :data:`FASTER` times faster (each runs a ring through its own
    slow-link port; levels on one medium are one ring), per kind as well; and the total
    rank count."""
    slow = levels[-1][0]
    faster = math.prod(p for link, p in levels if link.beta >= FASTER * slow.beta)
    kinds = tuple((k, a, b * faster) for k, a, b in slow.kinds)
    return LinkSpec(alpha=slow.alpha, beta=slow.beta * faster, kinds=kinds), \
        math.prod(p for _, p in levels)


def collective_time(kind: CollectiveKind | str, mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """Seconds for collective ``kind`` over mesh ``axes`` (index, name, or several) of ``mesh``.

    ``nbytes`` follows the module table: tensor bytes for all-reduce and broadcast, FULL
    (gathered) bytes for all-gather / reduce-scatter, bytes each rank holds for all-to-all,
    message bytes for send/recv (``axes`` = the axis the message crosses). Several axes are
    one flattened group priced by hierarchical composition; a single-rank group costs 0.0.
    """
    if isinstance(nbytes, bool):  # True == 1 as a key: refused before the memo is asked
        raise ValueError(f"nbytes must be a number, got {nbytes!r}")
    # a key is stored only after its arguments passed the checks below (NaN never hits)
    return _TIMES.get((mesh,), (str(kind), _axes_key(axes), nbytes),
                      lambda: _collective_time(kind, mesh, axes, nbytes))


def _collective_time(kind: CollectiveKind | str, mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time`, computed (``nbytes`` is no bool: checked there)."""
    kind = CollectiveKind(kind)
    if not isinstance(nbytes, numbers.Real):
        raise ValueError(f"nbytes must be a number, got {nbytes!r}")
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be finite and >= 0, got {nbytes!r}")
    levels = _levels(mesh, axes)
    # No ranks to talk to or nothing to send: no collective is issued at all.
    if not levels or nbytes == 0:
        return 0.0
    if kind is CollectiveKind.SEND_RECV:
        # A point-to-point message is not split across levels; a pipeline is paced by its
        # slowest hop, so price the slowest link the axes cross.
        return max(_flat_time(kind, link, p, nbytes) for link, p in levels)
    if len(levels) > 1 and kind.value in mesh.flat_ring:
        link, p = _flat_ring(levels)
        return _flat_time(kind, link, p, nbytes)
    total = 0.0
    size = float(nbytes)
    for link, p in levels:
        total += _flat_time(kind, link, p, size)
        if kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER,
                    CollectiveKind.REDUCE_SCATTER):
            # Each level leaves 1/p of the data per rank for the next (slower) level.
            size /= p
    return total


def blocking_time(kind: CollectiveKind | str, mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time` of a collective the rank waits on right where it issues it
    (a tensor-parallel all-reduce, a redistribution), plus
    ``mesh.sync_seconds``: issued between compute, it ends only after the last rank
    arrives, and ranks drift apart while they compute (calibration measures it; 0 on the
    presets).  Collectives launched asynchronously and waited on later (gradient buckets,
    ZeRO's prefetched gathers) are priced by :func:`collective_time` alone, and so are a
    pipeline's messages (:func:`autopar.search.stages.step_terms.stage_link` says why).  0.0 where
    no collective is issued."""
    t = collective_time(kind, mesh, axes, nbytes)
    return t + mesh.sync_seconds if t > 0 else 0.0


def drift_after(mesh: MeshSpec, compute: float) -> float:
    """The drift a rank waits out at a collective after ``compute`` seconds of compute
    since the ranks last met: ``mesh.sync_seconds`` (measured after ``mesh.sync_window``
    of compute) times ``sqrt(compute / sync_window)`` where the compute is longer, as
    the ranks' independent delays add up; ``sync_seconds`` where it is not, or the
    window is unknown.  The square root fits a busy 2-core host: after a 174 ms
    forward and backward an all-reduce waited 19 ms of drift where 20-25 ms chunks
    waited 5-7 ms (sqrt(174 / 24) x 6 = 16).  Never less than ``sync_seconds``, which
    prices a tensor-parallel layer's short gaps."""
    if mesh.sync_window <= 0 or compute <= mesh.sync_window:
        return mesh.sync_seconds
    return mesh.sync_seconds * math.sqrt(compute / mesh.sync_window)


def blocking_times(kind: CollectiveKind | str, mesh: MeshSpec, axes: Axes, nbytes):
    """:func:`blocking_time` of every element of the numpy array ``nbytes``: each
    :func:`collective_times` element plus ``mesh.sync_seconds`` where a collective is
    issued (the edge prices' vectorized path, the same rule as the scalar one)."""
    t = collective_times(kind, mesh, axes, nbytes)
    return t + mesh.sync_seconds * (t > 0)


def collective_times(kind: CollectiveKind | str, mesh: MeshSpec, axes: Axes, nbytes):
    """:func:`collective_time` of every element of the numpy array ``nbytes`` (all >= 0,
    finite) at once, by the same arithmetic in the same order, so each element equals
    the scalar price exactly (edge pricing on 3-axis meshes, ``autopar.search.edge_prices``).  Not for
    send/recv and broadcast (their ``max``/``min`` are scalar here)."""
    kind = CollectiveKind(kind)
    if kind in (CollectiveKind.SEND_RECV, CollectiveKind.BROADCAST):
        raise ValueError(f"collective_times does not price {kind}")
    levels = _levels(mesh, axes)
    total = nbytes * 0.0
    if not levels:
        return total
    if len(levels) > 1 and kind.value in mesh.flat_ring:
        levels = [_flat_ring(levels)]
    size = nbytes.astype(float)
    for link, p in levels:
        total = total + _flat_time(kind, link, p, size)
        if kind is not CollectiveKind.ALL_TO_ALL:
            size = size / p
    return total * (nbytes != 0)  # nothing to send: no collective


def all_reduce_time(mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time` for an all-reduce of a tensor of ``nbytes`` bytes."""
    return collective_time(CollectiveKind.ALL_REDUCE, mesh, axes, nbytes)


def all_gather_time(mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time` for an all-gather producing a FULL tensor of ``nbytes`` bytes."""
    return collective_time(CollectiveKind.ALL_GATHER, mesh, axes, nbytes)


def reduce_scatter_time(mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time` for a reduce-scatter of a FULL tensor of ``nbytes`` bytes."""
    return collective_time(CollectiveKind.REDUCE_SCATTER, mesh, axes, nbytes)


def all_to_all_time(mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time` for an all-to-all where each rank holds ``nbytes`` bytes."""
    return collective_time(CollectiveKind.ALL_TO_ALL, mesh, axes, nbytes)


def broadcast_time(mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time` for a broadcast of a tensor of ``nbytes`` bytes."""
    return collective_time(CollectiveKind.BROADCAST, mesh, axes, nbytes)


def send_recv_time(mesh: MeshSpec, axes: Axes, nbytes: float) -> float:
    """:func:`collective_time` for one point-to-point message of ``nbytes`` crossing ``axes``."""
    return collective_time(CollectiveKind.SEND_RECV, mesh, axes, nbytes)
