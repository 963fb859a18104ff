"""ZeRO's price per layer and micro-batch (:func:`zero_price`): what sharding a layer's
optimizer state, gradients or parameters over some axes saves in memory and costs in
gathers, reduce-scatters and copies (the inputs of :mod:`autopar.search.stages.price`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost_models import (
    MeshSpec,
    all_gather_time,
    all_reduce_time,
    compute_time,
    optimizer_state_bytes,
    optimizer_step_time,
    reduce_scatter_time,
)
from autopar.plans.decisions import prices, zero_axes
from autopar.search.stages.layer_stats import LayerStat, ParamStat


@dataclass(frozen=True)
class ZeroPrice:
    """Per-step time and per-device memory of a layer's parameters under a ZeRO stage."""

    sync: float          # gradient reduction (overlappable with backward)
    gather_step: float   # all-gather after the step (stages 1-2), exposed once per step
    gather_mb: float     # gathers per micro-batch (stage 3: forward + backward re-gather,
    #                      their copies out of the flat buffer and the gradients' into one)
    params: float
    grads: float
    optimizer: float
    transient: float     # whole parameters alive while the layer runs (stage 3)
    zero_sync: float = 0.0  # the part of ``sync`` that ZeRO's own reduce-scatters do
    opt_step: float = 0.0  # the optimizer's update of the parameters this device owns
    copy_step: float = 0.0  # the runtime's copies once per step: memory-bound, exposed
    regather: float = 0.0  # stage 3: the backward's re-gather in ``gather_mb`` (its
    #                        collective, wait and copies), what keeping the layer saves


def on_zero(replicated: tuple[int, ...], stage: int, axis: int | tuple[int, ...] | None) -> bool:
    """True when a parameter replicated on ``replicated`` is under ZeRO ``stage`` over
    ``axis`` (one axis or several): it must be replicated on every one of them."""
    axes = zero_axes(axis)
    return stage > 0 and bool(axes) and set(axes) <= set(replicated)


def grad_bytes(p: ParamStat, mesh: MeshSpec, stage: int, axis: int | tuple[int, ...] | None,
               micro_batches: int = 1, reduce_once: bool = False) -> float:
    """Bytes of ``p``'s gradient once the step's reduction has ended: whole outside ZeRO;
    this rank's part under ZeRO-3, and under ZeRO-1/2 too (runtime/zero.py frees a
    whole gradient once its bucket launches), unless accumulation keeps them whole
    until the last backward (ZeRO-1/2, and ZeRO-3 with ``reduce_once``)."""
    if not on_zero(p.replicated, stage, axis):
        return p.bytes
    if (stage == 3 and not reduce_once) or micro_batches == 1:
        return p.bytes / math.prod(mesh.shape[a] for a in zero_axes(axis))
    return p.bytes


def copied_bytes(nbytes: float, d: int) -> float:
    """Bytes (read + write) the ZeRO runtime's copies move for one parameter of ``nbytes``
    sharded over ``d`` ranks, per gather-and-reduce round: stage 3 per micro-batch
    (:mod:`autopar.runtime.zero3`), stages 1-2 per step (:mod:`autopar.runtime.zero`).

    * the shards concatenated into the all-gather's input, twice (stage 3: forward and
      backward re-gather; stages 1-2: the refresh's one, and the reduced part's clone
      into the shard's gradient): ``2 x 2 x nbytes / d``;
    * the whole parameter taken out of the rank-major gathered buffer, a strided read
      that ``reshape`` copies, twice (stage 3: forward and backward; stages 1-2: the
      refresh's reshape and its ``copy_`` into the parameter the graph reads):
      ``2 x 2 x nbytes``;
    * the gradient laid out rank-major for the reduction (``zero_layout.pack``): ``2 x nbytes``.

    Measured on the GPT of ``benchmarks/cost_fidelity.py`` (4 gloo ranks, ZeRO-3):
    ``aten::copy_`` and ``aten::cat`` took about 15 ms a step more than under data
    parallel, whose gradients are views of their buckets; these bytes at the host's
    calibrated 5.4 GB/s are 15 ms.  FSDP2 makes the same copies (its copy-in and
    copy-out); on a GPU they run at the memory's bandwidth and cost little."""
    return 6.0 * nbytes + 4.0 * nbytes / d


@dataclass
class _ZeroSums:
    """Running sums over a layer's parameters, the terms of its :class:`ZeroPrice`
    (:func:`zero_price` names each)."""

    sync: float = 0.0
    gstep: float = 0.0
    pb: float = 0.0
    gb: float = 0.0
    ob: float = 0.0
    tr: float = 0.0
    zsync: float = 0.0
    step: float = 0.0
    rs: float = 0.0
    """The ZeRO axis's own reduce-scatter (what zero3's backward runs)."""
    moved: float = 0.0
    """Bytes the ZeRO runtime's copies move (:func:`copied_bytes`)."""
    into_bucket: float = 0.0
    """Bytes of the gradients copied into GradSync's buckets."""
    reduced: tuple[int, ...] = ()
    """Stage 1: the axes its all-reduce spans."""


@prices("zero")
def zero_price(stat: LayerStat, mesh: MeshSpec, stage: int, axis: int | tuple[int, ...] | None,
               optimizer: str, micro_batches: int = 1, reduce_once: bool = False) -> ZeroPrice:
    """Price ``stat``'s parameters under ZeRO ``stage`` over sub-mesh ``axis`` for a step
    of ``micro_batches``, as the runtime runs them (:mod:`autopar.runtime.zero`): stages
    1-2 reduce once, after the last micro-batch's backward, so under accumulation stage 2
    keeps whole gradients until then like stage 1; stage 3 reduce-scatters in every
    micro-batch's backward (the gather's backward, :mod:`autopar.runtime.zero3`), so the
    first ``micro_batches - 1`` of them are per micro-batch work (``gather_mb``), unless
    it reduces once a step (``reduce_once``, ``Decisions.zero_reduce_once``): the whole
    gradients accumulated until the last micro-batch's backward, which reduce-scatters
    them."""
    zax = zero_axes(axis)
    z = _ZeroSums(reduced=tuple(zax))
    d = math.prod(mesh.shape[a] for a in zax)  # ranks in the ZeRO group (1 without one)
    for p in stat.params:
        opt = optimizer_state_bytes(p.bytes, optimizer)
        z.gb += grad_bytes(p, mesh, stage, zax, micro_batches, reduce_once)
        if on_zero(p.replicated, stage, zax):
            _add_sharded(z, p, mesh, stage, zax, d, opt)
        else:
            _add_plain(z, p, mesh, opt)
    _add_layer_latency(z, mesh, stage, zax, d)
    # the copies are memory-bound work on the rank's own cores, exposed: data parallel
    # and stages 1-2 make them once per step (a gradient into its bucket in backward,
    # the refresh before the next forward), stage 3 in every micro-batch's forward and
    # backward
    copies = compute_time(mesh, 0.0, z.moved)  # 0.0 where nothing is copied
    once = (copies if stage < 3 else 0.0) + compute_time(mesh, 0.0, z.into_bucket)
    gmb, regather = _stage3_gathers(z, mesh, zax, d, micro_batches, reduce_once, copies) \
        if z.tr else (0.0, 0.0)
    return ZeroPrice(z.sync, z.gstep, gmb, z.pb, z.gb, z.ob, z.tr, z.zsync, z.step, once, regather)


def _add_plain(z: _ZeroSums, p: ParamStat, mesh: MeshSpec, opt: float) -> None:
    """A parameter outside ZeRO: GradSync reduces it where it is replicated; every rank
    holds and steps all of it."""
    if p.replicated:
        # bandwidth only: bucketing pays the latency once per bucket
        z.sync += all_reduce_time(mesh, p.replicated, p.bytes) - all_reduce_time(mesh, p.replicated, 1.0)
        # runtime/grad_sync.py copies the gradient autograd made into its bucket
        # (then ``.grad`` is a view of it), as DDP's reducer does
        z.into_bucket += 2.0 * p.bytes
    z.pb, z.ob = z.pb + p.bytes, z.ob + opt
    z.step += optimizer_step_time(mesh, p.bytes, opt)


def _add_sharded(z: _ZeroSums, p: ParamStat, mesh: MeshSpec, stage: int, zax: tuple[int, ...],
                 d: int, opt: float) -> None:
    """A parameter under ZeRO ``stage`` over ``zax`` (``d`` ranks): its reduction, its
    gather after the step (stages 1-2) and the shard each rank holds and steps."""
    others = tuple(a for a in p.replicated if a not in zax)
    before = z.sync
    if stage == 1:
        # runtime/zero.py all-reduces a stage-1 bucket over the ZeRO axes and the
        # other replicated axes its parameters share, in one collective, and keeps
        # this rank's part (a bucket whose parameters differ in their other axes
        # reduces its part over them apart: priced alike).  On gloo an all-reduce
        # runs faster than its reduce-scatter (4 MiB: 8-10 ms against 13-16 ms
        # calibrated on 4 ranks); on NCCL it moves twice the reduce-scatter's bytes.
        z.reduced = (*zax, *others)
        z.sync += all_reduce_time(mesh, z.reduced, p.bytes) - all_reduce_time(mesh, z.reduced, 1.0)
    else:
        z.sync += reduce_scatter_time(mesh, zax, p.bytes) - reduce_scatter_time(mesh, zax, d)
        z.rs += z.sync - before  # the ZeRO axis's own reduce-scatter (what zero3's backward runs)
        if others:
            z.sync += all_reduce_time(mesh, others, p.bytes / d) - all_reduce_time(mesh, others, 1.0)
    z.zsync += z.sync - before
    if d > 1:
        z.moved += copied_bytes(p.bytes, d)
    if stage < 3:
        # bandwidth only: runtime/zero.py gathers the updated shards in fused 4 MiB
        # buckets (they may span layers); one latency per layer below stands for them,
        # as for the reduction (per parameter, the 69 tensors of a 4-layer GPT
        # cost 90 ms of gloo latency the runtime never pays)
        z.gstep += all_gather_time(mesh, zax, p.bytes) - all_gather_time(mesh, zax, d)
        # the whole parameter the graph reads and the shard the optimizer steps
        z.pb += p.bytes + p.bytes / d
    else:
        z.pb += p.bytes / d
        z.tr += p.bytes  # the layer's whole parameters, gathered together below
    z.ob += opt / d
    z.step += optimizer_step_time(mesh, p.bytes / d, opt / d)  # each rank updates its shard


def _add_layer_latency(z: _ZeroSums, mesh: MeshSpec, stage: int, zax: tuple[int, ...], d: int) -> None:
    """The latencies ZeRO's collectives pay once per layer."""
    if z.zsync and zax:
        # the layer's gradients leave in one reduce-scatter (stage 3, runtime/zero3.py)
        # or a few fused buckets (stages 1-2): one latency per layer, as the data-parallel
        # buckets pay theirs (autopar/search/buckets.py).  Stages 1-2's 4 MiB buckets span
        # layers, so this over-counts small layers (the GPT of cost_fidelity: 6 layers in
        # 2 buckets each way) and under-counts layers over 4 MiB, whose bandwidth term
        # dominates.  (The layer's bytes' share of the buckets' latencies under-counts a
        # small model's one bucket each way, and made ZeRO-2 the unconstrained plan of
        # a small GPT on 4 A100s: a step-level count is what it would take.)
        lat = all_reduce_time(mesh, z.reduced, d) if stage == 1 else reduce_scatter_time(mesh, zax, d)
        z.zsync += lat
        z.sync += lat
        if stage > 1:
            z.rs += lat
    if z.gstep:
        z.gstep += all_gather_time(mesh, zax, d)


def _stage3_gathers(z: _ZeroSums, mesh: MeshSpec, zax: tuple[int, ...], d: int, micro_batches: int,
                    reduce_once: bool, copies: float) -> tuple[float, float]:
    """ZeRO-3's work in every micro-batch (``gather_mb``) and what its backward's
    re-gather costs (``regather``).  Stage 3 gathers a layer's parameters in one
    collective (runtime/zero3.py), in the forward and again in the backward: the latency
    is paid once per layer."""
    tr = z.tr
    gmb = 2.0 * all_gather_time(mesh, zax, tr)
    # the backward's half: its gather and wait, and its copies (the shards into the
    # send buffer and the whole parameters out of the gathered one, copied_bytes)
    regather = gmb / 2.0 + mesh.sync_seconds * (d > 1) + compute_time(mesh, 0.0, 2.0 * tr * (1.0 + 1.0 / d))
    if d > 1:
        # each gather is waited for right before its layer runs, in forward and in
        # backward: every rank waits there for the last to issue it, the drift a
        # blocking collective pays (``mesh.sync_seconds``, collectives.blocking_time).
        # Unpriced, ZeRO-3 of the 4-layer GPT on 4 calibrated gloo ranks measured
        # 0.88 of its price idle and 0.69 with one more busy process (12 gathers a
        # step); priced, 1.02 and 0.90 (docs/benchmarks.md, Cost-model fidelity)
        gmb += 2.0 * mesh.sync_seconds
    # and reduce-scatters their gradients over the ZeRO axis in every micro-batch's
    # backward: the last is the step's gradient sync (``sync``, overlapped like a
    # bucket); the others are spread over the micro-batches here (the step prices
    # ``gather_mb`` M times).  The all-reduce over other replicated axes runs once,
    # after the last backward (GradSync is off before it): it stays in ``sync`` only
    gmb += (0.0 if reduce_once else z.rs * (micro_batches - 1) / micro_batches) + copies
    return gmb, regather


__all__ = ["ZeroPrice", "copied_bytes", "grad_bytes", "on_zero", "zero_price"]
