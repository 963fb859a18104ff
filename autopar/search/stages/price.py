"""One pipeline stage's price under a :class:`~autopar.search.stages.priced.Config`: its time
per micro-batch, its step extras and its memory, with the layers it recomputes and the
ZeRO-3 layers it keeps gathered (:func:`price_stage`; the model is described in
:mod:`autopar.search.stages.dp`).  The split search (:mod:`autopar.search.stages.split_search`)
calls it for every stage range it considers."""

from __future__ import annotations

import math

from autopar.capture.user_checkpoint import Coverage
from autopar.cost_models import MeshSpec, drift_after
from autopar.plan import schedules as sched
from autopar.plan.decisions import zero_axes
from autopar.search.compression import persistent_bytes
from autopar.search.gathers import names_of, stage_chunks
from autopar.search.offload import offload_price
from autopar.search.stages.layer_stats import LayerStat, zero_price
from autopar.search.stages.memory import (
    ParamView,
    gradient_arrivals,
    kept_layers,
    param_views,
    zero_flat_bytes,
)
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


def price_stage(layers: list[LayerStat], index: int, cfg: Config, mesh: MeshSpec, pipe_link,
                budget: float, optimizer: str, zp: list | None = None,
                sync: bool = True, views: list[ParamView] | None = None) -> StagePrice:
    """Price stage ``index`` holding ``layers`` (see :mod:`autopar.search.stages.dp`);
    ``pipe_link(bytes)`` is the time of one point-to-point message between stages;
    ``zp`` the layers' :func:`zero_price` when already computed; ``sync=False`` leaves
    the gradient buckets out (the split search needs only ``seconds`` and memory);
    ``views`` the layers' :func:`param_views` under ``cfg`` when already computed.
    Under the interleaved schedule ``cfg`` counts virtual stages (:func:`price`).
    The returned memory may exceed ``budget`` when nothing fits."""
    inflight = in_flight(cfg, index)
    # zero-bubble: gradients at the weights' consumers wait from each B to its W
    held_w = waiting_w(cfg, index) * sum(st.weight_grad_inputs for st in layers)
    if zp is None:
        zp = [zero_price(st, mesh, cfg.zero_stage, cfg.zero_axis, optimizer, cfg.micro_batches,
                         cfg.reduce_once)
              for st in layers]
    if views is None:
        views = param_views(layers, cfg, mesh)
    # PowerSGD's error feedback: one more copy of what GradSync reduces, all run long
    comp = persistent_bytes(cfg.compression, sum(sum(v.plain_bytes) + sum(v.shards) for v in views)) \
        if cfg.compression != "none" else 0.0
    # offload: state held in host memory instead (search/offload.py)
    off = offload_price(layers, zp, cfg.offload, cfg.zero_stage, cfg.zero_axis, mesh, optimizer,
                        cfg.micro_batches)
    held = sum(z.params + z.optimizer for z in zp) + sum(st.buffers for st in layers) + comp - off.params - off.optimizer
    grads = [z.grads for z in zp]  # per layer, as they are once the step's reduction ends
    # gradient memory as backward allocates it (the same whether or not the buckets
    # are priced, so the split search and the chosen split agree)
    arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh, views=views)
    # stage 3: a layer's whole parameters live while it runs, and the next layer's
    # prefetched gather lands meanwhile (runtime/zero3.py): two neighbours at once
    # ZeRO-3: a layer's whole parameters while it runs (runtime/zero3.py gathers it and
    # prefetches the next); under mixed precision backward keeps a weight's
    # low-precision copy when the weight is only cast, so only the other weights are
    # re-gathered in backward
    tr = [z.transient for z in zp]
    trb = [z.transient * (1.0 - min(1.0, st.cast_param_bytes / v.param_bytes)) if v.param_bytes
           else z.transient for z, st, v in zip(zp, layers, views)]
    # the gradients of earlier micro-batches are alive at the activation peak when the
    # stage holds fewer micro-batches than there are: the peak count then recurs after
    # a backward (accumulation, 1F1B's steady state); not when every forward the stage
    # holds at once runs before its first backward (GPipe, 1F1B's first stage at M <= p).
    # Under interleaving a rank's other chunk runs backwards between this one's forwards.
    present = cfg.micro_batches > inflight or (cfg.virtual > 1 and cfg.micro_batches > 1)
    flats = zero_flat_bytes(layers, cfg, views)
    # what peak() reads when no ZeRO-3 layer is kept gathered (most calls): the gathers
    # at each layer's forward (it and its prefetched successor) and backward (it and
    # its predecessor), and every layer's whole activations
    n_layers = len(layers)
    gathered_fwd = [0.0 + tr[k] + (tr[k + 1] if k + 1 < n_layers else 0.0) for k in range(n_layers)]
    # and, in a layer's backward, two gradients at once as autograd passes one op's on
    # to the next: the layer's widest (the logits' under a cross-entropy, the MLP's
    # hidden in a block), or its output's when that is wider
    flow = [2.0 * max(st.out_bytes, st.largest) for st in layers]
    gathered_bwd = [flow[k] + max(0.0, trb[k]) + (trb[k - 1] if k else 0.0) for k in range(n_layers)]
    activations = [st.activations for st in layers]
    # the layers the model checkpoints itself stay recomputed (the user asked for that
    # memory); recompute candidates: the other layers whose recomputation saves memory,
    # best ratio first
    floor = [st for st in layers if st.checkpointed is not Coverage.NONE and not st.updates_state]
    cands = sorted((st for st in layers if st.activations > st.out_bytes and st.forward > 0
                    and st.checkpointed is Coverage.NONE and not st.updates_state),
                   key=lambda st: -(st.activations - st.out_bytes) / st.forward)
    if sched.conflict(cfg.schedule, True, None):
        cands = floor = []  # a schedule that cannot recompute (zero-bubble): never chosen with a floor
    chosen: list[LayerStat] = floor

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
        # (written for speed: called ~7 times per stage price, the split search's inner
        # loop; the sums are taken in the order the plain version took them, so every
        # number is the same bit for bit)
        keys = {st.key for st in rc}
        n = len(layers)
        if kp:
            hold = [trb[k] if layers[k].key in kp else 0.0 for k in range(n)]
            held_before = [0.0]  # the kept layers' bytes before layer k: held_before[k]
            ahead = [0.0] * n  # what layer k's backward prefetches: the nearest
            last = 0.0  # layer before it that is not kept (runtime/zero3.py), kept ones skipped
            for k, h in enumerate(hold):
                held_before.append(held_before[-1] + h)
                ahead[k], last = last, (last if h else trb[k])
            g_fwd = [held_before[k] + tr[k] + (tr[k + 1] if k + 1 < n else 0.0) for k in range(n)]
            g_bwd = [flow[k] + held_before[k] + max(hold[k], trb[k]) + ahead[k] for k in range(n)]
            held_sum = sum(hold)
        else:
            g_fwd, g_bwd, held_sum = gathered_fwd, gathered_bwd, 0.0
        kept = [st.out_bytes if st.key in keys else st.activations for st in layers] if keys \
            else activations
        # kept gradient buffers are whole from the step's start (``persist``)
        grads_then = sum(grads) if present else persist
        fa = fb = best = cum = 0.0
        for k in range(n):
            cum += kept[k]
            if cum + g_fwd[k] > best:
                fa, fb, best = cum, g_fwd[k], cum + g_fwd[k]
        total_kept = sum(kept)
        ba, bb, bc = total_kept, grads_then, 0.0
        best, before, made = total_kept + grads_then, total_kept, grads_then
        for k in range(n - 1, -1, -1):
            before -= kept[k]
            live = before + (layers[k].activations if layers[k].key in keys else kept[k])
            if live + made + g_bwd[k] > best:
                ba, bb, bc, best = live, made, g_bwd[k], live + made + g_bwd[k]
            # layer k's gradients appear as its backward ends, freeing its activations
            made = grads_then if present else made + arrive[k]
        extra = (inflight - 1) * (total_kept + held_sum) + held_w
        fwd_a, bwd_a = fa + extra, ba + extra
        end_g, end_t = sum(grads), (trb[0] if n else 0.0) + flats + spike
        # the largest moment, the first of equals (as max over the three would)
        sums = (fwd_a + grads_then + fb, bwd_a + bb + bc, 0.0 + end_g + end_t)
        if sums[0] >= sums[1] and sums[0] >= sums[2]:
            return {"activations": fwd_a, "grads": grads_then, "transient": fb}
        if sums[1] >= sums[2]:
            return {"activations": bwd_a, "grads": bb, "transient": bc}
        return {"activations": 0.0, "grads": end_g, "transient": end_t}

    def mem(rc: list[LayerStat], kp: frozenset[str] = frozenset()) -> float:
        return held + sum(peak(rc, kp).values())

    if cfg.recompute is not None:
        chosen = [st for st in layers if st.key in cfg.recompute or st in floor]
    elif mem(floor) > budget:
        # the fewest best-ratio layers that fit: memory falls as layers are added, so
        # bisect on the count instead of re-pricing every prefix
        lo, hi = 1, len(cands)
        while lo < hi:
            mid = (lo + hi) // 2
            if mem(floor + cands[:mid]) <= budget:
                hi = mid
            else:
                lo = mid + 1
        chosen = floor + cands[:lo]
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
    seconds += accumulate + count_exposed(layers, cfg, mesh) + off.per_micro
    hidden = copies_hidden(layers, cfg, mesh)  # multi-copy: comm beside the other copy's compute
    seconds -= hidden
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
        arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh, names, views=views)
        if mem(chosen, kp) > budget >= bare:
            # the buckets make gradients exist earlier than the per-layer count the
            # split and recomputation were chosen by: a bucket per layer fits as they did
            # (the 4-layer GPT recomputed whole on 4 A100s: 6.6 MB against 6.0 MB)
            bp, names, extremes = stage_buckets(layers, zp, rc, cfg, mesh, per_layer=True)
            arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh, names, views=views)
    # the gradient buffers serve every step where their memory fits (runtime/grad_sync.py:
    # a new buffer and views per bucket, and a DTensor per gradient, cost ~1.5 ms of CPU a
    # step for the 4-layer GPT); chosen last, so they never cost a recomputed layer
    freed = arrive, spike, persist
    arrive, spike, persist = gradient_arrivals(layers, zp, cfg, mesh, kept=True, views=views)
    # (a stage with nothing to keep keeps vacuously: it does not veto the others)
    buffers_kept = cfg.keep_buffers is not False and (
        persist == 0 or cfg.keep_buffers is True or mem(chosen, kp) <= budget)
    if not buffers_kept:
        arrive, spike, persist = freed
    exposed = bp.exposed if bp is not None else 0.0
    gather_step = whole_gather = sum(z.gather_step for z in zp)
    chunks = _gather_chunks(layers, cfg, mesh, gather_step)
    chunk_bytes = 0.0
    if chunks is not None:
        total = mem(chosen, kp)  # the step's peak (peak() is the split search's inner loop)
        # a chunk's gathered and send buffers live from the fetch before it to its own,
        # beside the activations of the layers before it (and kept gradient buffers):
        # what that moment holds above the step's peak
        d = math.prod(mesh.shape[a] for a in zero_axes(cfg.zero_axis))
        before = [0.0]
        for st in layers:
            before.append(before[-1] + (st.out_bytes if st.key in rc else st.activations))
        moment = held + persist + max(before[k] + b * (1.0 + 1.0 / d) for k, b in zip(chunks.starts, chunks.sizes))
        chunk_bytes = max(0.0, moment - total)
    split = {"gather_split": chunks.waits, "gather_split_bytes": chunk_bytes} if chunks else {}
    if chunks is not None and (cfg.split_gathers or (
            chunks.waits < gather_step and total + chunk_bytes <= budget)):
        gather_step = chunks.waits  # the forward's waits for its chunks
    else:
        chunks = None
    # the optimizer updates the stage's parameters once per step, after the gradients
    # are reduced and before the next forward: nothing overlaps it
    opt_step = sum(z.opt_step for z in zp) + off.step  # offload: the host's step and copies
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
             "comm": seconds - compute - recompute - accumulate,  # net of what copies hide
             "sync": bp.busy if bp is not None else 0.0, "sync_exposed": exposed,
             "gather_step": gather_step, "optimizer_step": opt_step, "copy_step": copy_step, **extremes}
    # what is alive at the peak: gradients only as far as backward has made them
    memory = {"params": sum(z.params for z in zp), "optimizer": sum(z.optimizer for z in zp),
              "buffers": sum(st.buffers for st in layers), **peak(chosen, kp)}
    if comp:
        memory["compression"] = comp
    if chunks is not None and chunk_bytes > 0:
        memory["gathers"] = chunk_bytes
    memory["params"] -= off.params
    memory["optimizer"] -= off.optimizer
    if off.host > (mesh.host_memory if mesh.host_memory is not None else math.inf):
        seconds = math.inf  # over the host's budget: no plan
    parts["copies_hidden"] = hidden
    parts["gather_hidden"] = whole_gather - gather_step
    parts.update(split)
    parts["offload_step"] = off.step
    parts["offload_micro"] = off.per_micro
    parts["host_optimizer_step"] = off.host_opt
    return StagePrice([st.key for st in layers], seconds, extra, memory, sorted(rc), parts, names,
                      [st.key for st in layers if st.key in kp], buffers_kept, off.host,
                      names_of(chunks))


def _gather_chunks(layers: list[LayerStat], cfg: Config, mesh: MeshSpec, whole: float):
    """ZeRO-1/2's gathers after the step in chunks (:mod:`autopar.search.gathers`), or
    ``None`` where they cannot run (a pipeline's stages gather in their own first
    forward, which the model does not follow; ``split_gathers=False``)."""
    if not whole or cfg.split_gathers is False or cfg.stages > 1 or cfg.zero_stage not in (1, 2):
        return None
    return stage_chunks(layers, cfg.zero_stage, cfg.zero_axis, mesh)


def _in_bytes(layers: list[LayerStat]) -> float:
    # what enters the stage is what the previous layer sent; approximated by the
    # first layer's own output size (layers of a stack have equal-sized interfaces)
    return layers[0].out_bytes


__all__ = ["price_stage"]
