"""Gradient buckets chosen by the cost model (MG-WFBP, Shi et al. 2019).

Data-parallel gradients are all-reduced in buckets launched strictly in order as the
backward produces them (:mod:`autopar.runtime.grad_sync`).  Many small buckets pay the
collective's latency many times; one large bucket waits for the last gradient before
anything is sent.  Given each gradient's bytes, the mesh axes it is reduced over and
the time the backward makes it ready, the buckets are chosen to minimise the end of
the last bucket: with ``f(j)`` the earliest end of the buckets covering gradients
``[0, j)`` (in the order they become ready),

    f(j) = min_i  max(f(i), ready[j-1]) + T(bytes[i:j])

over the cuts ``i`` that keep one bucket on one set of axes.  ``T`` is the
all-reduce's alpha-beta price, affine in the bytes, so each ``j`` is one numpy
expression over every ``i`` (``O(n^2)`` arithmetic, ``O(n)`` Python steps).  Because a
bucket's end grows with the previous end, taking the least ``f(i)`` is optimal: the
recurrence is exact for this model, not a heuristic.  Among cuts that end equally
early (the reduction hides under the backward either way) the one holding the link
the fewest seconds is kept: fewer latencies, less contention with the backward.

While the backward still computes, a reduction runs at ``mesh.overlap`` of its speed
(communication and compute share the host's cores under gloo; 1.0 on GPUs), at full
speed after it: a bucket's end still grows with its start, so the recurrence stays
exact.

Items whose time is fixed (a ZeRO layer's reduce-scatters, priced elsewhere) take the
link in their turn but never merge with others.

Under gradient compression (:mod:`autopar.search.compression`) a gradient puts its
``wire`` bytes on the link and adds its ``work`` seconds to its bucket, and the kind
scales the latency; bf16's gather half runs after the backward (``tail``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autopar.cost_models import MeshSpec, all_reduce_time
from autopar.plans.decisions import prices
from autopar.search.compression import LATENCIES
from autopar.search.stages.layer_stats import LayerStat, ParamStat
from autopar.search.stages.zero_price import ZeroPrice, on_zero


@dataclass(frozen=True)
class GradItem:
    """One gradient (or a fixed-time reduction) as the backward produces it."""

    name: str
    bytes: float
    axes: tuple[int, ...]
    ready: float
    """Seconds after the last backward starts at which the gradient exists."""
    fixed: float | None = None
    """A reduction priced elsewhere (never merged): its time on the link."""
    wire: float | None = None
    """Bytes it puts on the link when compressed (None: ``bytes``)."""
    work: float = 0.0
    """Seconds of compression compute it adds to its bucket."""


@dataclass
class BucketPlan:
    """Chosen buckets (indices into the items, in launch order) and their timing."""

    cuts: list[tuple[int, int]]
    end: float
    """When the last bucket's reduction ends (seconds after the backward starts)."""
    backward: float
    """When the backward ends; ``end - backward`` (at least 0) is exposed."""
    busy: float = 0.0
    """Seconds the reductions hold the link (hidden or not)."""
    tail: float = 0.0
    """Seconds of reduction that can only start once the backward has ended (bf16
    compression's gathers): exposed whatever the buckets."""

    @property
    def exposed(self) -> float:
        """Reduction left after the backward: on the step's critical path."""
        return max(0.0, self.end - self.backward) + self.tail

    def names(self, items: list[GradItem]) -> list[list[str]]:
        """Gradient names per bucket, fixed-time items left out (they are not bucketed)."""
        return [[items[k].name for k in range(i, j)] for i, j in self.cuts
                if items[i].fixed is None]


def affine_fit(price: Callable[[MeshSpec, tuple[int, ...], float], float], mesh: MeshSpec,
               axes: tuple[int, ...]) -> tuple[float, float]:
    """(latency, seconds per byte) of a collective whose ``price(mesh, axes, bytes)`` is
    affine in the bytes for any non-empty message (the cost model's alpha-beta)."""
    big = float(1 << 30)
    t1, tb = price(mesh, axes, 1.0), price(mesh, axes, big)
    per = (tb - t1) / (big - 1.0)
    return t1 - per, per


@functools.lru_cache(maxsize=4096)
def _affine(mesh: MeshSpec, axes: tuple[int, ...], kind: str = "none") -> tuple[float, float]:
    """(latency, seconds per byte) of an all-reduce over ``axes``: the price is affine
    in the bytes for any non-empty message.  Under compression ``kind`` the latency
    counts :data:`~autopar.search.compression.LATENCIES` of them, and bf16's bytes pay
    half (its all-to-all; the gather's half is the bucket's tail).  Cached: every
    stage the split search prices with its buckets asks it again for the same mesh."""
    lat, per_byte = affine_fit(all_reduce_time, mesh, axes)
    if kind == "bf16":
        return lat * LATENCIES[kind], per_byte / 2.0
    return lat * LATENCIES.get(kind, 1.0), per_byte


class _Prices:
    """Link time of any bucket ``[i, j)`` of ``items``: its fixed time, or one
    all-reduce of its bytes over its axes (one price per set of axes, prefix sums of
    the bytes), shared by the recurrence, the merge pass and :func:`simulate`."""

    def __init__(self, items: list[GradItem], mesh: MeshSpec, kind: str = "none") -> None:
        self.items = items
        self.kind = kind
        self.prefix = np.concatenate([[0.0], np.cumsum(
            [it.bytes if it.wire is None else it.wire for it in items])])
        self.work = np.concatenate([[0.0], np.cumsum([it.work for it in items])])
        self.affine = {it.axes: _affine(mesh, it.axes, kind) for it in items if it.fixed is None}

    def time(self, i: int, j: int) -> float:
        """Seconds the bucket ``[i, j)`` holds the link at full speed."""
        it = self.items[i]
        if it.fixed is not None:
            return it.fixed
        lat, per = self.affine[it.axes]
        return lat + per * float(self.prefix[j] - self.prefix[i]) + float(self.work[j] - self.work[i])

    def tail(self, i: int, j: int) -> float:
        """Seconds of the bucket ``[i, j)`` after the backward: bf16's gather, the
        all-to-all's twin (the same latency and bytes)."""
        it = self.items[i]
        if self.kind != "bf16" or it.fixed is not None:
            return 0.0
        lat, per = self.affine[it.axes]
        return lat + per * float(self.prefix[j] - self.prefix[i])


def _end(start, work, backward: float, overlap: float):
    """When ``work`` seconds of full-speed reduction started at ``start`` end, running
    at ``overlap`` of full speed until ``backward`` and at full speed after (numpy
    arrays or floats)."""
    slow = start + work / overlap
    mixed = backward + work - (backward - start) * overlap
    return np.where(start >= backward, start + work, np.where(slow <= backward, slow, mixed))


def _latest_start(end: float, work: float, backward: float, overlap: float) -> float:
    """The latest start at which ``work`` ends by ``end`` (the inverse of :func:`_end`)."""
    if end - work >= backward:
        return end - work
    if end <= backward:
        return end - work / overlap
    return backward - (backward + work - end) / overlap


def _runs(items: list[GradItem]) -> list[int]:
    """For each item, the first index of the run of mergeable items it belongs to."""
    start, out = 0, []
    for k, it in enumerate(items):
        if k and (it.fixed is not None or items[k - 1].fixed is not None
                  or it.axes != items[k - 1].axes):
            start = k
        out.append(start)
    return out


def simulate(items: list[GradItem], cuts: list[tuple[int, int]], mesh: MeshSpec,
             backward: float, kind: str = "none") -> BucketPlan:
    """Timing of given buckets: each starts when the link is free and its last
    gradient is ready, and holds the link for its all-reduce (compressed as ``kind``)."""
    end = busy = tail = 0.0
    prices = _Prices(items, mesh, kind)
    for i, j in cuts:
        t = prices.time(i, j)
        end = float(_end(max(end, items[j - 1].ready), t, backward, mesh.overlap))
        busy += t
        tail += prices.tail(i, j)
    return BucketPlan(list(cuts), end, backward, busy + tail, tail)


@prices("grad_buckets")
def optimal(items: list[GradItem], mesh: MeshSpec, backward: float, kind: str = "none") -> BucketPlan:
    """The buckets that end the reduction earliest (the module's recurrence; under
    bf16 compression each bucket's tail is left out of the choice)."""
    n = len(items)
    if n == 0:
        return BucketPlan([], 0.0, backward)
    runs = _runs(items)
    ready = np.array([it.ready for it in items])
    prices = _Prices(items, mesh, kind)
    work = prices.work
    prefix = prices.prefix
    f = np.zeros(n + 1)
    arg = np.zeros(n + 1, dtype=np.int64)
    ov = mesh.overlap
    for j in range(1, n + 1):
        it = items[j - 1]
        if it.fixed is not None:
            f[j], arg[j] = float(_end(max(f[j - 1], it.ready), it.fixed, backward, ov)), j - 1
            continue
        s = runs[j - 1]
        lat, per = prices.affine[it.axes]
        cand = _end(np.maximum(f[s:j], ready[j - 1]),
                    lat + per * (prefix[j] - prefix[s:j]) + (work[j] - work[s:j]), backward, ov)
        k = int(np.argmin(cand))  # first minimum: the larger bucket on ties
        f[j], arg[j] = float(cand[k]), s + k
    cuts, j = [], n
    while j > 0:
        cuts.append((int(arg[j]), j))
        j = int(arg[j])
    return simulate(items, _coarsen(items, cuts[::-1], runs, prices, float(f[n]), backward,
                                    mesh.overlap), mesh, backward, kind)


def _coarsen(items: list[GradItem], cuts: list[tuple[int, int]], runs: list[int],
             prices: _Prices, target: float, backward: float, overlap: float) -> list[tuple[int, int]]:
    """Merge neighbouring buckets while the last one still ends by ``target``.

    The recurrence ends every prefix as early as it can, which sends each gradient on
    its own whenever the link keeps up with the backward; the step is no faster for
    it, and every extra bucket is one more latency on a link and a host shared with
    the backward.  Each bucket has a deadline (the latest end that lets the buckets
    after it, as they are, finish by ``target``); a bucket absorbs the next one while
    the merged bucket meets the next one's deadline."""
    dead = [0.0] * len(cuts)
    nxt = target
    for k in range(len(cuts) - 1, -1, -1):
        dead[k] = nxt
        nxt = _latest_start(dead[k], prices.time(*cuts[k]), backward, overlap)

    def end(start: float, i: int, j: int) -> float:
        return float(_end(max(start, items[j - 1].ready), prices.time(i, j), backward, overlap))

    out: list[tuple[int, int]] = []
    prev_end = 0.0
    a, b = cuts[0]
    cur_end = end(prev_end, a, b)
    for k in range(1, len(cuts)):
        i, j = cuts[k]
        mergeable = items[a].fixed is None and items[i].fixed is None and runs[i] == runs[a]
        if mergeable:
            merged = end(prev_end, a, j)
            if merged <= dead[k] * (1.0 + 1e-12):
                b, cur_end = j, merged
                continue
        out.append((a, b))
        prev_end = cur_end
        a, b = i, j
        cur_end = end(prev_end, a, b)
    out.append((a, b))
    return out


def fixed_size(items: list[GradItem], bucket_bytes: float) -> list[tuple[int, int]]:
    """Buckets closed once they hold ``bucket_bytes`` (the usual fixed-size rule, as
    DDP's ``bucket_cap_mb``), never across a change of axes."""
    runs = _runs(items)
    cuts, start, size = [], 0, 0.0
    for k, it in enumerate(items):
        if k > start and runs[k] == k:
            cuts.append((start, k))
            start, size = k, 0.0
        size += it.bytes
        if it.fixed is not None or size >= bucket_bytes:
            cuts.append((start, k + 1))
            start, size = k + 1, 0.0
    if start < len(items):
        cuts.append((start, len(items)))
    return cuts


def per_gradient(items: list[GradItem]) -> list[tuple[int, int]]:
    """One bucket per gradient (no fusion)."""
    return [(k, k + 1) for k in range(len(items))]


def per_layer(items: list[GradItem], layer_of: dict[str, int]) -> list[tuple[int, int]]:
    """One bucket per layer's run of gradients on the same axes: no gradient is then
    allocated before its own layer's backward has made it (what the split search
    counts), at a latency per layer."""
    runs, cuts = _runs(items), []
    for k, it in enumerate(items):
        if not cuts or runs[k] != runs[k - 1] or layer_of.get(it.name) != layer_of.get(items[k - 1].name):
            cuts.append([k, k + 1])
        else:
            cuts[-1][1] = k + 1
    return [(i, j) for i, j in cuts]


def one_bucket(items: list[GradItem]) -> list[tuple[int, int]]:
    """One bucket per run of gradients on the same axes (maximal fusion)."""
    runs = _runs(items)
    starts = sorted(set(runs))
    return list(zip(starts, starts[1:] + [len(items)]))


def stage_items(layers: list[LayerStat], zp: list[ZeroPrice], recompute: set[str],
                zero_stage: int, zero_axis: int | tuple[int, ...] | None,
                deferred: bool = False,
                terms: Callable[[ParamStat], tuple[float, float]] | None = None,
                ) -> tuple[list[GradItem], float]:
    """The gradients of one pipeline stage in the order its last backward makes them,
    and when that backward ends.  Layers run backward last to first, each taking its
    backward time (plus its forward again when recomputed); inside a layer the
    gradients appear evenly spread, last parameter first.  A layer's ZeRO reduction
    (its own reduce-scatters, :mod:`autopar.runtime.zero`) is one fixed item.
    ``deferred``: every gradient is ready only when the backward ends (the zero-bubble
    schedule reduces them all after its last ``W``), so nothing hides under it.
    ``terms``: a gradient's ``(wire, work)`` under compression
    (:func:`autopar.search.compression.bucket_terms`)."""
    items: list[GradItem] = []
    t = 0.0
    for st, z in zip(reversed(layers), reversed(zp)):
        bwd = st.seconds - st.forward + (st.forward if st.key in recompute else 0.0)
        mine = [p for p in st.params if p.replicated and not on_zero(p.replicated, zero_stage, zero_axis)]
        for k, p in enumerate(reversed(mine)):
            wire, work = terms(p) if terms is not None else (None, 0.0)
            items.append(GradItem(p.name, p.bytes, p.replicated, t + bwd * (k + 1) / len(mine),
                                  wire=wire, work=work))
        t += bwd
        if z.zero_sync > 0:
            items.append(GradItem(f"zero:{st.key}", 0.0, (), t, fixed=z.zero_sync))
    if deferred:
        items = [dataclasses.replace(it, ready=t) for it in items]
    return items, t


__all__ = ["BucketPlan", "GradItem", "affine_fit", "fixed_size", "one_bucket", "optimal", "per_gradient", "per_layer", "simulate",
           "stage_items"]
