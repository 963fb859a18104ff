"""ZeRO-1/2's gathers of the updated parameters, split into chunks sent in forward order.

After the optimizer steps its shards, the whole parameters must be gathered again
before the next forward reads them.  Sent as one blocking refresh (4 MiB buckets, back
to front) the forward waits for all of it.  Split into chunks of consecutive layers in
forward order (ByteScheduler's priority: the next forward's first layers arrive
first), each chunk waited for where its layer first reads a parameter, the forward
computes the first layers while the rest arrive (:mod:`autopar.runtime.zero_chunks`).

The runtime keeps one chunk in flight: chunk ``k + 1`` is launched when chunk ``k`` is
waited for (bounding the gathered buffers alive at once to one chunk, and the link to
one collective, whose arrival order it then keeps).  With ``S_k`` the time chunk ``k``'s
layers start and ``F_k = S_k + fwd_k`` when they end,

    E_{k+1} = end of T(chunk k+1) started at S_k, at ``mesh.overlap`` of full speed
              while the forward computes (until F_k) and at full speed after;
    S_{k+1} = max(F_k, E_{k+1}).

The forward's end ``F`` grows with ``(S_k, F_k)`` in both, so keeping, for each cut, the
pairs no other pair beats in both (a Pareto front) and extending each by every next
chunk finds the cuts with the earliest end: exact for this model, not a heuristic.
Few chunks pay few latencies but wait for more bytes before the first layer; one
chunk per layer hides the most bytes behind the forward and pays every latency: the
front weighs the two, merging as well as splitting.

Gradients are not split: the backward makes each one whole at once, so its chunks
would all be ready together, and the bucket recurrence (:mod:`autopar.search.buckets`)
already ends their reduction earliest over whole gradients; splitting one would only
add latencies.  Sending the first layers' gradients first pays off only when the
optimizer steps them before the others, inside the user's ``optimizer.step()``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from autopar.cost_models import MeshSpec, all_gather_time
from autopar.plans.decisions import prices, zero_axes
from autopar.search.buckets import _end, affine_fit
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.zero_price import on_zero


@dataclass(frozen=True)
class ChunkPlan:
    """Chosen chunks (index ranges over the gathered layers, forward order) and timing."""

    cuts: tuple[tuple[int, int], ...]
    waits: float
    """Seconds the forward waits for its chunks (the exposed gathering)."""
    busy: float
    """Seconds the gathers hold the link at full speed."""
    largest: float
    """Bytes of the largest chunk: its gathered buffer, alive while it is copied out."""
    names: tuple[tuple[str, ...], ...] = ()
    """Parameter names per chunk (:func:`stage_chunks`)."""
    starts: tuple[int, ...] = ()
    """Index of each chunk's first layer in the stage (:func:`stage_chunks`)."""
    sizes: tuple[float, ...] = ()
    """Gathered bytes per chunk (:func:`stage_chunks`)."""


def _arrive(start: float, work: float, busy_until: float, overlap: float) -> float:
    return float(_end(start, work, busy_until, overlap))


@functools.lru_cache(maxsize=4096)
def _plan(nbytes: tuple[float, ...], fwd: tuple[float, ...], lead: float, lat: float,
          per: float, overlap: float) -> ChunkPlan:
    n = len(nbytes)
    prefix = [0.0]
    for b in nbytes:
        prefix.append(prefix[-1] + b)
    fsum = [0.0]
    for f in fwd:
        fsum.append(fsum[-1] + f)
    # front[i]: (S, F, previous cut, index into front[previous]) of the chunkings of
    # layers [0, i) that no other beats in both S and F; the state before any chunk is
    # the lead layers' forward, computing from 0 while the first chunk is gathered
    front: list[list[tuple[float, float, int, int]]] = [[(0.0, lead, -1, -1)]]
    for j in range(1, n + 1):
        cands = []
        for i in range(j):
            work = lat + per * (prefix[j] - prefix[i])
            for k, (s, f, _, _) in enumerate(front[i]):
                e = _arrive(s, work, f, overlap)
                start = max(f, e)
                cands.append((start, start + fsum[j] - fsum[i], i, k))
        cands.sort(key=lambda c: (c[1], c[0]))
        kept: list[tuple[float, float, int, int]] = []
        for c in cands:  # by F, then S: keep each whose S is below every kept one's
            if not kept or c[0] < kept[-1][0] - 1e-15:
                kept.append(c)
        front.append(kept)
    best = min(range(len(front[n])), key=lambda k: (front[n][k][1], front[n][k][0]))
    cuts, j, k = [], n, best
    end = front[n][best][1]
    while j > 0:
        _, _, i, kk = front[j][k]
        cuts.append((i, j))
        j, k = i, kk
    cuts.reverse()
    busy = sum(lat + per * (prefix[j] - prefix[i]) for i, j in cuts)
    largest = max(prefix[j] - prefix[i] for i, j in cuts)
    return ChunkPlan(tuple(cuts), max(0.0, end - lead - fsum[n]), busy, largest)


def affine(mesh: MeshSpec, axes: tuple[int, ...]) -> tuple[float, float]:
    """(latency, seconds per gathered byte) of an all-gather over ``axes``."""
    return affine_fit(all_gather_time, mesh, axes)


def chunk_plan(nbytes: list[float], fwd: list[float], lead: float, mesh: MeshSpec,
               axes: tuple[int, ...]) -> ChunkPlan:
    """The chunks of layers (gathered bytes ``nbytes`` and forward seconds ``fwd`` each,
    forward order, after ``lead`` seconds of forward that reads no gathered
    parameter) whose gathers, one in flight at a time, end the forward earliest."""
    lat, per = affine(mesh, axes)
    return _plan(tuple(nbytes), tuple(fwd), lead, lat, per, mesh.overlap)


def simulate(nbytes: list[float], fwd: list[float], lead: float, mesh: MeshSpec,
             axes: tuple[int, ...], cuts: list[tuple[int, int]]) -> float:
    """Seconds the forward waits for given chunks (the module's model)."""
    lat, per = affine(mesh, axes)
    s, f = 0.0, lead
    for i, j in cuts:
        e = _arrive(s, lat + per * sum(nbytes[i:j]), f, mesh.overlap)
        s = max(f, e)
        f = s + sum(fwd[i:j])
    return max(0.0, f - lead - sum(fwd))


@prices("gather_chunks")
def stage_chunks(layers: list[LayerStat], stage: int, axis, mesh: MeshSpec) -> ChunkPlan | None:
    """The chunks of a stage's ZeRO-1/2 parameters (``stage``, ZeRO axes ``axis``) with
    their parameter names, forward order; ``None`` when nothing is gathered.  A layer
    whose parameters are all outside ZeRO adds its forward to the chunk before it (or
    to the lead, before the first)."""
    axes = zero_axes(axis)
    nbytes: list[float] = []
    fwd: list[float] = []
    names: list[list[str]] = []
    index: list[int] = []
    lead = 0.0
    for k, st in enumerate(layers):
        mine = [p for p in st.params if on_zero(p.replicated, stage, axes)]
        if mine:
            nbytes.append(sum(p.bytes for p in mine))
            fwd.append(st.forward)
            names.append([p.name for p in mine])
            index.append(k)
        elif fwd:
            fwd[-1] += st.forward
        else:
            lead += st.forward
    if not nbytes or stage not in (1, 2):
        return None
    cp = chunk_plan(nbytes, fwd, lead, mesh, axes)
    return dataclasses.replace(cp, names=tuple(tuple(n for k in range(i, j) for n in names[k])
                                               for i, j in cp.cuts),
                               starts=tuple(index[i] for i, _ in cp.cuts),
                               sizes=tuple(sum(nbytes[i:j]) for i, j in cp.cuts))


def names_of(cp: ChunkPlan | None) -> list[list[str]]:
    """``cp``'s chunks as :attr:`autopar.plans.Decisions.gather_chunks` lists them."""
    return [list(c) for c in cp.names] if cp is not None else []


__all__ = ["ChunkPlan", "affine", "chunk_plan", "names_of", "simulate", "stage_chunks"]
