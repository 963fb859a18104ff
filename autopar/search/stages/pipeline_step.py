"""Stage boundaries, schedule, recomputation and ZeRO for one intra-op plan: the
pipeline part of the joint search (Alpa's inter-op pass).

Given per-layer statistics (:mod:`autopar.search.stages.layer_stats`) of the intra-op plan
for one micro-batch, a :class:`Config` (stages ``p``, micro-batches ``M``, schedule,
ZeRO stage and axis) is priced as

* stage ``s`` holds layers ``[i, j)``; its micro-batch time ``t_s`` is the layers'
  forward+backward time, plus the forward of recomputed layers, plus stage-3 gathers,
  plus the point-to-point sends/receives of its boundary activations and gradients;
* it keeps ``k_s`` micro-batches of activations in flight (``M`` under GPipe,
  ``min(p - s, M)`` under 1F1B, 1 without a pipeline); recomputation is chosen per
  stage, greedily by bytes saved per second of extra forward, until the stage fits
  the memory budget (the least extra compute that fits when the layers are alike);
* step time ``= sum_s t_s + (M - 1) * max_s t_s`` plus, for the slowest stage, the
  gradient reduction not hidden behind the last micro-batch's backward (gradients are
  reduced in buckets while earlier layers run backward; the buckets are chosen by
  :mod:`autopar.search.buckets`, MG-WFBP) and the ZeRO-1/2 parameter all-gather after
  the step;
* stage boundaries come from a dynamic program over layer ranges that minimises the
  slowest stage (then the sum), every stage within the budget.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.cost_models import MeshSpec
from autopar.cost_models.memo import IdentityMemo
from autopar.plans.decisions import prices
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.priced import Config, Priced, StagePrice
from autopar.search.stages.split_search import (
    balanced_floor,
    layer_classes,
    slowest_floor,
    split,
    zero_prices,
)
from autopar.search.stages.step_terms import bubble_share


def step_lower_bound(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link,
                     optimizer: str) -> float:
    """A lower bound on :func:`price`'s step time for ``cfg`` (interleaved: ``v`` times
    the stage boundaries, the bubble divided by ``v``), in O(layers) instead of
    the split search's O(stages x layers^2): every split's stage times sum to at least
    the layers' own time plus stage-3 gathers plus, per stage boundary, two messages each
    way of the smallest layer output (``total``); the slowest stage takes at least
    ``total / p`` and at least the best balance of whole layers
    (:func:`~autopar.search.stages.split_search.slowest_floor`); the step's tail at least
    the average stage's ZeRO-1/2 gather and optimizer update; the bubble is what is left
    of ``total`` less what ``mesh.idle_reuse`` wins back.  Recomputation, idle stages and
    the memory budget only add."""
    p, m, v = cfg.stages, cfg.micro_batches, cfg.virtual
    if p * v > len(stats):
        return math.inf
    zps = zero_prices(stats, layer_classes(stats), cfg, mesh, optimizer)
    total, tail, smallest = _SUMS.get((stats, zps), None, lambda: _layer_sums(stats, zps))
    if p > 1:
        total += 4.0 * (p * v - 1) * pipe_link(smallest)
    # the step grows with the slowest stage (m >= 1 >= (1 - idle_reuse) x share), so
    # slow = total / p bounds it from below; interleaving divides the fill and drain by
    # v, zero-bubble leaves a third of it; whole layers rarely balance, so the slowest
    # stage (chunk) takes at least slowest_floor
    slow = max(total / p, slowest_floor(stats, zps, p * v))
    return m * slow + (total - slow) * (1.0 - mesh.idle_reuse) * bubble_share(cfg) + tail / p



# step_lower_bound's sums over the layers, by the statistics' and ZeRO prices' identity
# (the configs of one candidate that share a ZeRO setting share them; a deep model's
# search asks for tens of thousands of bounds, each summing every layer)
_SUMS = IdentityMemo(4096)


def _layer_sums(stats: list[LayerStat], zps: list) -> tuple[float, float, float]:
    """(every layer's time at best kept gathered, the step's tail, the smallest layer
    output) for :func:`step_lower_bound`, summed in layer order."""
    total = tail = 0.0
    for st, z in zip(stats, zps):
        total += st.seconds + z.gather_mb - z.regather  # at best the layer is kept gathered
        tail += z.gather_step + z.opt_step + z.copy_step
    return total, tail, min((st.wire_bytes for st in stats), default=0.0)


def split_lower_bound(floors: list[float], stages: int, micro: int, idle_reuse: float,
                      shapes: list[tuple[float, int]]) -> float:
    """A lower bound on the step of every config of one split (``stages`` stages, ``micro``
    micro-batches) whatever its placement: ``floors``, per layer, the seconds per
    micro-batch no placement on a stage's devices goes below (the compute floor);
    ``shapes``, per schedule the split may run, its :func:`bubble_share` and model chunks
    per rank.  As :func:`price`'s step, ``micro`` times the slowest rank plus the others'
    fill and drain at the schedule's share: the slowest rank takes at least the average
    and, for contiguous stages, the best balance of whole layers
    (:func:`~autopar.search.stages.split_search.slowest_floor`; an interleaved rank's
    chunks are not contiguous, only its slowest chunk is bounded so).  The least over
    ``shapes``, since zero-bubble and interleaving shrink 1F1B's fill."""
    total = sum(floors)
    if stages <= 1:
        return micro * total
    out = math.inf
    for share, v in shapes:
        parts = stages * v
        if parts > len(floors):
            continue  # a chunk per layer at least: no such config
        slow = max(total / stages, balanced_floor(floors, parts))
        out = min(out, micro * slow + (total - slow) * (1.0 - idle_reuse) * share)
    return out


@prices("pipeline", "micro_batches")
def price(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link, budget: float,
          optimizer: str, cut: float = math.inf) -> Priced:
    """Best stage split for ``cfg`` and its step time.  ``cut``: the step time of a plan
    already in hand; splits whose step must exceed it are not searched, and when every
    split that fits does, the config comes back bounded (:attr:`Priced.bound`, no
    stages) instead of priced (:mod:`autopar.search.stages.split_search`).  A config whose step
    is within ``cut`` is priced exactly as without it."""
    if cfg.virtual > 1:
        return _price_interleaved(stats, cfg, mesh, pipe_link, budget, optimizer, cut)
    res = split(stats, cfg, mesh, pipe_link, budget, optimizer, cut,
                step=lambda ranks: _step(ranks, cfg, mesh))
    if res.stages is None:
        return Priced(cfg, [], math.inf, res.min_memory, bound=res.bound)
    return Priced(cfg, res.stages, _step(res.stages, cfg, mesh),
                  max(sp.total_memory for sp in res.stages))


def _step(ranks: list[StagePrice], cfg: Config, mesh: MeshSpec) -> float:
    """The step of pipeline ranks ``ranks``: ``M`` times the slowest, plus the other
    ranks' fill and drain (less what ranks sharing cores win back, and the schedule's
    :func:`bubble_share` of it), plus the slowest tail (exposed sync, gathers, update)."""
    slow = max(sp.seconds for sp in ranks)
    total = sum(sp.seconds for sp in ranks)
    bubble = (total - slow) * (1.0 - mesh.idle_reuse) * bubble_share(cfg)
    return cfg.micro_batches * slow + bubble + max(sp.extra for sp in ranks)


def _price_interleaved(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link,
                       budget: float, optimizer: str, cut: float = math.inf) -> Priced:
    """Interleaved 1F1B: ``p v`` virtual stages split by the same search, each within
    ``budget / v`` (so a rank's ``v`` chunks fit the budget together: sufficient, not
    necessary); rank ``r`` runs virtual stages ``r, r + p, ..`` and costs their sum per
    micro-batch.  The step is ``M`` times the slowest rank plus the other ranks' fill
    and drain divided by ``v`` (each micro-batch passes a rank in ``v`` shorter
    pieces; :func:`autopar.plans.schedules.list_schedule` gives the same for equal chunks).
    A rank's time is at least its slowest chunk's, so ``cut`` prunes chunks as stages."""
    p, v = cfg.stages, cfg.virtual
    res = split(stats, dataclasses.replace(cfg, stages=p * v), mesh, pipe_link, budget / v,
                optimizer, cut, step=lambda chunks: _step([_merge(chunks[r::p]) for r in range(p)], cfg, mesh))
    if res.stages is None:
        return Priced(cfg, [], math.inf, res.min_memory * v, bound=res.bound)
    chunks = res.stages
    ranks = [_merge(chunks[r::p]) for r in range(p)]
    return Priced(cfg, ranks, _step(ranks, cfg, mesh), max(sp.total_memory for sp in ranks),
                  virtual=[sp.layers for sp in chunks])


def _merge(chunks: list[StagePrice]) -> StagePrice:
    """One rank's chunks as one stage: times, memory and parts summed (each chunk's
    activation peak counted whole: an upper bound on the rank's), layers in model order."""
    def add(dicts: list[dict[str, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in dicts:
            for k, x in d.items():
                out[k] = out.get(k, 0.0) + x
        return out

    parts = add([c.parts for c in chunks])
    for k in ("bucket_bytes_min", "bucket_bytes_max"):
        if k in parts:
            parts[k] = (min if k.endswith("min") else max)(c.parts.get(k, 0.0) for c in chunks)
    return StagePrice([k for c in chunks for k in c.layers], sum(c.seconds for c in chunks),
                      sum(c.extra for c in chunks), add([c.memory for c in chunks]),
                      sorted(k for c in chunks for k in c.recompute), parts,
                      [b for c in chunks for b in c.buckets], [k for c in chunks for k in c.kept],
                      all(c.grad_buffers_kept for c in chunks))



__all__ = ["price", "split_lower_bound", "step_lower_bound"]
