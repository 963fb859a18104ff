"""Where a stage's gradient memory comes from, for :func:`autopar.search.stages.price.price_stage`'s
peak: when backward allocates each layer's gradients (a bucket's buffer is whole at its
first gradient, or there from the step's start when the buffers are kept between steps,
runtime/grad_sync.py), and ZeRO-1/2's flat reduce buckets at the end of backward
(runtime/zero.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.cost_models import MeshSpec
from autopar.plans.decisions import prices, zero_axes
from autopar.runtime.grad_sync import fill_buckets, fill_sums
from autopar.search.stages.layer_stats import LayerStat
from autopar.search.stages.priced import Config
from autopar.search.stages.zero_price import grad_bytes, on_zero


@dataclass(frozen=True)
class ParamView:
    """One layer's parameters as a stage's gradient memory reads them under one config's
    ZeRO stage, axes, micro-batches and ``reduce_once``, each list back to front (the
    order backward makes and the buckets take them).  Computed once per class of equal
    layers (:func:`autopar.search.stages.split_search.layer_classes`) per config: the
    split search prices ~150 stage ranges per config, each reading every parameter of its
    layers, so testing ZeRO membership per range dominated a deep model's search."""

    plain: tuple[int, ...]
    """Positions (in the back-to-front list) of the parameters GradSync reduces outside
    ZeRO (replicated somewhere, not under ZeRO)."""
    plain_bytes: tuple[float, ...]
    """Their gradient bytes (:func:`grad_bytes`), in the same order."""
    shards: tuple[float, ...]
    """Gradient bytes of the ZeRO-3 shards reduced over other replicated axes too."""
    flat: tuple[float, ...]
    """Local bytes of the parameters under ZeRO (ZeRO-1/2's flat reduce buckets)."""
    spike: float | None
    """The largest gradient GradSync reduces (None: none)."""
    param_bytes: float
    """:attr:`LayerStat.param_bytes`."""


def param_view(layer: LayerStat, cfg: Config, mesh: MeshSpec) -> ParamView:
    """``layer``'s :class:`ParamView` under ``cfg``."""
    zax = zero_axes(cfg.zero_axis)
    plain, plain_bytes, shards, flat = [], [], [], []
    for k, q in enumerate(reversed(layer.params)):
        on = on_zero(q.replicated, cfg.zero_stage, zax)
        if on:
            flat.append(q.bytes)
        if q.replicated and not on:
            plain.append(k)
            plain_bytes.append(grad_bytes(q, mesh, cfg.zero_stage, zax, cfg.micro_batches,
                                          cfg.reduce_once))
        elif cfg.zero_stage == 3 and on and set(q.replicated) - set(zax):
            shards.append(grad_bytes(q, mesh, cfg.zero_stage, zax, cfg.micro_batches,
                                     cfg.reduce_once))
    synced = plain_bytes + shards
    return ParamView(tuple(plain), tuple(plain_bytes), tuple(shards), tuple(flat),
                     max(synced) if synced else None, layer.param_bytes)


def param_views(layers: list[LayerStat], cfg: Config, mesh: MeshSpec,
                classes: list[int] | None = None) -> list[ParamView]:
    """:func:`param_view` of each of ``layers``, once per class of ``classes`` (equal ids:
    equal numbers) when given."""
    if classes is None:
        return [param_view(st, cfg, mesh) for st in layers]
    per_class: dict[int, ParamView] = {}
    for c, st in zip(classes, layers):
        if c not in per_class:
            per_class[c] = param_view(st, cfg, mesh)
    return [per_class[c] for c in classes]


def gradient_arrivals(layers: list[LayerStat], zp: list, cfg: Config, mesh: MeshSpec,
                      buckets: list[list[str]] | None = None,
                      kept: bool = False,
                      views: list[ParamView] | None = None) -> tuple[list[float], float, float]:
    """Per layer, the gradient bytes that exist once its backward has run and not
    before: its own gradients (``zp``'s), except that ZeRO-3 shards reduced over other
    axes go in BUCKET_BYTES buckets, back to front, each allocated whole at its first
    gradient, in the last layer holding one (runtime/grad_sync.py makes ``.grad`` views
    of a bucket).  The plan's own data-parallel buckets (``buckets``: parameter names,
    as :attr:`~autopar.plans.Decisions.grad_buckets`) do the same; they are chosen after
    the split, so the split search counts those gradients per layer, and the chosen
    split's price passes its buckets (one bucket for all: every gradient exists from
    the first, 1.18x the per-layer count measured on 4 ranks).  Also the largest gradient
    going into a bucket: autograd makes it in a tensor of its own, alive beside the
    bucket until it is copied in.  With ``kept`` (the buffers serve every step,
    :attr:`~autopar.plans.Decisions.grad_buffers_kept`) every gradient GradSync reduces
    exists from the start of the step, whole: returned third (0 without ``kept``) and
    left out of the arrivals.  ``views``: the layers' :func:`param_views` under ``cfg``
    when already computed."""
    if views is None:
        views = param_views(layers, cfg, mesh)
    out = [z.grads for z in zp]
    back = range(len(layers) - 1, -1, -1)
    spike = max((v.spike for v in views if v.spike is not None), default=0.0)
    # what GradSync reduces: replicated parameters outside ZeRO, and ZeRO-3 shards
    # replicated on other axes too (ZeRO-1/2 reduce those themselves, per bucket: runtime/zero.py)
    if kept:
        for i in back:
            for x in views[i].plain_bytes + views[i].shards:
                out[i] -= x
        return out, spike, sum(x for part in ("plain_bytes", "shards") for i in back
                               for x in getattr(views[i], part))
    shards = [(i, x) for i in back for x in views[i].shards]
    if not shards and not buckets:
        return out, spike, 0.0  # every gradient counted in its own layer
    groups = fill_buckets(shards, lambda ix: ix[1])
    if buckets:
        where = {}
        for i in back:
            rev = layers[i].params[::-1]
            for k, x in zip(views[i].plain, views[i].plain_bytes):
                if rev[k].name:
                    where[rev[k].name] = (i, x)
        groups += [[where[n] for n in names if n in where] for names in buckets]
    for g in groups:
        if not g:
            continue
        for i, x in g:
            out[i] -= x
        out[max(i for i, _ in g)] += sum(x for _, x in g)
    return out, spike, 0.0


def zero_flat_bytes(layers: list[LayerStat], cfg: Config,
                    views: list[ParamView] | None = None) -> float:
    """ZeRO-1/2: the most bytes of flat reduce buckets alive at once at the end of
    backward.  The runtime (runtime/zero.py) cuts the ZeRO axis's gradients, back to
    front, into buckets of BUCKET_BYTES and keeps two in flight: bucket ``i``'s flat
    copy exists beside bucket ``i - 1``'s, and with one micro-batch the whole gradients
    of bucket ``i`` too, until it launches (gradients are counted sharded then; under
    accumulation they are whole until the last backward and counted so).  ``views``:
    the layers' :func:`param_views` under ``cfg`` when already computed."""
    if cfg.zero_stage not in (1, 2):
        return 0.0
    if views is None:
        sizes = [q.bytes for st in reversed(layers) for q in reversed(st.params)
                 if on_zero(q.replicated, cfg.zero_stage, cfg.zero_axis)]
    else:
        sizes = [x for v in reversed(views) for x in v.flat]
    flat = fill_sums(sizes)
    whole = 2.0 if cfg.micro_batches == 1 else 1.0
    return max((prev + whole * cur for prev, cur in zip([0.0, *flat], flat)), default=0.0)


@prices("zero_kept")
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


__all__ = ["ParamView", "gradient_arrivals", "kept_layers", "param_view", "param_views",
           "zero_flat_bytes"]
