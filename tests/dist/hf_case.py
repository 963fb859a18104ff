"""One Hugging Face model, passed as it is, trained by an ordinary loop on real ranks
and compared with the single-process model (used by test_hf_models.py).

The loop is what users write: ``out = pm(**batch)`` (or ``pm.train_step(**batch)`` for
micro-batched plans), ``clip_grad_norm_(max_norm=0.1)`` (active: the gradient norms are
O(1)), two AdamW steps.  Checked: the output type, the loss on every rank, every
gradient before clipping, the clipped norm on every rank, and every parameter after the
two steps, against the same loop on the unmodified model in one process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.dist.harness import _max_err


def _clip(pm, max_norm: float) -> float:
    # without a pipeline: torch's own function on the DTensor parameters, unchanged;
    # a pipelined module's parameters are one stage's, so it clips over all stages itself
    if pm.plan.decisions.pipeline_stages > 1:
        return float(pm.clip_grad_norm_(max_norm))
    n = torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)
    return float(n.full_tensor() if hasattr(n, "full_tensor") else n)


def _step(pm, batch: dict):
    if pm.runner is not None:
        return pm.train_step(**batch), None
    out = pm(**batch)
    out.loss.backward()
    return out.loss.detach(), out


def _case_model(c: dict):
    """Case ``c``'s model, its single-process reference, batch, mesh, pins and forced
    decisions."""
    import hf_zoo

    if c["mode"] == "ep":
        # experts wide enough against the tokens that the dispatch is cheaper than
        # gathering them (tests/dist/mixtral_ep_case.py)
        from tests.dist.mixtral_ep_case import build
        model, batch = build()
    else:
        model, batch = hf_zoo.build(c["model"])
    ref = copy.deepcopy(model)
    if c["model"] == "mixtral":
        # the reference runs transformers' eager experts loop, the computation the
        # experts op mirrors (grouped_mm orders a token's sum otherwise, and autocast
        # does not reach its CPU fallback)
        ref.config._experts_implementation = "eager"
    mesh = tuple(c["mesh"])
    pins = hf_zoo.tp_pins(c["model"], mesh) if c["mode"] == "tp" else {}
    if c["mode"] == "ep":  # experts and tokens split on axis 0: the dispatch all-to-alls
        from tests.dist.mixtral_ep_case import ep_pins
        pins = ep_pins(mesh, 0)
    pp2 = {"pipeline_stages": 2, "micro_batches": 2}
    opts = {"zero3": {"zero_stage": 3}, "zero2": {"zero_stage": 2}, "zero1": {"zero_stage": 1},
            "pp2": pp2,
            "pp2-interleaved": {**pp2, "schedule": "interleaved-1f1b", "virtual_stages": 2},
            "pp2-zero-bubble": {**pp2, "schedule": "zero-bubble"}}.get(c["mode"], {})
    opts = {**opts, **c.get("options", {})}  # a case's own forced decisions
    return model, ref, batch, mesh, pins, opts


def run_hf_case(c: dict) -> dict:
    """Every rank runs this; rank 0's dict goes back to the test."""

    from autopar import MeshSpec, auto_parallel
    from autopar.runtime.mesh import reset

    model, ref, batch, mesh, pins, opts = _case_model(c)
    reset()
    precision = c.get("precision", "native")
    pm = auto_parallel(model, example_kwargs=batch, mesh=MeshSpec.preset("cpu-gloo", shape=mesh),
                       pins=pins, search="ilp", precision=precision, **opts)
    # the single-process reference of bf16-mixed is the model under torch.autocast
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    res: dict = {"params": pm.plan.params(), "decisions": pm.plan.decisions.zero_stage,
                 # tied weights (GPT-2, BERT, T5 embeddings) are one parameter, as in the model
                 "n_params": len(list(pm.parameters())), "ref_n_params": len(list(ref.parameters()))}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    names = [n for n, p in ref.named_parameters()]
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        loss, out = _step(pm, batch)
        with autocast:
            rout = ref(**batch)
        rout.loss.backward()
        if step == 0:
            losses = [None] * dist.get_world_size()
            dist.all_gather_object(losses, float(loss))
            res["losses"], res["ref_loss"] = losses, float(rout.loss)
            res["out_type"] = type(out).__name__ if out is not None else type(rout).__name__
            res["ref_type"] = type(rout).__name__
            grads = pm.full_grads()
            ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            res["grad_err"], res["grad_worst"] = _max_err(grads, ref_grads, ref_grads)
            res["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
        norm = _clip(pm, 0.1)
        rnorm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
        if step == 0:
            norms = [None] * dist.get_world_size()
            dist.all_gather_object(norms, norm)
            res["norms"], res["ref_norm"] = norms, rnorm
        opt.step()
        ropt.step()
    full = pm.full_state_dict()
    res["adam_err"], res["adam_worst"] = _max_err(full, ref.state_dict(), names)
    # how far the two updates differ, relative to the update: norms over all parameters
    ref_now = dict(ref.named_parameters())
    diff = sum(float((full[n].float() - ref_now[n].detach()).pow(2).sum()) for n in names)
    moved = sum(float((ref_now[n].detach() - start[n]).pow(2).sum()) for n in names)
    res["update_rel"] = (diff / moved) ** 0.5
    res["keys_match"] = sorted(full) == sorted(ref.state_dict())
    res["id"], res["stages"] = c["id"], pm.plan.decisions.pipeline_stages
    res["mode"], res["schedule"] = c["mode"], pm.plan.decisions.schedule
    res["virtual_stages"] = pm.plan.decisions.virtual_stages
    res["param_dtypes"] = sorted({str(p.dtype) for p in pm.parameters()})
    res["grad_dtypes"] = sorted({str(p.grad.dtype) for p in pm.parameters() if p.grad is not None})
    res["code_casts"] = pm.code.count("_to_copy") if hasattr(pm, "code") else -1
    res["calls"] = sorted({getattr(n.target, "__name__", str(n.target))
                           for n in pm.inner.graph.nodes if n.op == "call_function"})
    return res
