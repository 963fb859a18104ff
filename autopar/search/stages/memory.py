"""Where a stage's gradient memory comes from, for :func:`autopar.search.stages.dp.price_stage`'s
peak: when backward allocates each layer's gradients (a bucket's buffer is whole at its
first gradient, or there from the step's start when the buffers are kept between steps,
runtime/grad_sync.py), and ZeRO-1/2's flat reduce buckets at the end of backward
(runtime/zero.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from autopar.cost_models import MeshSpec
from autopar.plan.decisions import zero_axes
from autopar.runtime.grad_sync import fill_buckets
from autopar.search.stages.layer_stats import LayerStat, grad_bytes, on_zero

if TYPE_CHECKING:
    from autopar.search.stages.dp import Config


def gradient_arrivals(layers: list[LayerStat], zp: list, cfg: Config, mesh: MeshSpec,
                      buckets: list[list[str]] | None = None,
                      kept: bool = False) -> tuple[list[float], float, float]:
    """Per layer, the gradient bytes that exist once its backward has run and not
    before: its own gradients (``zp``'s), except that ZeRO-3 shards reduced over other
    axes go in BUCKET_BYTES buckets, back to front, each allocated whole at its first
    gradient, in the last layer holding one (runtime/grad_sync.py makes ``.grad`` views
    of a bucket).  The plan's own data-parallel buckets (``buckets``: parameter names,
    as :attr:`~autopar.plan.Decisions.grad_buckets`) do the same; they are chosen after
    the split, so the split search counts those gradients per layer, and the chosen
    split's price passes its buckets (one bucket for all: every gradient exists from
    the first, 1.18x the per-layer count measured on 4 ranks).  Also the largest gradient
    going into a bucket: autograd makes it in a tensor of its own, alive beside the
    bucket until it is copied in.  With ``kept`` (the buffers serve every step,
    :attr:`~autopar.plan.Decisions.grad_buffers_kept`) every gradient GradSync reduces
    exists from the start of the step, whole: returned third (0 without ``kept``) and
    left out of the arrivals."""
    out = [z.grads for z in zp]
    zax = zero_axes(cfg.zero_axis)

    def nbytes(q) -> float:  # as zero_price counts the gradient
        return grad_bytes(q, mesh, cfg.zero_stage, zax, cfg.micro_batches, cfg.reduce_once)

    params = [(i, q) for i in reversed(range(len(layers))) for q in reversed(layers[i].params)]
    # what GradSync reduces: replicated parameters outside ZeRO, and ZeRO-3 shards
    # replicated on other axes too (ZeRO-1/2 reduce those themselves, per bucket: runtime/zero.py)
    plain = [(i, q) for i, q in params if q.replicated and not on_zero(q.replicated, cfg.zero_stage, zax)]
    shards = [(i, q) for i, q in params if cfg.zero_stage == 3 and on_zero(q.replicated, 3, zax)
              and set(q.replicated) - set(zax)]
    synced = plain + shards
    spike = max((nbytes(q) for _, q in synced), default=0.0)
    if kept:
        for i, q in synced:
            out[i] -= nbytes(q)
        return out, spike, sum(nbytes(q) for _, q in synced)
    groups = fill_buckets(shards, lambda iq: nbytes(iq[1]))
    if buckets:
        where = {q.name: (i, q) for i, q in plain if q.name}
        groups += [[where[n] for n in names if n in where] for names in buckets]
    for g in groups:
        if not g:
            continue
        for i, q in g:
            out[i] -= nbytes(q)
        out[max(i for i, _ in g)] += sum(nbytes(q) for _, q in g)
    return out, spike, 0.0


def zero_flat_bytes(layers: list[LayerStat], cfg: Config) -> float:
    """ZeRO-1/2: the most bytes of flat reduce buckets alive at once at the end of
    backward.  The runtime (runtime/zero.py) cuts the ZeRO axis's gradients, back to
    front, into buckets of BUCKET_BYTES and keeps two in flight: bucket ``i``'s flat
    copy exists beside bucket ``i - 1``'s, and with one micro-batch the whole gradients
    of bucket ``i`` too, until it launches (gradients are counted sharded then; under
    accumulation they are whole until the last backward and counted so)."""
    if cfg.zero_stage not in (1, 2):
        return 0.0
    sizes = [q.bytes for st in reversed(layers) for q in reversed(st.params)
             if on_zero(q.replicated, cfg.zero_stage, cfg.zero_axis)]
    flat = [sum(b) for b in fill_buckets(sizes, float)]
    whole = 2.0 if cfg.micro_batches == 1 else 1.0
    return max((prev + whole * cur for prev, cur in zip([0.0, *flat], flat)), default=0.0)


def kept_layers(keys: list[str], saves: list[float], recomputed: set[str], reshard: bool | None,
                fits: Callable[[frozenset[str]], bool]) -> frozenset[str]:
    """ZeRO-3: the layers (``keys``, forward order) whose whole parameters stay gathered
    from forward to backward (FSDP2's ``reshard_after_forward=False``).  Each saves its
    backward re-gather (``saves``: ``ZeroPrice.regather``, its re-gathered share) for
    those bytes held at the end of the forward, the activation peak, where every kept
    layer's cost is the same: so the planner keeps the most layers that ``fits``, from
    the last (whose re-gather opens the backward, with nothing to hide it) towards the
    first, as FSDP2 keeps its root.  ``reshard=True`` keeps none, ``False`` every
    candidate.  Candidates save something and are not recomputed (their recomputation
    gathers again)."""
    cands = [k for k, x in zip(reversed(keys), reversed(saves)) if x > 0 and k not in recomputed]
    if reshard is False:
        return frozenset(cands)
    if reshard or not cands:
        return frozenset()
    lo, hi = 0, len(cands)  # memory grows with each layer kept: bisect on the count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(frozenset(cands[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return frozenset(cands[:lo])


__all__ = ["gradient_arrivals", "kept_layers", "zero_flat_bytes"]
