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

from autopar.cost_models import MeshSpec, drift_after
from autopar.plan import schedules as sched
from autopar.plan.decisions import Schedule
from autopar.search.stages.layer_stats import LayerStat, zero_price
from autopar.search.stages.memory import gradient_arrivals, kept_layers, zero_flat_bytes
from autopar.search.stages.priced import Config, Priced, StagePrice
from autopar.search.stages.step_terms import (
    accumulation_seconds,
    count_exposed,
    in_flight,
    split_seconds,
    stage_buckets,
    stage_link,
    waiting_w,
)


def price_stage(layers: list[LayerStat], index: int, cfg: Config, mesh: MeshSpec, pipe_link,
                budget: float, optimizer: str, zp: list | None = None,
                sync: bool = True) -> StagePrice:
    """Price stage ``index`` holding ``layers`` (see the module docstring);
    ``pipe_link(bytes)`` is the time of one point-to-point message between stages;
    ``zp`` the layers' :func:`zero_price` when already computed; ``sync=False`` leaves
    the gradient buckets out (the split search needs only ``seconds`` and memory).
    Under the interleaved schedule ``cfg`` counts virtual stages (:func:`price`).
    The returned memory may exceed ``budget`` when nothing fits."""
    inflight = in_flight(cfg, index)
    # zero-bubble: gradients at the weights' consumers wait from each B to its W
    held_w = waiting_w(cfg, index) * sum(st.weight_grad_inputs for st in layers)
    if zp is None:
        zp = [zero_price(st, mesh, cfg.zero_stage, cfg.zero_axis, optimizer, cfg.micro_batches,
                         cfg.reduce_once)
              for st in layers]
    held = sum(z.params + z.optimizer for z in zp) + sum(st.buffers for st in layers)
    grads = [z.grads for z in zp]  # per layer, as they are once the step's reduction ends
    # gradient memory as backward allocates it (the same whether or not the buckets
    # are priced, so the split search and the chosen split agree)
    arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh)
    # stage 3: a layer's whole parameters live while it runs, and the next layer's
    # prefetched gather lands meanwhile (runtime/zero3.py): two neighbours at once
    # ZeRO-3: a layer's whole parameters while it runs (runtime/zero3.py gathers it and
    # prefetches the next); under mixed precision backward keeps a weight's
    # low-precision copy when the weight is only cast, so only the other weights are
    # re-gathered in backward
    tr = [z.transient for z in zp]
    trb = [z.transient * (1.0 - min(1.0, st.cast_param_bytes / st.param_bytes)) if st.param_bytes
           else z.transient for z, st in zip(zp, layers)]
    # the gradients of earlier micro-batches are alive at the activation peak when the
    # stage holds fewer micro-batches than there are: the peak count then recurs after
    # a backward (accumulation, 1F1B's steady state); not when every forward the stage
    # holds at once runs before its first backward (GPipe, 1F1B's first stage at M <= p).
    # Under interleaving a rank's other chunk runs backwards between this one's forwards.
    present = cfg.micro_batches > inflight or (cfg.virtual > 1 and cfg.micro_batches > 1)
    flats = zero_flat_bytes(layers, cfg)
    # recompute candidates: layers whose recomputation saves memory, best ratio first
    cands = sorted((st for st in layers if st.activations > st.out_bytes and st.forward > 0),
                   key=lambda st: -(st.activations - st.out_bytes) / st.forward)
    if sched.conflict(cfg.schedule, True, None):
        cands = []  # a schedule that cannot recompute (zero-bubble)
    chosen: list[LayerStat] = []

    def peak(rc: list[LayerStat], kp: frozenset[str] = frozenset()) -> dict[str, float]:
        # The step's peak is the largest of three moments (autopar.runtime.memstats
        # measures them): the forward, each layer's activations so far with ZeRO-3's
        # gather of it and its prefetched successor; backward, swept back to front
        # (it frees a layer's activations as it makes its gradients): the layers
        # before ``k`` keep theirs, layer ``k``'s are whole (re-materialised when
        # recomputed), the gradients of the layers after ``k`` exist, and ZeRO-3 has
        # re-gathered ``k`` and prefetched ``k - 1``; the end of backward: every
        # gradient, ZeRO-1/2's flat buckets and the largest gradient on its way into
        # its data-parallel bucket.  A kept ZeRO-3 layer (``kp``) holds its whole
        # parameters from its forward to its backward, in every micro-batch in flight.
        keys = {st.key for st in rc}
        hold = [trb[k] if layers[k].key in kp else 0.0 for k in range(len(layers))]
        held_before = [0.0]  # the kept layers' bytes before layer k: held_before[k]
        ahead = [0.0] * len(layers)  # what layer k's backward prefetches: the nearest
        last = 0.0  # layer before it that is not kept (runtime/zero3.py), kept ones skipped
        for k, h in enumerate(hold):
            held_before.append(held_before[-1] + h)
            ahead[k], last = last, (last if h else trb[k])
        kept = [st.out_bytes if st.key in keys else st.activations for st in layers]
        n = len(layers)
        # kept gradient buffers are whole from the step's start (``persist``)
        grads_then = sum(grads) if present else persist
        fwd, cum = (0.0, 0.0), 0.0
        for k in range(n):
            cum += kept[k]
            gathered = held_before[k] + tr[k] + (tr[k + 1] if k + 1 < n else 0.0)
            fwd = max(fwd, (cum, gathered), key=sum)
        bwd, before, made = (sum(kept), grads_then, 0.0), sum(kept), grads_then
        for k in reversed(range(n)):
            before -= kept[k]
            live = before + (layers[k].activations if layers[k].key in keys else kept[k])
            gathered = held_before[k] + max(hold[k], trb[k]) + ahead[k]
            bwd = max(bwd, (live, made, gathered), key=sum)
            # layer k's gradients appear as its backward ends, freeing its activations
            made = grads_then if present else made + arrive[k]
        extra = (inflight - 1) * (sum(kept) + sum(hold)) + held_w
        forward = {"activations": fwd[0] + extra, "grads": grads_then, "transient": fwd[1]}
        during = {"activations": bwd[0] + extra, "grads": bwd[1], "transient": bwd[2]}
        end = {"activations": 0.0, "grads": sum(grads), "transient": (trb[0] if n else 0.0) + flats + spike}
        return max((forward, during, end), key=lambda m: sum(m.values()))

    def mem(rc: list[LayerStat], kp: frozenset[str] = frozenset()) -> float:
        return held + sum(peak(rc, kp).values())

    if cfg.recompute is not None:
        chosen = [st for st in layers if st.key in cfg.recompute]
    elif mem([]) > budget:
        # the fewest best-ratio layers that fit: memory falls as layers are added, so
        # bisect on the count instead of re-pricing every prefix
        lo, hi = 1, len(cands)
        while lo < hi:
            mid = (lo + hi) // 2
            if mem(cands[:mid]) <= budget:
                hi = mid
            else:
                lo = mid + 1
        chosen = cands[:lo]
    # when nothing fits, every candidate stays recomputed: the memory reported is then
    # the least this stage can reach, which the infeasible-budget message quotes
    rc = {st.key for st in chosen}
    # what keeping each layer saves: the re-gather of what backward would re-gather (not
    # the weights only cast under mixed precision: their low-precision copies are saved)
    saves = [z.regather * (b / t) if t else 0.0 for z, t, b in zip(zp, tr, trb)]
    kp = kept_layers([st.key for st in layers], saves, rc, cfg.reshard,
                     lambda ks: mem(chosen, ks) <= budget)
    seconds = sum(st.seconds for st in layers) + sum(st.forward for st in chosen)
    seconds += split_seconds(layers, cfg, mesh, index)
    seconds += sum(z.gather_mb for z in zp)
    # a kept layer's backward re-gathers nothing
    seconds -= sum(x for st, x in zip(layers, saves) if st.key in kp)
    accumulate = accumulation_seconds(grads, cfg.micro_batches, mesh)
    seconds += accumulate + count_exposed(layers, cfg, mesh)
    if cfg.stages > 1:
        # receive the activations in and send them on in forward; the reverse in backward
        if index > 0:
            seconds += 2.0 * pipe_link(_in_bytes(layers))
        if index < cfg.stages - 1:
            seconds += 2.0 * pipe_link(layers[-1].out_bytes)
    bp, names, extremes = stage_buckets(layers, zp, rc, cfg, mesh) if sync else (None, [], {})
    if names:
        bare = mem(chosen, kp)  # gradients counted per layer, as the split search counted them
        # the memory reported: each chosen bucket allocated whole at its first gradient
        # (``peak`` reads ``arrive`` when called, below)
        arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh, names)
        if mem(chosen, kp) > budget >= bare:
            # the buckets make gradients exist earlier than the per-layer count the
            # split and recomputation were chosen by: a bucket per layer fits as they did
            # (the 4-layer GPT recomputed whole on 4 A100s: 6.6 MB against 6.0 MB)
            bp, names, extremes = stage_buckets(layers, zp, rc, cfg, mesh, per_layer=True)
            arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh, names)
    # the gradient buffers serve every step where their memory fits (runtime/grad_sync.py:
    # a new buffer and views per bucket, and a DTensor per gradient, cost ~1.5 ms of CPU a
    # step for the 4-layer GPT); chosen last, so they never cost a recomputed layer
    freed = arrive, spike, persist
    arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh, kept=True)
    # (a stage with nothing to keep keeps vacuously: it does not veto the others)
    buffers_kept = cfg.keep_buffers is not False and (
        persist == 0 or cfg.keep_buffers is True or mem(chosen, kp) <= budget)
    if not buffers_kept:
        arrive, spike, persist = freed
    exposed = bp.exposed if bp is not None else 0.0
    gather_step = sum(z.gather_step for z in zp)
    # the optimizer updates the stage's parameters once per step, after the gradients
    # are reduced and before the next forward: nothing overlaps it
    opt_step = sum(z.opt_step for z in zp)
    copy_step = sum(z.copy_step for z in zp)  # gradients into buckets, ZeRO-1/2's layouts
    # every rank waits for the last at the last bucket, after the step's forward and
    # backward, and at ZeRO-1/2's gather of the updated shards, after the optimizer:
    # the drift, as a blocking collective (docs/architecture.md)
    last = drift_after(mesh, sum(st.seconds for st in layers) * cfg.micro_batches)
    waits = last * (bp is not None and bp.busy > 0) + mesh.sync_seconds * (gather_step > 0)
    extra = exposed + gather_step + opt_step + copy_step + waits
    compute = sum(st.compute for st in layers)
    recompute = sum(st.forward for st in chosen)
    parts = {"compute": compute, "recompute": recompute, "accumulate": accumulate,
             "comm": seconds - compute - recompute - accumulate,
             "sync": bp.busy if bp is not None else 0.0, "sync_exposed": exposed,
             "gather_step": gather_step, "optimizer_step": opt_step, "copy_step": copy_step, **extremes}
    # what is alive at the peak: gradients only as far as backward has made them
    memory = {"params": sum(z.params for z in zp), "optimizer": sum(z.optimizer for z in zp),
              "buffers": sum(st.buffers for st in layers), **peak(chosen, kp)}
    return StagePrice([st.key for st in layers], seconds, extra, memory, sorted(rc), parts, names,
                      [st.key for st in layers if st.key in kp], buffers_kept)


def _in_bytes(layers: list[LayerStat]) -> float:
    # what enters the stage is what the previous layer sent; approximated by the
    # first layer's own output size (layers of a stack have equal-sized interfaces)
    return layers[0].out_bytes


def layer_classes(stats: list[LayerStat]) -> list[int]:
    """One id per layer, equal for layers with equal numbers (key and parameter names
    aside): a stage's time and memory depend on its layers' numbers only."""
    ids: dict[tuple, int] = {}
    out = []
    for st in stats:
        k = (st.seconds, st.forward, st.compute, st.activations, st.out_bytes, st.buffers,
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


def _zero_prices(stats: list[LayerStat], cls: list[int], cfg: Config, mesh: MeshSpec,
                 optimizer: str) -> list:
    """Each layer's :func:`zero_price` under ``cfg``; equal layers (``cls``, from
    :func:`layer_classes`) have equal prices, so one per class (80 Llama layers: 3)."""
    per_class: dict[int, object] = {}
    for c, st in zip(cls, stats):
        if c not in per_class:
            per_class[c] = zero_price(st, mesh, cfg.zero_stage, cfg.zero_axis, optimizer,
                                      cfg.micro_batches, cfg.reduce_once)
    return [per_class[c] for c in cls]


def step_lower_bound(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link,
                     optimizer: str) -> float:
    """A lower bound on :func:`price`'s step time for ``cfg`` (interleaved: ``v`` times
    the stage boundaries, the bubble divided by ``v``), in O(layers) instead of
    the split search's O(stages x layers^2): every split's stage times sum to at least
    the layers' own time plus stage-3 gathers plus, per stage boundary, two messages each
    way of the smallest layer output (``total``); the slowest stage takes at least
    ``total / p``; the step's tail at least the average stage's ZeRO-1/2 gather and
    optimizer update; the bubble is what is left of ``total`` less what
    ``mesh.idle_reuse`` wins back.  Recomputation, idle stages and the memory budget only
    add."""
    p, m, v = cfg.stages, cfg.micro_batches, cfg.virtual
    if p * v > len(stats):
        return math.inf
    total = tail = 0.0
    for st, z in zip(stats, _zero_prices(stats, layer_classes(stats), cfg, mesh, optimizer)):
        total += st.seconds + z.gather_mb - z.regather  # at best the layer is kept gathered
        tail += z.gather_step + z.opt_step + z.copy_step
    if p > 1:
        total += 4.0 * (p * v - 1) * pipe_link(min(st.out_bytes for st in stats))
    # the step grows with the slowest stage (m >= 1 >= (1 - idle_reuse) x share), so
    # slow = total / p bounds it from below; interleaving divides the fill and drain by
    # v, zero-bubble leaves a third of it
    slow = total / p
    return m * slow + (total - slow) * (1.0 - mesh.idle_reuse) * bubble_share(cfg) + tail / p


def price(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link, budget: float,
          optimizer: str) -> Priced:
    """Best stage split for ``cfg`` and its step time."""
    if cfg.virtual > 1:
        return _price_interleaved(stats, cfg, mesh, pipe_link, budget, optimizer)
    split, min_mem = _split(stats, cfg, mesh, pipe_link, budget, optimizer)
    if split is None:
        return Priced(cfg, [], math.inf, min_mem)
    return Priced(cfg, split, _step(split, cfg, mesh), max(sp.total_memory for sp in split))


def _step(ranks: list[StagePrice], cfg: Config, mesh: MeshSpec) -> float:
    """The step of pipeline ranks ``ranks``: ``M`` times the slowest, plus the other
    ranks' fill and drain (less what ranks sharing cores win back, and the schedule's
    :func:`bubble_share` of it), plus the slowest tail (exposed sync, gathers, update)."""
    slow = max(sp.seconds for sp in ranks)
    total = sum(sp.seconds for sp in ranks)
    bubble = (total - slow) * (1.0 - mesh.idle_reuse) * bubble_share(cfg)
    return cfg.micro_batches * slow + bubble + max(sp.extra for sp in ranks)


ZERO_BUBBLE_SHARE = 1.0 / 3.0
"""The zero-bubble schedule's bubble over 1F1B's: ``(F + B - W) / (F + B + W)`` with
``B = W = F`` (:func:`autopar.plan.schedules.list_schedule` gives it for equal stages)."""


def bubble_share(cfg: Config) -> float:
    """The part of 1F1B's fill-and-drain the schedule leaves idle: zero-bubble fills
    the drain with deferred weight gradients (a backward of twice the forward, half of
    it for weights in matmul layers, leaves a third); interleaving divides it by ``v``."""
    if cfg.schedule == Schedule.ZERO_BUBBLE.value:
        return ZERO_BUBBLE_SHARE
    return 1.0 / cfg.virtual


def _price_interleaved(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link,
                       budget: float, optimizer: str) -> Priced:
    """Interleaved 1F1B: ``p v`` virtual stages split by the same search, each within
    ``budget / v`` (so a rank's ``v`` chunks fit the budget together: sufficient, not
    necessary); rank ``r`` runs virtual stages ``r, r + p, ..`` and costs their sum per
    micro-batch.  The step is ``M`` times the slowest rank plus the other ranks' fill
    and drain divided by ``v`` (each micro-batch passes a rank in ``v`` shorter
    pieces; :func:`autopar.plan.schedules.list_schedule` gives the same for equal chunks)."""
    p, v = cfg.stages, cfg.virtual
    split, min_mem = _split(stats, dataclasses.replace(cfg, stages=p * v), mesh, pipe_link,
                            budget / v, optimizer)
    if split is None:
        return Priced(cfg, [], math.inf, min_mem * v)
    ranks = [_merge(split[r::p]) for r in range(p)]
    return Priced(cfg, ranks, _step(ranks, cfg, mesh), max(sp.total_memory for sp in ranks),
                  virtual=[sp.layers for sp in split])


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


def _split(stats: list[LayerStat], cfg: Config, mesh: MeshSpec, pipe_link, budget: float,
           optimizer: str) -> tuple[list[StagePrice] | None, float]:
    """The stage split (priced with its buckets) that minimises the slowest stage, then
    the sum, every stage within ``budget``; or None and the least memory a split
    reaches."""
    n, p = len(stats), cfg.stages
    if p > n:
        return None, math.inf
    cache: dict[tuple, StagePrice] = {}
    cls = layer_classes(stats)
    zps = _zero_prices(stats, cls, cfg, mesh, optimizer)
    run_of, runs = _runs(cls)

    def shape_of(i: int, j: int) -> tuple:
        # the range's layers as runs of equal ones, without slicing: the partial first
        # and last runs by (class, length), the full runs between by their index
        r0, r1 = run_of[i], run_of[j - 1]
        if r0 == r1:
            return (cls[i], j - i)
        return (cls[i], runs[r0][1] - i, r0 + 1, r1 - 1, cls[j - 1], j - runs[r1][0])

    def stage(i: int, j: int, s: int, sync: bool = False) -> StagePrice:
        # stages differ only by their in-flight count and whether they send/receive.  The
        # split search reads only time and memory, which ranges of equal layers share (80
        # identical Llama layers: ~330 stage prices per config instead of ~3,400); the
        # chosen split is priced by position, with its layers' names and buckets (sync)
        inflight = in_flight(cfg, s)
        where = (i, j) if sync else shape_of(i, j)
        key = (where, inflight, s == 0, s == cfg.stages - 1, sync)
        if key not in cache:
            cache[key] = price_stage(stats[i:j], s, cfg, mesh, pipe_link, budget, optimizer, zps[i:j],
                                     sync=sync)
        return cache[key]

    # best[s][j]: (slowest stage, sum, split as (start, end) ranges) covering layers
    # [0, j) with s + 1 stages; the split's gradient buckets are priced once at the end
    inf = (math.inf, math.inf, [])
    best = [[inf] * (n + 1) for _ in range(p)]
    def idle(sp: StagePrice) -> bool:
        # a stage without compute (only an embedding lookup's inputs, say) leaves its
        # devices idle: never a pipeline stage of its own
        return p > 1 and sp.parts.get("compute", 0.0) <= 0.0

    # a stage's least memory grows with its range (more parameters, more kept
    # activations, a later peak), so the ranges that fit a stage ending at j are those
    # starting at or after some i: found by bisection, the longer ones never priced
    def first_fit(j: int, s: int) -> int:
        lo, hi = s, j  # hi: nothing fits
        while lo < hi:
            mid = (lo + hi) // 2
            if stage(mid, j, s).total_memory <= budget:
                hi = mid
            else:
                lo = mid + 1
        return lo

    for j in range(1, n - p + 2):
        sp = stage(0, j, 0)
        if sp.total_memory > budget:
            break  # longer first stages hold more
        if not idle(sp):
            best[0][j] = (sp.seconds, sp.seconds, [(0, j)])
    for s in range(1, p):
        for j in range(s + 1, n - (p - s - 1) + 1):
            for i in range(first_fit(j, s), j):
                prev = best[s - 1][i]
                if not math.isfinite(prev[0]):
                    continue
                sp = stage(i, j, s)
                if idle(sp):
                    continue
                cand = (max(prev[0], sp.seconds), prev[1] + sp.seconds, prev[2] + [(i, j)])
                if cand[:2] < best[s][j][:2]:
                    best[s][j] = cand
    slow, total, ranges = best[p - 1][n]
    min_mem = min((sp.total_memory for sp in cache.values()), default=math.inf)
    if not math.isfinite(slow):
        # report the smallest per-device memory any split could reach
        return None, _min_split_memory(stats, cfg, stage, min_mem)
    # priced with their gradient buckets, the stages still fit: price_stage falls back
    # to a bucket per layer where the chosen buckets would not
    return [stage(i, j, s, sync=True) for s, (i, j) in enumerate(ranges)], min_mem


def _min_split_memory(stats, cfg: Config, stage, fallback: float) -> float:
    """Smallest max-stage memory over balanced splits (for the infeasible message)."""
    n, p = len(stats), cfg.stages
    bounds = [round(k * n / p) for k in range(p + 1)]
    try:
        return max(stage(bounds[k], bounds[k + 1], k).total_memory for k in range(p))
    except (ValueError, IndexError):
        return fallback


__all__ = ["Config", "Priced", "StagePrice", "accumulation_seconds", "count_exposed",
           "in_flight", "split_seconds", "stage_buckets", "stage_link", "waiting_w",
           "layer_classes", "price", "price_stage", "step_lower_bound"]
