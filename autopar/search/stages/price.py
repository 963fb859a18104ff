"""One pipeline stage's price under a :class:`~autopar.search.stages.priced.Config`: its time
per micro-batch, its step extras and its memory, with the layers it recomputes and the
ZeRO-3 layers it keeps gathered (:func:`price_stage`; the model is described in
:mod:`autopar.search.stages.pipeline_step`).  The split search (:mod:`autopar.search.stages.split_search`)
calls it for every stage range it considers."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.capture.user_checkpoint import Coverage
from autopar.cost_models import MeshSpec, drift_after
from autopar.plans import schedules as sched
from autopar.plans.decisions import prices, zero_axes
from autopar.search.buckets import BucketPlan
from autopar.search.compression import persistent_bytes
from autopar.search.gathers import ChunkPlan, names_of, stage_chunks
from autopar.search.offload import OffloadPrice, offload_price
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.memory import (
    ParamView,
    gradient_arrivals,
    kept_layers,
    param_views,
    zero_flat_bytes,
)
from autopar.search.stages.peak import StagePeak
from autopar.search.stages.priced import Config, StagePrice
from autopar.search.stages.step_terms import (
    accumulation_seconds,
    copies_hidden,
    count_exposed,
    in_flight,
    split_seconds,
    stage_buckets,
    waiting_w,
)
from autopar.search.stages.zero_price import zero_price


@dataclass(slots=True)
class _Stage:
    """What every part of one stage's price reads: the stage, its config, and the
    per-layer ZeRO, parameter-view and offload prices computed once for it."""

    layers: list[LayerStat]
    index: int
    cfg: Config
    mesh: MeshSpec
    budget: float
    zp: list
    views: list[ParamView]
    off: OffloadPrice


@dataclass(slots=True)
class MicroBatchTime:
    """A stage's seconds per micro-batch, term by term, as :func:`price_stage` adds them."""

    layers: float
    """Every layer's forward and backward with its own collectives (``LayerStat.seconds``)."""
    compute: float
    """The compute share of ``layers``."""
    recompute: float
    """The recomputed layers' forwards, run again in backward."""
    split: float
    """:func:`~autopar.search.stages.step_terms.split_seconds`."""
    gather_mb: float
    """ZeRO-3's gathers in every micro-batch."""
    kept_saves: float
    """The re-gathers that layers kept gathered do not pay."""
    accumulate: float
    """Gradient accumulation between micro-batches."""
    exposed_count: float
    """The loss's token count left exposed beside the forward."""
    offload: float
    """Offload's copies per micro-batch."""
    hidden: float
    """Multi-copy: communication beside the other copy's compute."""
    sends: tuple[float, ...]
    """The pipeline's point-to-point messages, both directions."""
    sliced: bool = False
    """The stage sends its replicated boundary values as slices (``Decisions.sliced_sends``)."""

    seconds: float = field(init=False)
    """The stage's seconds per micro-batch: the terms summed in the order above, which
    the split search's bounds and the recorded plans rely on bit for bit."""

    def __post_init__(self) -> None:
        s = self.layers + self.recompute
        s += self.split
        s += self.gather_mb
        s -= self.kept_saves
        s += self.accumulate + self.exposed_count + self.offload
        s -= self.hidden
        for x in self.sends:
            s += x
        self.seconds = s

    @property
    def comm(self) -> float:
        """Exposed communication per micro-batch, net of what copies hide: every term
        but compute, recomputation and accumulation."""
        return self.seconds - self.compute - self.recompute - self.accumulate


@dataclass(slots=True)
class _Sync:
    """The stage's data-parallel gradient buckets and whether their buffers are kept."""

    plan: BucketPlan | None  # None when the buckets are not priced
    names: list[list[str]]
    extremes: dict[str, float]
    buffers_kept: bool


@dataclass(slots=True)
class StepTail:
    """A stage's seconds once per step, after its micro-batches: nothing overlaps them."""

    sync: float
    """All gradient reduction, mostly hidden under backward."""
    sync_exposed: float
    """What of it the last backward leaves exposed."""
    gather_step: float
    """ZeRO-1/2's gathers of the updated shards (the forward's waits for their chunks
    when they are split)."""
    optimizer_step: float
    """The optimizer's update (offload: the host's step and copies)."""
    copy_step: float
    """Gradients copied into buckets, ZeRO-1/2's layouts."""
    waits: float
    """The ranks' drift, waited out at the last bucket and at ZeRO-1/2's gather."""

    @property
    def seconds(self) -> float:
        """The step's tail (``StagePrice.extra``)."""
        return self.sync_exposed + self.gather_step + self.optimizer_step + self.copy_step + self.waits

    def parts(self) -> dict[str, float]:
        """The tail's terms for the plan summary (``StagePrice.parts``)."""
        return {"sync": self.sync, "sync_exposed": self.sync_exposed, "gather_step": self.gather_step,
                "optimizer_step": self.optimizer_step, "copy_step": self.copy_step}


@dataclass(slots=True)
class _Gathers:
    """ZeRO-1/2's gathers after the step: their exposed seconds, whole and as chosen,
    and the chunks when they are split."""

    step: float
    whole: float
    chunks: ChunkPlan | None
    chunk_bytes: float
    parts: dict[str, float]


@prices("zero_reduce_once", "recompute", "grad_buffers")
def price_stage(layers: list[LayerStat], index: int, cfg: Config, mesh: MeshSpec, pipe_link,
                budget: float, optimizer: str, zp: list | None = None,
                sync: bool = True, views: list[ParamView] | None = None) -> StagePrice:
    """Price stage ``index`` holding ``layers`` (see :mod:`autopar.search.stages.pipeline_step`);
    ``pipe_link(bytes)`` is the time of one point-to-point message between stages;
    ``zp`` the layers' :func:`zero_price` when already computed; ``sync=False`` leaves
    the gradient buckets out (the split search needs only ``seconds`` and memory);
    ``views`` the layers' :func:`param_views` under ``cfg`` when already computed.
    Under the interleaved schedule ``cfg`` counts virtual stages (:func:`price`).
    The returned memory may exceed ``budget`` when nothing fits."""
    if zp is None:
        zp = [zero_price(st, mesh, cfg.zero_stage, cfg.zero_axis, optimizer, cfg.micro_batches,
                         cfg.reduce_once)
              for st in layers]
    if views is None:
        views = param_views(layers, cfg, mesh)
    # offload: state held in host memory instead (search/offload.py)
    off = offload_price(layers, zp, cfg.offload, cfg.zero_stage, cfg.zero_axis, mesh, optimizer,
                        cfg.micro_batches)
    s = _Stage(layers, index, cfg, mesh, budget, zp, views, off)
    # PowerSGD's error feedback: one more copy of what GradSync reduces, all run long
    comp = persistent_bytes(cfg.compression, sum(sum(v.plain_bytes) + sum(v.shards) for v in views)) \
        if cfg.compression != "none" else 0.0
    pk = _stage_peak(s, comp)
    chosen = _recomputed(s, pk)
    # when nothing fits, every candidate stays recomputed: the memory reported is then
    # the least this stage can reach, which the infeasible-budget message quotes
    rc = {st.key for st in chosen}
    # what keeping each layer saves: the re-gather of what backward would re-gather (not
    # the weights only cast under mixed precision: their low-precision copies are saved)
    saves = [z.regather * (b / t) if t else 0.0 for z, t, b in zip(zp, pk.tr, pk.trb)]
    kp = kept_layers([st.key for st in layers], saves, rc, cfg.reshard,
                     lambda ks: pk.total(chosen, ks) <= budget)
    micro = _micro_time(s, chosen, saves, kp, pipe_link)
    grad_sync = _buckets(s, pk, rc, chosen, kp) if sync else _Sync(None, [], {}, False)
    grad_sync = _keep_buffers(s, pk, chosen, kp, grad_sync)
    gathers = _gathers(s, pk, rc, chosen, kp)
    tail = _step_tail(s, grad_sync, gathers)
    parts = {"compute": micro.compute, "recompute": micro.recompute, "accumulate": micro.accumulate,
             "comm": micro.comm, **tail.parts(), **grad_sync.extremes}
    seconds = micro.seconds
    memory = _memory(s, pk, chosen, kp, comp, gathers)
    if off.host > (mesh.host_memory if mesh.host_memory is not None else math.inf):
        seconds = math.inf  # over the host's budget: no plan
    parts["copies_hidden"] = micro.hidden
    parts["gather_hidden"] = gathers.whole - gathers.step
    parts.update(gathers.parts)
    parts["offload_step"] = off.step
    parts["offload_micro"] = off.per_micro
    parts["host_optimizer_step"] = off.host_opt
    return StagePrice([st.key for st in layers], seconds, tail.seconds, memory, sorted(rc), parts,
                      grad_sync.names, [st.key for st in layers if st.key in kp], grad_sync.buffers_kept,
                      off.host,
                      names_of(gathers.chunks), micro.sliced)


def _stage_peak(s: _Stage, comp: float) -> StagePeak:
    """The stage's :class:`StagePeak` (``comp``: PowerSGD's error-feedback bytes)."""
    layers, cfg, zp, off = s.layers, s.cfg, s.zp, s.off
    inflight = in_flight(cfg, s.index)
    # zero-bubble: gradients at the weights' consumers wait from each B to its W
    held_w = waiting_w(cfg, s.index) * sum(st.weight_grad_inputs for st in layers)
    held = sum(z.params + z.optimizer for z in zp) + sum(st.buffers for st in layers) + comp - off.params - off.optimizer
    # gradient memory as backward allocates it (the same whether or not the buckets
    # are priced, so the split search and the chosen split agree)
    arrivals = gradient_arrivals(layers, zp, cfg, s.mesh, views=s.views)
    # ZeRO-3: a layer's whole parameters while it runs (runtime/zero3.py gathers it and
    # prefetches the next); under mixed precision backward keeps a weight's
    # low-precision copy when the weight is only cast, so only the other weights are
    # re-gathered in backward
    tr = [z.transient for z in zp]
    trb = [z.transient * (1.0 - min(1.0, st.cast_param_bytes / v.param_bytes)) if v.param_bytes
           else z.transient for z, st, v in zip(zp, layers, s.views)]
    # the gradients of earlier micro-batches are alive at the activation peak when the
    # stage holds fewer micro-batches than there are: the peak count then recurs after
    # a backward (accumulation, 1F1B's steady state); not when every forward the stage
    # holds at once runs before its first backward (GPipe, 1F1B's first stage at M <= p).
    # Under interleaving a rank's other chunk runs backwards between this one's forwards.
    present = cfg.micro_batches > inflight or (cfg.virtual > 1 and cfg.micro_batches > 1)
    return StagePeak(layers, held, [z.grads for z in zp], tr, trb, present,
                     zero_flat_bytes(layers, cfg, s.views), inflight - 1, held_w, arrivals)


def _recomputed(s: _Stage, pk: StagePeak) -> list[LayerStat]:
    """The layers the stage recomputes: the forced ones (``cfg.recompute``), else the
    fewest best-ratio candidates that fit the budget.  The layers the model checkpoints
    itself stay recomputed (the user asked for that memory); candidates are the other
    layers whose recomputation saves memory, best ratio first."""
    layers, cfg = s.layers, s.cfg
    floor = [st for st in layers if st.checkpointed is not Coverage.NONE and not st.updates_state]
    cands = sorted((st for st in layers if st.activations > st.out_bytes and st.forward > 0
                    and st.checkpointed is Coverage.NONE and not st.updates_state),
                   key=lambda st: -(st.activations - st.out_bytes) / st.forward)
    if sched.conflict(cfg.schedule, True, None):
        cands = floor = []  # a schedule that cannot recompute (zero-bubble): never chosen with a floor
    if cfg.recompute is not None:
        return [st for st in layers if st.key in cfg.recompute or st in floor]
    if pk.total(floor) > s.budget:
        # memory falls as layers are added, so bisect on the count instead of re-pricing
        # every prefix
        lo, hi = 1, len(cands)
        while lo < hi:
            mid = (lo + hi) // 2
            if pk.total(floor + cands[:mid]) <= s.budget:
                hi = mid
            else:
                lo = mid + 1
        return floor + cands[:lo]
    return floor


def _micro_time(s: _Stage, chosen: list[LayerStat], saves: list[float], kp: frozenset[str],
                pipe_link: Callable[[float], float]) -> MicroBatchTime:
    """The stage's :class:`MicroBatchTime` with ``chosen`` recomputed and ``kp`` kept
    gathered (``saves``: each layer's re-gather that keeping it saves)."""
    layers, cfg, mesh = s.layers, s.cfg, s.mesh
    sends: list[float] = []
    sliced = False
    if cfg.stages > 1:
        # receive the activations in and send them on in forward; the reverse in
        # backward; a replicated value whole, or as a slice per rank which the receiving
        # stage all-gathers (and reduce-scatters its gradient), whichever is faster
        if s.index > 0:
            st = layers[0]
            sends.append(2.0 * pipe_link(st.wire_bytes) + st.wire_gather if _sliced(st, pipe_link)
                         else 2.0 * pipe_link(st.out_bytes))
        if s.index < cfg.stages - 1:
            st = layers[-1]
            sliced = _sliced(st, pipe_link)
            sends.append(2.0 * pipe_link(st.wire_bytes if sliced else st.out_bytes))
    return MicroBatchTime(
        layers=sum(st.seconds for st in layers), compute=sum(st.compute for st in layers),
        recompute=sum(st.forward for st in chosen), split=split_seconds(layers, cfg, mesh, s.index),
        gather_mb=sum(z.gather_mb for z in s.zp),
        kept_saves=sum(x for st, x in zip(layers, saves) if st.key in kp),  # nothing re-gathered
        accumulate=accumulation_seconds([z.grads for z in s.zp], cfg.micro_batches, mesh),
        exposed_count=count_exposed(layers, cfg, mesh), offload=s.off.per_micro,
        hidden=copies_hidden(layers, cfg, mesh), sends=tuple(sends), sliced=sliced)


def _sliced(st: LayerStat, pipe_link: Callable[[float], float]) -> bool:
    """Whether the values leaving ``st`` cross a stage boundary faster as one slice per
    rank, gathered (and their gradient reduce-scattered) by the receiving stage, than
    whole from every rank (``Decisions.sliced_sends``)."""
    return 2.0 * pipe_link(st.wire_bytes) + st.wire_gather < 2.0 * pipe_link(st.out_bytes)


def _buckets(s: _Stage, pk: StagePeak, rc: set[str], chosen: list[LayerStat],
             kp: frozenset[str]) -> _Sync:
    """The stage's gradient buckets; ``pk.arrivals`` then counts each chosen bucket
    allocated whole at its first gradient (the split search counted them per layer)."""
    layers, zp, cfg, mesh = s.layers, s.zp, s.cfg, s.mesh
    bp, names, extremes = stage_buckets(layers, zp, rc, cfg, mesh)
    if names:
        bare = pk.total(chosen, kp)
        pk.arrivals = gradient_arrivals(layers, zp, cfg, mesh, names, views=s.views)
        if pk.total(chosen, kp) > s.budget >= bare:
            # the buckets make gradients exist earlier than the per-layer count the
            # split and recomputation were chosen by: a bucket per layer fits as they did
            # (the 4-layer GPT recomputed whole on 4 A100s: 6.6 MB against 6.0 MB)
            bp, names, extremes = stage_buckets(layers, zp, rc, cfg, mesh, per_layer=True)
            pk.arrivals = gradient_arrivals(layers, zp, cfg, mesh, names, views=s.views)
    return _Sync(bp, names, extremes, False)


def _keep_buffers(s: _Stage, pk: StagePeak, chosen: list[LayerStat], kp: frozenset[str],
                  bk: _Sync) -> _Sync:
    """Whether the gradient buffers serve every step: where their memory fits (a new
    buffer and views per bucket, and a DTensor per gradient, cost CPU time each step,
    runtime/grad_sync.py); chosen last, so they never cost a recomputed layer.  Leaves
    ``pk.arrivals`` as the choice allocates the gradients."""
    freed = pk.arrivals
    pk.arrivals = gradient_arrivals(s.layers, s.zp, s.cfg, s.mesh, kept=True, views=s.views)
    # (a stage with nothing to keep keeps vacuously: it does not veto the others)
    kept = s.cfg.keep_buffers is not False and (
        pk.arrivals[2] == 0 or s.cfg.keep_buffers is True or pk.total(chosen, kp) <= s.budget)
    if not kept:
        pk.arrivals = freed
    bk.buffers_kept = kept
    return bk


def _gathers(s: _Stage, pk: StagePeak, rc: set[str], chosen: list[LayerStat],
             kp: frozenset[str]) -> _Gathers:
    """ZeRO-1/2's gathers after the step, split into chunks where ``cfg.split_gathers``
    forces it or where the chunks wait less and their buffers fit the budget."""
    layers, cfg, mesh = s.layers, s.cfg, s.mesh
    gather_step = whole_gather = sum(z.gather_step for z in s.zp)
    chunks = _gather_chunks(layers, cfg, mesh, gather_step)
    chunk_bytes = 0.0
    if chunks is not None:
        total = pk.total(chosen, kp)  # the step's peak
        # a chunk's gathered and send buffers live from the fetch before it to its own,
        # beside the activations of the layers before it (and kept gradient buffers):
        # what that moment holds above the step's peak
        d = math.prod(mesh.shape[a] for a in zero_axes(cfg.zero_axis))
        before = [0.0]
        for st in layers:
            before.append(before[-1] + (st.out_bytes if st.key in rc else st.activations))
        moment = pk.held + pk.arrivals[2] + max(before[k] + b * (1.0 + 1.0 / d)
                                                for k, b in zip(chunks.starts, chunks.sizes))
        chunk_bytes = max(0.0, moment - total)
    split = {"gather_split": chunks.waits, "gather_split_bytes": chunk_bytes} if chunks else {}
    if chunks is not None and (cfg.split_gathers or (
            chunks.waits < gather_step and total + chunk_bytes <= s.budget)):
        gather_step = chunks.waits  # the forward's waits for its chunks
    else:
        chunks = None
    return _Gathers(gather_step, whole_gather, chunks, chunk_bytes, split)


def _step_tail(s: _Stage, bk: _Sync, gathers: _Gathers) -> StepTail:
    """The stage's :class:`StepTail`.  The optimizer updates the stage's parameters once
    per step, after the gradients are reduced and before the next forward; every rank
    waits for the last at the last bucket, after the step's forward and backward, and at
    ZeRO-1/2's gather of the updated shards, after the optimizer: the drift, as a
    blocking collective (docs/architecture.md)."""
    layers, mesh, bp = s.layers, s.mesh, bk.plan
    last = drift_after(mesh, sum(st.seconds for st in layers) * s.cfg.micro_batches)
    waits = last * (bp is not None and bp.busy > 0) + mesh.sync_seconds * (gathers.step > 0)
    return StepTail(sync=bp.busy if bp is not None else 0.0,
                    sync_exposed=bp.exposed if bp is not None else 0.0,
                    gather_step=gathers.step,
                    optimizer_step=sum(z.opt_step for z in s.zp) + s.off.step,
                    copy_step=sum(z.copy_step for z in s.zp), waits=waits)


def _memory(s: _Stage, pk: StagePeak, chosen: list[LayerStat], kp: frozenset[str], comp: float,
            gathers: _Gathers) -> dict[str, float]:
    """The stage's bytes per device by kind: what is resident, and what is alive at the
    peak (gradients only as far as backward has made them)."""
    memory = {"params": sum(z.params for z in s.zp), "optimizer": sum(z.optimizer for z in s.zp),
              "buffers": sum(st.buffers for st in s.layers), **pk.peak(chosen, kp)}
    if comp:
        memory["compression"] = comp
    if gathers.chunks is not None and gathers.chunk_bytes > 0:
        memory["gathers"] = gathers.chunk_bytes
    memory["params"] -= s.off.params
    memory["optimizer"] -= s.off.optimizer
    return memory


def _gather_chunks(layers: list[LayerStat], cfg: Config, mesh: MeshSpec, whole: float):
    """ZeRO-1/2's gathers after the step in chunks (:mod:`autopar.search.gathers`), or
    ``None`` where they cannot run (a pipeline's stages gather in their own first
    forward, which the model does not follow; ``split_gathers=False``)."""
    if not whole or cfg.split_gathers is False or cfg.stages > 1 or cfg.zero_stage not in (1, 2):
        return None
    return stage_chunks(layers, cfg.zero_stage, cfg.zero_axis, mesh)


__all__ = ["MicroBatchTime", "StepTail", "price_stage"]
