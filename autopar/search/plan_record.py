"""The plan a joint search's chosen configuration becomes: the chosen candidate's node
placements with every plan-level decision recorded (:class:`Decisions`), the reasons
(``why``), the collectives one step issues, the request and the memory of the fullest
stage (:class:`~autopar.search.joint.JointSearch` calls :func:`recorded` once, for the
chosen split)."""

from __future__ import annotations

from autopar.cost_models import MeshSpec
from autopar.plans.data import Plan, compile_words
from autopar.plans.decisions import Decisions, PlanOptions, forced_values
from autopar.plans.splits import batch_size
from autopar.search.assemble import complete
from autopar.search.captures import request
from autopar.search.op_placement import local_axes
from autopar.search.space import _Candidate
from autopar.search.stages.priced import Priced, chosen_fields
from autopar.search.step_collectives import list_collectives
from autopar.search.why import Context, decisions_why


def recorded(cand: _Candidate, pr: Priced, priced: list, budget: float, call: tuple,
             opts: PlanOptions, mesh: MeshSpec) -> Plan:
    """``cand``'s plan with ``pr``'s decisions recorded; ``priced``: every (candidate,
    price) the search made (the reasons compare with them), ``call``: the example call
    (args, kwargs), ``mesh``: the searched mesh."""
    cfg = pr.config
    plan = complete(cand.plan)
    recompute = sorted({k for sp in pr.stages for k in sp.recompute})
    order = {st.key: i for i, st in enumerate(cand.stats)}
    kept = sorted({k for sp in pr.stages for k in sp.kept}, key=order.__getitem__)
    d = Decisions(
        pipeline_stages=cfg.stages, pipeline_axis=cand.axis if cfg.stages > 1 else 0,
        schedule=cfg.schedule, micro_batches=cfg.micro_batches,
        virtual_stages=cfg.virtual,
        stages=(pr.virtual or [sp.layers for sp in pr.stages]) if cfg.stages > 1 else [],
        zero_stage=cfg.zero_stage, recompute=recompute, zero_kept=kept, zero_reduce_once=cfg.reduce_once,
        grad_buffers_kept=all(sp.grad_buffers_kept for sp in pr.stages),
        # one axis as an int (as plans always said), several as a list
        zero_axis=list(cfg.zero_axis) if isinstance(cfg.zero_axis, tuple) else cfg.zero_axis,
        batch=opts.batch, **forced_values(opts), **chosen_fields(cfg),
        # a micro-batched or pipelined step returns the loss alone: no rows to return
        local_axes=local_axes(cand.cap.gm, plan)
        if opts.batch == "local" and cfg.micro_batches == 1 and cfg.stages == 1 else None,
        global_batch=batch_size(call),
        stage_seconds=[sp.seconds for sp in pr.stages],
        stage_memory=[sp.total_memory for sp in pr.stages], step_seconds=pr.step_seconds,
        stage_parts=[dict(sp.parts) for sp in pr.stages], breakdown=pr.breakdown(),
        sliced_sends=[i for i, sp in enumerate(pr.stages) if sp.sliced_sends],
        grad_buckets=[b for sp in pr.stages for b in sp.buckets],
        gather_chunks=[c for sp in pr.stages for c in sp.gather_chunks],
        offload=cfg.offload, host_memory=max(sp.host_memory for sp in pr.stages), copies=cfg.copies,
        # compression only where GradSync all-reduces something
        **(dict(grad_compression=cfg.compression, compression_rank=cfg.rank)
           if any(sp.buckets for sp in pr.stages) else {}))
    d.why = decisions_why(Context(priced, {id(p) for c, p in priced if c.estimate},
                                  budget, batch_size(call), opts.optimizer), pr)
    d.why["compile"] = compile_words(d.compile)
    plan.decisions = d
    d.collectives = [c.to_dict() for c in list_collectives(cand.cap.gm, plan)]
    plan.request = request(cand.cap.gm, cfg.micro_batches, list(mesh.shape), budget)
    worst = max(pr.stages, key=lambda sp: sp.total_memory)
    plan.memory = dict(worst.memory)
    plan.memory["total"] = worst.total_memory
    return plan


__all__ = ["recorded"]
