"""Why the joint search chose what it chose, in words (``plan.explain("zero")`` etc.).

Each decision is set against the best alternative the search priced: without ZeRO,
without a pipeline, other micro-batch counts, the same plan without recomputation,
one gradient bucket per gradient or one for all.  An alternative priced from the
shallow copy of a model with identical layers (:mod:`autopar.search.shallow`) says it is an
estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from autopar.capture.user_checkpoint import Coverage
from autopar.cost_models import format_bytes
from autopar.plans.data import zero_words
from autopar.search.stages.pipeline_step import price
from autopar.search.stages.priced import Config, Priced
from autopar.search.stages.step_terms import stage_link

ESTIMATED = " (estimated at full depth from a shallow copy of the model)"


@dataclasses.dataclass
class Context:
    """What the explanations read: every (candidate, priced config) of the search, the
    ids of the priced configs that are estimates, the memory budget, the global batch
    and the optimizer (to re-price a plan without recomputation)."""

    priced: Sequence[tuple[object, Priced]]
    estimated: set[int]
    budget: float
    global_batch: int
    optimizer: str


def _alt(ctx: Context, pred: Callable[[Config], bool]) -> Priced | None:
    ok = [p for _, p in ctx.priced if pred(p.config)]
    feas = [p for p in ok if p.feasible]
    bounded = [p for p in ok if p.bound is not None]
    # a config cut by its lower bound may be faster than every one priced in full: the
    # alternative's best step is then only known to be at least the smallest bound
    low = min(bounded, key=lambda p: p.bound) if bounded else None
    if feas:
        best = min(feas, key=lambda p: p.step_seconds)
        return low if low is not None and low.bound < best.step_seconds else best
    if low is not None:
        return low
    return min(ok, key=lambda p: p.min_memory) if ok else None


def _versus(ctx: Context, alt: Priced | None, what: str) -> str:
    if alt is None:
        return f"{what} was not tried"
    est = ESTIMATED if id(alt) in ctx.estimated else ""
    if alt.bound is not None:
        return f"{what} takes at least {alt.bound * 1e3:.3f} ms per step (a lower bound: " \
               f"slower than a plan already found, so not priced further){est}"
    if not alt.feasible:
        return f"{what} needs {format_bytes(alt.min_memory)} per device, over the budget " \
               f"of {format_bytes(ctx.budget)}{est}"
    return f"{what} takes {alt.step_seconds * 1e3:.3f} ms per step and " \
           f"{format_bytes(alt.min_memory)} per device{est}"


def decisions_why(ctx: Context, pr: Priced) -> dict[str, str]:
    """The ``Decisions.why`` texts of the chosen ``pr`` (keys zero, pipeline,
    micro_batches, recompute, layer:<key>, buckets)."""
    cfg = pr.config
    ms = pr.step_seconds * 1e3
    mem = max(sp.total_memory for sp in pr.stages)
    why: dict[str, str] = {}
    here = f"this plan: {ms:.3f} ms per step, {format_bytes(mem)} per device"
    why["zero"] = (f"ZeRO-{cfg.zero_stage} over {zero_words(cfg.zero_axis)}; " if cfg.zero_stage
                   else "no ZeRO; ") + here + "; " + _versus(ctx, _alt(
                       ctx, lambda c: c.zero_stage == 0 and (c.stages, c.micro_batches, c.pipeline_axis) ==
                       (cfg.stages, cfg.micro_batches, cfg.pipeline_axis)) if cfg.zero_stage else
                       _alt(ctx, lambda c: c.zero_stage > 0),
                       "without ZeRO" if cfg.zero_stage else "with ZeRO")
    if cfg.zero_stage == 3:
        kept, n = sum(len(sp.kept) for sp in pr.stages), sum(len(sp.layers) for sp in pr.stages)
        why["zero"] += (f"; {kept} of {n} layers kept gathered from forward to backward (no "
                        "re-gather), " + ("as reshard_after_forward asks" if cfg.reshard is not None
                                          else "the most the memory budget allows, from the last"))
        if cfg.micro_batches > 1 and cfg.stages == 1:
            why["zero"] += ("; gradients summed over the micro-batches and reduce-scattered once a step"
                            if cfg.reduce_once else "; gradients reduce-scattered in every micro-batch")
    chunks = f" x {cfg.virtual} chunks per stage" if cfg.virtual > 1 else ""
    where = f" from mesh axis {cfg.pipeline_axis}" if cfg.pipeline_axis else ""
    why["pipeline"] = (f"{cfg.stages} pipeline stages{where} ({cfg.schedule}{chunks}); " if cfg.stages > 1
                       else "no pipeline; ") + here + "; " + _versus(ctx, _alt(
                           ctx, lambda c: c.stages == 1) if cfg.stages > 1 else
                           _alt(ctx, lambda c: c.stages > 1),
                           "one stage" if cfg.stages > 1 else "pipelining")
    if cfg.stages > 1:
        # the schedule against the best other one on the same stages and micro-batches
        other = _alt(ctx, lambda c: (c.stages, c.micro_batches, c.pipeline_axis) ==
                     (cfg.stages, cfg.micro_batches, cfg.pipeline_axis)
                     and (c.schedule, c.virtual) != (cfg.schedule, cfg.virtual))
        name = "another schedule" if other is None else other.config.schedule + (
            f" x {other.config.virtual} chunks" if other.config.virtual > 1 else "")
        why["pipeline"] += "; " + _versus(ctx, other, name)
    why["micro_batches"] = f"{cfg.micro_batches} micro-batch{'es' if cfg.micro_batches > 1 else ''} of " \
        f"{ctx.global_batch // cfg.micro_batches}; " + _versus(
            ctx, _alt(ctx, lambda c: c.micro_batches != cfg.micro_batches),
            "other micro-batch counts (best of them)")
    why.update(recompute_why(ctx, pr, here))
    why["buckets"] = bucket_words(pr, cfg)
    why["compression"] = compression_words(ctx, pr, cfg)
    why["offload"] = offload_words(ctx, pr, cfg)
    why["copies"] = copies_words(ctx, pr, cfg)
    why["gathers"] = gather_words(pr, cfg)
    return why


def recompute_why(ctx: Context, pr: Priced, here: str) -> dict[str, str]:
    """The ``recompute`` and ``layer:<key>`` texts of ``pr``: which layers are recomputed,
    which of them the model's own activation checkpointing asked for (always kept), and
    what the rest buy against the same plan without them."""
    rc = [k for sp in pr.stages for k in sp.recompute]
    if not rc:
        return {"recompute": "no layer is recomputed: the plan fits without it"}
    cfg = pr.config
    cand = next(c for c, p in ctx.priced if p is pr)
    stats = {st.key: st for st in cand.stats}
    own = [k for k in rc if stats[k].checkpointed is not Coverage.NONE]
    part = [k for k in own if stats[k].checkpointed is Coverage.PART]
    words = f"{len(rc)} layer{'s' if len(rc) > 1 else ''} recomputed ({', '.join(rc)}): {here}; "
    if own:
        words += ("all of them" if len(own) == len(rc) else f"{len(own)} of them ({', '.join(own)})") + \
            (" kept as the model's own activation checkpointing asks (torch.utils.checkpoint, "
             "Hugging Face's gradient_checkpointing_enable)")
        if part:
            words += (f"; the model checkpoints only part of {', '.join(part)}: autopar "
                      "recomputes each of those whole (a layer is its unit of recomputation)")
        words += "; "
    if len(own) < len(rc):
        link = stage_link(cand.full, cfg.stages)
        plain = price(cand.stats, dataclasses.replace(cfg, recompute=()), cand.plan.mesh, link,
                      ctx.budget, ctx.optimizer)
        words += _versus(ctx, plain, "the same plan without recomputation" if not own else
                         "the same plan recomputing only the model's checkpointed layers")
    else:
        words += "the memory budget asks for no more"
    why = {"recompute": words}
    for sp_i, sp in enumerate(pr.stages):
        for k in sp.recompute:
            st = stats[k]
            cost = (f"it saves {format_bytes(st.activations - st.out_bytes)} of activations per "
                    f"micro-batch in flight on stage {sp_i} and costs {st.forward * 1e3:.3f} ms of "
                    "extra forward per micro-batch")
            why[f"layer:{k}"] = (
                f"{k} is recomputed in backward, as the model's own checkpointing asks"
                + (" (for part of it; recomputed whole)" if k in part else "") + f": {cost}"
                if k in own else
                f"{k} is recomputed in backward: {cost}; without recomputation stage {sp_i} "
                f"would need more than the budget of {format_bytes(ctx.budget)}")
    return why

def gather_words(pr: Priced, cfg: Config) -> str:
    """One line on ZeRO-1/2's gathers after the step: in chunks in forward order, or
    one blocking gather, and why (:mod:`autopar.search.gathers`)."""
    if cfg.zero_stage not in (1, 2):
        return "nothing is gathered after the step (no ZeRO-1 or 2)"
    n = sum(len(sp.gather_chunks) for sp in pr.stages)
    p = max(pr.stages, key=lambda sp: sp.parts.get("gather_step", 0.0) + sp.parts.get("gather_hidden", 0.0)).parts
    whole = p.get("gather_step", 0.0) + p.get("gather_hidden", 0.0)
    if n:
        return (f"ZeRO-{cfg.zero_stage}'s gathers of the updated parameters in {n} chunks sent in "
                f"forward order, each waited for by its own layers: the forward waits "
                f"{p['gather_step'] * 1e3:.3f} ms for them, where one blocking gather before it "
                f"takes {whole * 1e3:.3f} ms"
                + (f"; a chunk's buffers add {format_bytes(p['gather_split_bytes'])} to the step's peak"
                   if p.get("gather_split_bytes", 0.0) > 0 else "")
                + (" (split_gathers)" if cfg.split_gathers else ""))
    head = f"one blocking gather of ZeRO-{cfg.zero_stage}'s updated parameters before the forward " \
           f"({whole * 1e3:.3f} ms)"
    if cfg.split_gathers is False:
        return head + ", as split_gathers=False asks"
    if "gather_split" not in p:
        return head + ": a pipeline's stages gather in their own first forward, which chunks do not follow"
    if p["gather_split"] < whole:
        return head + (f": chunks would make the forward wait {p['gather_split'] * 1e3:.3f} ms, but their "
                       f"buffers (the peak {format_bytes(p['gather_split_bytes'])} higher) do not fit the memory budget")
    return head + f": chunks would make the forward wait {p['gather_split'] * 1e3:.3f} ms, no less"


def copies_words(ctx: Context, pr: Priced, cfg: Config) -> str:
    """One line on multi-copy overlap: the communication the copies hide, against the
    same split run as plain micro-batches (and the reverse)."""
    kinds = {p.config.copies for _, p in ctx.priced}
    if cfg.copies > 1:
        hidden = max(sp.parts.get("copies_hidden", 0.0) for sp in pr.stages) * cfg.micro_batches
        head = (f"the batch runs as {cfg.copies} interleaved copies of"
                f" {1 / cfg.copies:.0%} of its rows: {hidden * 1e3:.3f} ms of collectives a step run beside the other "
                f"copy's compute; {pr.step_seconds * 1e3:.3f} ms per step")
        return head + "; " + _versus(ctx, _alt(ctx, lambda c: c.copies == 1 and _same_but(c, cfg, "copies")),
                                     "the same micro-batches one after the other")
    if kinds == {1}:
        return "no multi-copy overlap (copies='auto' weighs running two halves of the batch " \
               "interleaved, one's collectives beside the other's compute)"
    return "no multi-copy overlap: " + _versus(ctx, _alt(ctx, lambda c: c.copies > 1), "two copies")


def offload_words(ctx: Context, pr: Priced, cfg: Config) -> str:
    """One line on host offload: what lives in host memory, its host bytes and time,
    against the best plan of each other level the search priced."""
    kinds = {p.config.offload for _, p in ctx.priced}
    if cfg.offload == "none":
        head = "nothing is kept in host memory" + (
            "" if kinds - {"none"} else " (offload='auto' weighs keeping the optimizer state, "
            "or ZeRO-3's parameter shards, there)")
    else:
        host = max(sp.host_memory for sp in pr.stages)
        tail = max(pr.stages, key=lambda sp: sp.parts.get("offload_step", 0.0))
        what = ("the optimizer state, with a host copy of the parameters and gradients it steps,"
                if cfg.offload == "optimizer" else
                "ZeRO-3's parameter shards, their gradients and the optimizer state")
        head = (f"{what} live in host memory: {format_bytes(host)} of host memory per device; "
                f"the optimizer steps on the host ({tail.parts.get('host_optimizer_step', 0.0) * 1e3:.3f} ms)"
                + (f" and each micro-batch copies the shards up twice and the gradients down "
                   f"({tail.parts.get('offload_micro', 0.0) * 1e3:.3f} ms)" if cfg.offload == "params"
                   else ", the gradients going down and the parameters up each step")
                + f"; {pr.step_seconds * 1e3:.3f} ms per step, "
                f"{format_bytes(max(sp.total_memory for sp in pr.stages))} per device")
    others = [_versus(ctx, _alt(ctx, lambda c, k=k: c.offload == k), f"offload={k!r}")
              for k in sorted(kinds - {cfg.offload})]
    return head + ("; " + "; ".join(others) if others else "")


def compression_words(ctx: Context, pr: Priced, cfg: Config) -> str:
    """One line on the gradient compression: what the buckets send, against the best
    plan of each other kind the search priced (``grad_compression="auto"``)."""
    kinds = {p.config.compression for _, p in ctx.priced}
    if not any(sp.buckets for sp in pr.stages):
        return "no gradient compression: nothing is all-reduced by data parallelism"
    tail = max(pr.stages, key=lambda sp: sp.parts.get("sync_bytes", 0.0))
    sent, whole = tail.parts.get("sync_wire_bytes", 0.0), tail.parts.get("sync_bytes", 0.0)
    if cfg.compression == "none":
        head = "gradients are all-reduced as they are" + (
            "" if kinds - {"none"} else " (grad_compression='auto' lets the search weigh bf16 "
            "and PowerSGD, which change the numbers the step computes)")
    else:
        how = "in bf16, summed in fp32" if cfg.compression == "bf16" else \
            f"by PowerSGD at rank {cfg.rank} with error feedback"
        head = (f"gradients are sent {how}: {format_bytes(sent)} instead of "
                f"{format_bytes(whole)} a step; this changes the numbers the step computes")
    others = [_versus(ctx, _alt(ctx, lambda c, k=k: c.compression == k
                                and _same_but(c, cfg, "compression", "rank")),
                      "without compression" if k == "none" else k)
              for k in sorted(kinds - {cfg.compression})]
    return head + (f" ({pr.step_seconds * 1e3:.3f} ms per step); " + "; ".join(others) if others else "")


def _same_but(c: Config, cfg: Config, *fields: str) -> bool:
    """``c`` is ``cfg`` but for ``fields``."""
    return dataclasses.replace(c, **{f: getattr(cfg, f) for f in fields}) == cfg


def bucket_words(pr: Priced, cfg: Config) -> str:
    """One line on the gradient buckets of the stage whose reduction tail is longest."""
    n = sum(len(sp.buckets) for sp in pr.stages)
    if not n:
        return "no gradient is all-reduced by data parallelism (nothing replicated to reduce)"
    tail = max(pr.stages, key=lambda sp: sp.parts.get("sync_exposed", 0.0))
    p = tail.parts
    how = (f"{format_bytes(cfg.bucket_bytes)} each as asked (bucket_bytes)" if cfg.bucket_bytes
           else "chosen to end the reduction earliest (MG-WFBP)")
    where = f" on stage {pr.stages.index(tail)}" if len(pr.stages) > 1 else ""
    kept = all(sp.grad_buffers_kept for sp in pr.stages)
    return (f"{n} gradient bucket{'s' if n > 1 else ''} of {format_bytes(p.get('bucket_bytes_min', 0.0))}"
            f"-{format_bytes(p.get('bucket_bytes_max', 0.0))}, {how}: "
            f"{p.get('sync_exposed', 0.0) * 1e3:.3f} ms of {p.get('sync', 0.0) * 1e3:.3f} ms of "
            f"reduction exposed after the backward{where}; one bucket per gradient would expose "
            f"{p.get('sync_exposed_per_gradient', 0.0) * 1e3:.3f} ms, one bucket for all "
            f"{p.get('sync_exposed_one_bucket', 0.0) * 1e3:.3f} ms"
            + ("; their buffers serve every step" if kept else "; new buffers each step")
            + (" (keep_grad_buffers)" if cfg.keep_buffers is not None else
               " (the memory fits)" if kept else " (keeping them does not fit)"))


__all__ = ["ESTIMATED", "Context", "bucket_words", "compression_words", "decisions_why",
           "gather_words", "offload_words"]
