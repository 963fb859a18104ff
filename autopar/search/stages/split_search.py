"""The pipeline split search: the stage boundaries of one :class:`Config` that minimise
the slowest stage (then the sum), every stage within the memory budget
(:func:`split`, a dynamic program over layer ranges; :mod:`autopar.search.stages.pipeline_step`
prices its answer).

Two things keep it cheap without changing its answer:

* ranges of equal layers (:func:`layer_classes`) share one stage price, and a stage's
  least memory grows with its range, so the ranges that fit a stage ending at ``j`` are
  found from the shortest down (the longer ones are never priced);
* given the step time of a plan already in hand (``cut``), a partial split is dropped
  before its stage is priced when a bound on every step it can lead to is over the cut
  (:func:`_step_floor`): the step grows with the slowest stage, and the rest of it (the
  bubble, the tail) is bounded from the layers' floors (:func:`stage_floors`), which no
  stage goes below.  The bound depends on the partial split's slowest stage only, which
  the program's order (slowest stage first, then the sum) ranks first, so each state
  keeps either the partial split pricing every range gives it or none; a split within
  the cut is therefore found exactly as without one (same boundaries, same ties), and
  when every split is over it the config is reported bounded (:attr:`SplitResult.bound`)
  instead of priced.  (A bound on the sum as well would be tighter but could leave a
  state a partial split the full program does not keep there, and change its answer.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.cost_models import MeshSpec
from autopar.cost_models.memo import IdentityMemo
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.memory import param_views
from autopar.search.stages.price import price_stage
from autopar.search.stages.priced import Config, StagePrice
from autopar.search.stages.step_terms import bubble_share, in_flight, waiting_w
from autopar.search.stages.zero_price import zero_price

# relative slack on the bound comparisons: a bound is summed in another order than the
# value it bounds (as the joint search's own bounds compare)
SLACK = 1e-9


# the search asks for the same statistics' classes and ZeRO prices for every config of
# a candidate (Megatron 145.6B: 33k times for ~300 lists); the lists are not changed
# once built, so they are remembered by identity (autopar.cost_models.memo)
_CLASSES = IdentityMemo(1024)
_ZERO_PRICES = IdentityMemo(4096)
_SLOWEST = IdentityMemo(4096)


def layer_classes(stats: list[LayerStat]) -> list[int]:
    """One id per layer, equal for layers with equal numbers (key and parameter names
    aside): a stage's time and memory depend on its layers' numbers only."""
    return _CLASSES.get((stats,), None, lambda: _layer_classes(stats))


def _layer_classes(stats: list[LayerStat]) -> list[int]:
    """:func:`layer_classes`, computed."""
    ids: dict[tuple, int] = {}
    out = []
    for st in stats:
        k = (st.seconds, st.forward, st.compute, st.activations, st.out_bytes, st.wire_bytes,
             st.wire_gather, st.buffers,
             st.weight_grad_inputs,
             tuple((q.bytes, q.replicated) for q in st.params))
        out.append(ids.setdefault(k, len(ids)))
    return out


def _runs(cls: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """(run index of each layer, (start, end) of each run of equal consecutive ids)."""
    run_of, runs = [], []
    for k, c in enumerate(cls):
        if not runs or cls[runs[-1][0]] != c:
            runs.append((k, k + 1))
        else:
            runs[-1] = (runs[-1][0], k + 1)
        run_of.append(len(runs) - 1)
    return run_of, runs


def zero_prices(stats: list[LayerStat], cls: list[int], cfg: Config, mesh: MeshSpec,
                optimizer: str) -> list:
    """Each layer's :func:`zero_price` under ``cfg``; equal layers (``cls``, from
    :func:`layer_classes`) have equal prices, so one per class (80 Llama layers: 3)."""
    axis = tuple(cfg.zero_axis) if isinstance(cfg.zero_axis, list) else cfg.zero_axis
    return _ZERO_PRICES.get(
        (stats, cls, mesh),
        (cfg.zero_stage, axis, optimizer, cfg.micro_batches, cfg.reduce_once),
        lambda: _zero_prices(stats, cls, cfg, mesh, optimizer))


def _zero_prices(stats: list[LayerStat], cls: list[int], cfg: Config, mesh: MeshSpec,
                 optimizer: str) -> list:
    """:func:`zero_prices`, computed."""
    per_class: dict[int, object] = {}
    for c, st in zip(cls, stats):
        if c not in per_class:
            per_class[c] = zero_price(st, mesh, cfg.zero_stage, cfg.zero_axis, optimizer,
                                      cfg.micro_batches, cfg.reduce_once)
    return [per_class[c] for c in cls]


def stage_floors(stats: list[LayerStat], zps: list) -> list[float]:
    """Per layer, the least it adds to any stage's seconds per micro-batch
    (:func:`price_stage`): its own time, plus its ZeRO-3 gathers less the backward
    re-gather (keeping the layer gathered saves at most that); recomputation,
    accumulation, messages and the zero-bubble split only add."""
    return [st.seconds + z.gather_mb - z.regather for st, z in zip(stats, zps)]


def slowest_floor(stats: list[LayerStat], zps: list, parts: int) -> float:
    """A lower bound on the slowest stage of any split of ``stats`` into ``parts``
    stages: the least largest sum of layer floors (:func:`stage_floors`) over the splits
    into at most ``parts`` ranges.  Whole layers rarely balance: 80 equal layers on 24
    stages put 4 on some stage, 20% over the average that ``total / parts`` bounds
    (Megatron 145.6B's deep pipelines were priced in full only to lose by that).
    Remembered per ``zps`` (:func:`zero_prices`' lists are built once per config)."""
    return _SLOWEST.get((stats, zps), parts, lambda: balanced_floor(stage_floors(stats, zps), parts))


def balanced_floor(floors: list[float], parts: int) -> float:
    """Just under the least largest sum of any split of ``floors`` into at most ``parts``
    contiguous ranges (``-inf`` when a floor is negative): bisection on that sum, a
    greedy count of the ranges it needs (the fewest for nonnegative floors), the
    infeasible end returned less :data:`SLACK` (the greedy sums in another order than
    the stages do)."""
    if not floors or min(floors) < 0.0:
        return -math.inf  # the greedy count is not the fewest: no bound
    # runs of equal floors (a stack of identical layers is one run): the greedy packs a
    # run's layers into a range at once, O(runs + ranges) per count instead of O(layers)
    # (the bisection counts ~40 times per call, and the search calls it per config)
    runs: list[list] = []
    for f in floors:
        if runs and runs[-1][0] == f:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])

    def ranges(x: float) -> int:
        count, run = 1, 0.0
        for f, c in runs:
            if f > x:
                return parts + 1
            if f <= 0.0:
                continue  # nothing to add
            # as many as fit on top of the open range, then whole ranges of ``m`` each
            # and the rest in a new one (products round unlike the sums, by far less
            # than SLACK)
            k = min(c, max(1, int((x - run) / f))) if run + f <= x else 0
            run, c = run + k * f, c - k
            if c:
                m = max(1, int(x / f))
                full, rest = divmod(c, m)
                count += full + (rest > 0)
                run = (rest or m) * f
                if count > parts:
                    return count
        return count

    lo, hi = max(max(floors), sum(floors) / parts), sum(floors)
    if ranges(lo) > parts:
        for _ in range(64):  # lo: too small for ``parts`` ranges; hi: enough
            mid = 0.5 * (lo + hi)
            if ranges(mid) <= parts:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-12 * hi:
                break
    return lo * (1.0 - SLACK)


def _step_floor(stats: list[LayerStat], zps: list, cfg: Config, mesh: MeshSpec, pipe_link,
                total: float, limit: float):
    """The least step any split of ``cfg`` whose slowest stage takes ``x`` can have, as a
    function of ``x`` (nondecreasing, so a partial split whose slowest stage is already
    ``x`` bounds every split it extends).  :func:`autopar.search.stages.pipeline_step.price`'s step is
    ``(M - c) x slowest rank + c x sum of the stages + the largest tail`` with ``c`` the
    bubble's coefficient (at most 1, so at most ``M``): the stages sum to at least every
    layer's floor (``total``) plus two messages each way at each boundary, a rank takes
    at least its share of that sum, and the largest tail is at least the average
    stage's ZeRO-1/2 gathers, optimizer update and copies, and the slowest stage at
    least :func:`slowest_floor`.  Under the interleaved schedule ``cfg.stages`` counts
    virtual stages and a rank takes at least its slowest chunk.

    Returned with ``(lo, hi)``: the function is ``<= limit`` for every ``x <= lo`` and
    ``> limit`` for every ``x > hi`` (between them, ask it).  The split search asks
    millions of times, mostly far from the limit, where a comparison answers for the
    call."""
    p, v, m = cfg.stages, cfg.virtual, cfg.micro_batches
    ranks = p // v
    if p > 1:
        total += 4.0 * (p - 1) * pipe_link(min(st.wire_bytes for st in stats)) * (1.0 - SLACK)
    tail = sum(z.gather_step + z.opt_step + z.copy_step for z in zps) * (1.0 - SLACK) / ranks
    c = (1.0 - mesh.idle_reuse) * bubble_share(cfg) if p > 1 else 0.0
    share = max(total / ranks, slowest_floor(stats, zps, p))

    def least(x: float) -> float:
        return (m - c) * max(x, share) + c * total + tail

    slope, base = m - c, c * total + tail  # the thresholds' terms; least sums as it did

    if not math.isfinite(limit):
        return least, math.inf, math.inf
    if slope <= 0.0:
        return least, -math.inf, math.inf
    if least(share) > limit:
        return least, -math.inf, -math.inf  # every x is over
    x = (limit - base) / slope
    eps = 1e-12 * (abs(x) + (abs(limit) + abs(base)) / slope)  # far over any rounding
    return least, x - eps, x + eps


def _may_fit(stats: list[LayerStat], zps: list, inflight: list[int], budget: float) -> bool:
    """False when no split of ``stats`` into ``len(inflight)`` stages can fit ``budget``
    (True says nothing).  A stage's memory (:func:`price_stage`) is at least what it
    holds (parameters, optimizer state, buffers) plus the larger of two of its peak's
    moments, each bounded from below by a sum over its layers: the forward's end, where
    it keeps every layer's activations, or at least their smaller of activations and
    output (recomputed), for each micro-batch in flight; and the end of backward, every
    gradient.  These grow with the stage's range, so taking the longest range that fits
    this bound for each stage in turn covers the most layers any split can: when that
    leaves layers over, nothing fits (the full search would price every range to find
    that out: two thirds of the configs Megatron 145.6B's search found not to fit)."""
    held = [z.params + z.optimizer + st.buffers for st, z in zip(stats, zps)]
    least = [min(st.activations, st.out_bytes) for st in stats]
    n, i = len(stats), 0
    for k in inflight:
        h = a = g = 0.0
        j = i
        while j < n:
            h2, a2, g2 = h + held[j], a + least[j], g + zps[j].grads
            if (h2 + max(k * a2, g2)) * (1.0 - SLACK) > budget:
                break
            h, a, g, j = h2, a2, g2, j + 1
        if j == i:
            return False  # not even one layer fits this stage
        i = j
        if i == n:
            return True
    return False


@dataclass
class SplitResult:
    """What :func:`split` found: the chosen stages priced with their gradient buckets
    (``None`` when no split fits or every split is over the cut), the least memory a
    split reaches (for the message when none fits), and ``bound``, set when splits
    within the budget may exist but each takes at least ``bound`` per step, over the cut."""

    stages: list[StagePrice] | None
    min_memory: float
    bound: float | None = None


def split(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link, budget: float,
          optimizer: str, cut: float = math.inf,
          step: Callable[[list[StagePrice]], float] | None = None) -> SplitResult:
    """The stage split (priced with its buckets) that minimises the slowest stage, then
    the sum, every stage within ``budget`` (see the module docstring); splits whose step
    must exceed ``cut`` are not searched.  ``step``: the step of a split's stages (as
    :func:`autopar.search.stages.pipeline_step.price` takes it); the chosen split's step without
    its gradient buckets, which only add exposed sync to a stage's tail, bounds it, so
    a split over the cut is bounded before its buckets are planned (planning them was
    half of pricing an interleaved config that then lost)."""
    if cfg.stages > len(stats):
        return SplitResult(None, math.inf)
    sr = _SplitSearch.start(stats, cfg, mesh, pipe_link, budget, optimizer, cut)
    # (the bound counts what the layers hold on the device: not under offload)
    if cfg.offload == "none" and not _may_fit(stats, sr.zps, sr.inflight, budget):
        return SplitResult(None, _min_split_memory(stats, cfg, sr.stage, math.inf))
    if cfg.stages == 1:
        return sr.one_stage()
    return sr.result(sr.table(), step)


@dataclass
class _SplitSearch:
    """One config's split search: what every stage price shares (the layers' classes,
    ZeRO prices and parameter views), the stage prices taken so far, the step bound
    against the cut (:func:`_step_floor`) and the least slowest stage of the partial
    splits it dropped."""

    stats: list[LayerStat]
    cfg: Config
    mesh: MeshSpec
    pipe_link: Callable[[float], float]
    budget: float
    optimizer: str
    cls: list[int]
    zps: list
    views: list
    run_of: list[int]
    runs: list[tuple[int, int]]
    inflight: list[int]
    waiting: list[int]
    pre: list[float]
    """Prefix sums of the layers' floors (:func:`stage_floors`)."""
    mag: list[float]
    """Prefix sums of their magnitudes (the slack on a difference of two of ``pre``)."""
    limit: float
    least: Callable[[float], float]
    lo: float
    hi: float
    cache: dict[tuple, StagePrice] = field(default_factory=dict)
    pruned: float = math.inf

    @classmethod
    def start(cls, stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link, budget: float,
              optimizer: str, cut: float) -> _SplitSearch:
        """The search for ``cfg`` over ``stats``, nothing priced yet."""
        classes = layer_classes(stats)
        zps = zero_prices(stats, classes, cfg, mesh, optimizer)
        views = param_views(stats, cfg, mesh, classes)
        run_of, runs = _runs(classes)
        p = cfg.stages
        pre, mag = [0.0], [0.0]
        for f in stage_floors(stats, zps):
            pre.append(pre[-1] + f)
            mag.append(mag[-1] + abs(f))
        limit = cut * (1.0 + SLACK)
        n = len(stats)
        least, lo, hi = _step_floor(stats, zps, cfg, mesh, pipe_link, pre[n] - SLACK * mag[n], limit)
        return cls(stats, cfg, mesh, pipe_link, budget, optimizer, classes, zps, views, run_of, runs,
                   [in_flight(cfg, s) for s in range(p)], [waiting_w(cfg, s) for s in range(p)],
                   pre, mag, limit, least, lo, hi)

    def shape_of(self, i: int, j: int) -> tuple:
        """The range's layers as runs of equal ones, without slicing: the partial first
        and last runs by (class, length), the full runs between by their index."""
        cls, runs = self.cls, self.runs
        r0, r1 = self.run_of[i], self.run_of[j - 1]
        if r0 == r1:
            return (cls[i], j - i)
        return (cls[i], runs[r0][1] - i, r0 + 1, r1 - 1, cls[j - 1], j - runs[r1][0])

    def stage(self, i: int, j: int, s: int, sync: bool = False) -> StagePrice:
        """Stage ``s`` holding layers ``[i, j)``.  Stages differ only by their in-flight
        count and whether they send/receive.  The split search reads only time and
        memory, which ranges of equal layers share (80 identical Llama layers: ~330
        stage prices per config instead of ~3,400); the chosen split is priced by
        position, with its layers' names and buckets (``sync``)."""
        p = self.cfg.stages
        where = (i, j) if sync else self.shape_of(i, j)
        key = (where, self.inflight[s], self.waiting[s], s == 0, s == p - 1, sync)
        if key not in self.cache:
            self.cache[key] = price_stage(self.stats[i:j], s, self.cfg, self.mesh, self.pipe_link,
                                          self.budget, self.optimizer, self.zps[i:j], sync=sync,
                                          views=self.views[i:j])
        return self.cache[key]

    def idle(self, sp: StagePrice) -> bool:
        """A stage without compute (only an embedding lookup's inputs, say) leaves its
        devices idle: never a pipeline stage of its own."""
        return self.cfg.stages > 1 and sp.parts.get("compute", 0.0) <= 0.0

    def one_stage(self) -> SplitResult:
        """One stage holds every layer: only that range is priced (the program would
        price every prefix first, and they fit whenever the whole does)."""
        n = len(self.stats)
        sp = self.stage(0, n, 0)
        if sp.total_memory > self.budget:
            return SplitResult(None, sp.total_memory)
        if self.least(sp.seconds) > self.limit:
            return SplitResult(None, math.inf, bound=self.least(sp.seconds))
        return SplitResult([self.stage(0, n, 0, sync=True)], sp.total_memory)

    def table(self) -> list[list[tuple[float, float, int]]]:
        """``best[s][j]``: (slowest stage, sum, where the last stage starts) covering
        layers ``[0, j)`` with ``s + 1`` stages; the split's gradient buckets are priced
        once at the end."""
        n, p = len(self.stats), self.cfg.stages
        inf = (math.inf, math.inf, -1)
        best = [[inf] * (n + 1) for _ in range(p)]
        for j in range(1, n - p + 2):
            sp = self.stage(0, j, 0)
            if sp.total_memory > self.budget:
                break  # longer first stages hold more
            if self.idle(sp):
                continue
            if self.least(sp.seconds) > self.limit:
                self.pruned = min(self.pruned, sp.seconds)
                continue
            best[0][j] = (sp.seconds, sp.seconds, 0)
        for s in range(1, p):
            reach = [i for i in range(s, n + 1) if math.isfinite(best[s - 1][i][0])]
            if not reach:
                break  # no partial split reaches this stage: nothing fits (or all were cut)
            for j in range(s + 1, n - (p - s - 1) + 1):
                self._extend(best, s, j, reach)
        return best

    def _extend(self, best: list[list[tuple[float, float, int]]], s: int, j: int,
                reach: list[int]) -> None:
        """``best[s][j]``: the partial splits in ``best[s - 1]`` (those ``reach``
        lists) extended by a stage ``s`` ending at ``j``.  (A partial split is dropped
        when every split it leads to must be over the cut (``lo``/``hi``
        answer most without asking ``least``).)"""
        row, pre, mag = best[s - 1], self.pre, self.mag
        lo, hi, least, limit = self.lo, self.hi, self.least, self.limit
        # the states this stage can extend within the cut (a state's slowest stage
        # is within it already; the stage's floor may not be)
        ext = []
        pj, mj = pre[j], mag[j]
        for i in reach:
            if i >= j:
                break
            low = max(row[i][0], pj - pre[i] - SLACK * (mj - mag[i]))  # the stage floor(i, j)
            if low > lo and (low > hi or least(low) > limit):
                self.pruned = min(self.pruned, low)
            else:
                ext.append(i)
        # a stage's least memory grows with its range (more parameters, more kept
        # activations, a later peak), so the ranges that fit a stage ending at j are
        # those starting at or after some i: found from the shortest down, the longer
        # ones never priced
        fit = len(ext)
        while fit and self.stage(ext[fit - 1], j, s).total_memory <= self.budget:
            fit -= 1
        for i in ext[fit:]:
            prev = row[i]
            sp = self.stage(i, j, s)
            if self.idle(sp):
                continue
            cand = (max(prev[0], sp.seconds), prev[1] + sp.seconds, i)
            if cand[0] > lo and (cand[0] > hi or least(cand[0]) > limit):
                self.pruned = min(self.pruned, cand[0])
                continue
            if cand[:2] < best[s][j][:2]:
                best[s][j] = cand

    def result(self, best: list[list[tuple[float, float, int]]],
               step: Callable[[list[StagePrice]], float] | None) -> SplitResult:
        """The split ``best`` ends with, priced with its gradient buckets; or why none."""
        n, p = len(self.stats), self.cfg.stages
        slow, _, _ = best[p - 1][n]
        ranges, j = [], n
        for s in range(p - 1, -1, -1) if math.isfinite(slow) else ():
            i = best[s][j][2]
            ranges.append((i, j))
            j = i
        ranges.reverse()
        min_mem = min((sp.total_memory for sp in self.cache.values()), default=math.inf)
        if not math.isfinite(slow):
            if math.isfinite(self.pruned):
                # every split within the budget was cut: each takes at least this
                return SplitResult(None, math.inf, bound=self.least(self.pruned))
            # report the smallest per-device memory any split could reach
            return SplitResult(None, _min_split_memory(self.stats, self.cfg, self.stage, min_mem))
        if step is not None and math.isfinite(self.limit):
            bare = step([self.stage(i, j, s) for s, (i, j) in enumerate(ranges)])
            if bare > self.limit:
                return SplitResult(None, min_mem, bound=bare)
        # priced with their gradient buckets, the stages still fit: price_stage falls back
        # to a bucket per layer where the chosen buckets would not
        return SplitResult([self.stage(i, j, s, sync=True) for s, (i, j) in enumerate(ranges)], min_mem)


def _min_split_memory(stats, cfg: Config, stage, fallback: float) -> float:
    """Smallest max-stage memory over balanced splits (for the infeasible message)."""
    n, p = len(stats), cfg.stages
    bounds = [round(k * n / p) for k in range(p + 1)]
    try:
        return max(stage(bounds[k], bounds[k + 1], k).total_memory for k in range(p))
    except (ValueError, IndexError):
        return fallback


__all__ = ["SLACK", "SplitResult", "balanced_floor", "layer_classes", "slowest_floor", "split", "stage_floors", "zero_prices"]
