"""What a pipeline stage's micro-batch pays beyond its layers' own forward and backward
(:func:`autopar.search.stages.price.price_stage` adds them): gradient accumulation, the
in-flight collectives the forward does not hide, zero-bubble's split backward, and the
price of one message between stages; and what shapes a stage's memory and gradient
reduction: the micro-batches it holds at once and its gradient buckets."""

from __future__ import annotations

import functools
from collections.abc import Callable

from autopar.cost_models import MeshSpec, send_recv_time
from autopar.plans import schedules as sched
from autopar.plans.decisions import prices
from autopar.plans.kinds import GradCompression, Schedule
from autopar.search import buckets as bk
from autopar.search.compression import bucket_terms
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.priced import Config


def stage_link(mesh: MeshSpec, stages: int) -> Callable[[float], float]:
    """The time of one point-to-point message between pipeline stages (``pipe_link``),
    on the pipeline axis 0 of ``mesh``; nothing without a pipeline.  Its price after a
    barrier, without ``mesh.sync_seconds``: a receive waits for the sending stage's
    compute, which the schedule already prices (``M`` times the slowest stage plus the
    fill and drain), and a send is asynchronous: charging the drift on each of a stage's
    four messages per micro-batch would price a pipeline over plans it is faster than."""
    if stages <= 1:
        return lambda b: 0.0
    # the split search asks the same few sizes (a layer's output) thousands of times
    return functools.lru_cache(maxsize=256)(lambda b: send_recv_time(mesh, (0,), b))


def split_seconds(layers: list[LayerStat], cfg: Config, mesh: MeshSpec, index: int) -> float:
    """Seconds per micro-batch the zero-bubble schedule's split backward adds to stage
    ``index``: ``(mesh.split_backward - 1)`` times the stage's backward.  Not on the first
    stage, whose ``B`` has no inputs to split at and whose ``W`` runs the whole backward
    (:mod:`autopar.runtime.split_backward`).  Without it zero-bubble is priced under 1F1B
    where the split's two passes make it slower."""
    if cfg.schedule != Schedule.ZERO_BUBBLE.value or index == 0 or cfg.stages == 1:
        return 0.0
    return (mesh.split_backward - 1.0) * sum(st.seconds - st.forward for st in layers)


def accumulation_seconds(grads: list[float], micro_batches: int, mesh: MeshSpec) -> float:
    """Seconds per micro-batch that gradient accumulation adds: every micro-batch after
    the first adds its gradients into the step's (autograd's AccumulateGrad reads both
    and writes the sum), ``grads`` bytes as they are accumulated (whole, or ZeRO-3's
    reduce-scattered shards), at the elementwise rate; spread over the ``M``
    micro-batches, so the step pays ``(M - 1)`` accumulations; without it, micro-batches
    would look free where they are not."""
    if micro_batches <= 1:
        return 0.0
    return mesh.straggler * 3.0 * sum(grads) / mesh.mem_bandwidth * (micro_batches - 1) / micro_batches


@prices("copies")
def copies_hidden(layers: list[LayerStat], cfg: Config, mesh: MeshSpec) -> float:
    """Seconds per micro-batch that multi-copy overlap hides (``cfg.copies`` > 1, the
    micro-batches running as interleaved copies, :mod:`autopar.passes.multi_copy`).  A
    copy's collectives (the layers' edges', forward and backward) run while the other
    copy computes, at ``mesh.overlap`` of their speed (1 on GPUs; on gloo the link
    shares the cores); and a copy waits for its collective after the other copy's
    segment, so the ranks' drift that a blocking collective waits out
    (:attr:`LayerStat.comm_drift`) is waited once for twin collectives: of ``copies``
    twins, ``copies - 1`` wait none; and where the backend runs two collectives of a
    group at once, the twins' latencies overlap by ``mesh.collective_pairing`` (0 on
    NCCL, which runs a communicator's collectives one after the other; calibration
    measures it).  Per micro-batch ``min(comm, overlap x compute + (drift + pairing x
    latency) x (copies - 1) / copies)`` leaves the critical path.  All three terms are
    needed where ranks share cores: compute alone (overlap near 0 on gloo) would hide
    almost nothing of what two copies save (docs/benchmarks.md, Multi-copy overlap)."""
    if cfg.copies < 2:
        return 0.0
    comm = sum(st.seconds - st.compute for st in layers)
    compute = sum(st.compute for st in layers)
    twins = sum(st.comm_drift + mesh.collective_pairing * st.comm_latency for st in layers)
    return max(0.0, min(comm, mesh.overlap * compute + twins * (cfg.copies - 1) / cfg.copies))


def count_exposed(layers: list[LayerStat], cfg: Config, mesh: MeshSpec) -> float:
    """Seconds per micro-batch of the layers' in-flight collectives (``behind``: the
    cross-entropy's token count) that the forward does not hide.  Without a pipeline
    the count starts where the labels are sliced, at the top of the forward
    (passes/localize.py), and runs beside it at ``mesh.overlap`` of its speed, the
    bucket model's terms: ``max(0, A - F x overlap)`` for forward time ``F``.  Under
    pipeline stages it starts at the loss and is waited for at once: all of it.
    Nothing on GPUs (overlap 1); nearly all of it where ranks share cores (a few ms a
    micro-batch on 4 gloo ranks of 2 cores)."""
    behind = sum(st.behind for st in layers)
    if not behind:
        return 0.0
    beside = sum(st.forward for st in layers) if cfg.stages <= 1 else 0.0
    return max(0.0, behind - beside * mesh.overlap)


def stage_buckets(layers: list[LayerStat], zp: list, rc: set[str], cfg: Config, mesh: MeshSpec,
                  per_layer: bool = False) -> tuple[bk.BucketPlan, list[list[str]], dict[str, float]]:
    """The stage's gradient buckets (chosen, ``cfg.bucket_bytes`` each, or ``per_layer``
    one per layer), their timing, and for ``explain`` the exposed reduction with one
    bucket per gradient and with one bucket for all, plus the buckets' smallest and
    largest bytes."""
    # zero-bubble: W writes .grad without the hooks that launch buckets, so every bucket
    # is reduced after the step's last W (runtime/pipeline.py flushes them there)
    # PowerSGD reduces a bucket as it launches, the backward waiting (search/compression.py)
    deferred = (cfg.schedule == Schedule.ZERO_BUBBLE.value and cfg.stages > 1) or \
        cfg.compression == GradCompression.POWERSGD.value
    kind = cfg.compression
    terms = None if kind == GradCompression.NONE.value else \
        functools.partial(bucket_terms, kind=kind, rank=cfg.rank, mesh=mesh)
    items, backward = bk.stage_items(layers, zp, rc, cfg.zero_stage, cfg.zero_axis, deferred, terms)
    if per_layer:
        layer_of = {q.name: k for k, st in enumerate(layers) for q in st.params}
        bp = bk.simulate(items, bk.per_layer(items, layer_of), mesh, backward, kind)
    elif cfg.bucket_bytes is None:
        bp = bk.optimal(items, mesh, backward, kind)
    else:
        bp = bk.simulate(items, bk.fixed_size(items, cfg.bucket_bytes), mesh, backward, kind)
    sizes = [sum(x.bytes for x in items[i:j]) for i, j in bp.cuts if items[i].fixed is None]
    extremes = {
        "sync_exposed_per_gradient": bk.simulate(items, bk.per_gradient(items), mesh, backward, kind).exposed,
        "sync_exposed_one_bucket": bk.simulate(items, bk.one_bucket(items), mesh, backward, kind).exposed,
        "sync_bytes": sum(x.bytes for x in items if x.fixed is None),
        "sync_wire_bytes": sum(x.bytes if x.wire is None else x.wire for x in items if x.fixed is None),
        "bucket_bytes_min": min(sizes, default=0.0), "bucket_bytes_max": max(sizes, default=0.0)}
    return bp, bp.names(items), extremes


ZERO_BUBBLE_SHARE = 1.0 / 3.0
"""The zero-bubble schedule's bubble over 1F1B's: ``(F + B - W) / (F + B + W)`` with
``B = W = F`` (:func:`autopar.plans.schedules.list_schedule` gives it for equal stages)."""


def bubble_share(cfg: Config) -> float:
    """The part of 1F1B's fill-and-drain the schedule leaves idle: zero-bubble fills
    the drain with deferred weight gradients (a backward of twice the forward, half of
    it for weights in matmul layers, leaves a third); interleaving divides it by ``v``."""
    if cfg.schedule == Schedule.ZERO_BUBBLE.value:
        return ZERO_BUBBLE_SHARE
    return 1.0 / cfg.virtual


def in_flight(cfg: Config, index: int) -> int:
    """Micro-batches whose activations stage ``index`` keeps at once: 1 without a
    pipeline, ``M`` under GPipe, ``min(p - s, M)`` under 1F1B; under zero-bubble and
    interleaved 1F1B (where ``index`` is a virtual stage, its chunk's) the count the
    schedule's own order gives (:func:`autopar.plans.schedules.in_flight`)."""
    if cfg.stages == 1:
        return 1
    if cfg.schedule == Schedule.GPIPE.value:
        return cfg.micro_batches
    if cfg.virtual > 1 or cfg.schedule == Schedule.ZERO_BUBBLE.value:
        ranks = cfg.stages // cfg.virtual
        table = sched.in_flight_table(cfg.schedule, ranks, cfg.micro_batches, cfg.virtual)
        return table[index % ranks][index // ranks]
    return min(cfg.stages - index, cfg.micro_batches)


def waiting_w(cfg: Config, index: int) -> int:
    """Zero-bubble: the most micro-batches stage ``index`` holds between their ``B`` and
    ``W`` (:func:`autopar.plans.schedules.waiting_w`); 0 for the other schedules."""
    if cfg.schedule != Schedule.ZERO_BUBBLE.value or index == 0:
        # the first stage has no input gradients to split at: its B does nothing and
        # its W runs the whole backward (runtime/split_backward.py), holding no more
        return 0
    return sched.waiting_w(cfg.stages, cfg.micro_batches)[index]


__all__ = ["ZERO_BUBBLE_SHARE", "accumulation_seconds", "bubble_share", "copies_hidden", "count_exposed", "in_flight", "split_seconds", "stage_buckets",
           "stage_link", "waiting_w"]
