"""Hugging Face Mixtral, passed as it is, under expert parallelism on real ranks, compared
with the single-process model (used by test_mixtral_ep.py and tests/unit).

The experts are big enough against the tokens (4 experts of 64 -> 256 -> 64, 64 tokens)
that a pinned expert split is served by expert parallelism (the dispatch all-to-alls)
rather than by gathering the experts; the experts op's output is pinned ``S(0)`` on the
expert axis too, which rules out the other lowering of split experts (tokens gathered,
a Partial output reduce-scattered; the planner's own choice, case ``auto``).

The loop is hf_case.py's: ``out = pm(**batch)``, backward, two AdamW steps; checked:
the loss on every rank, every gradient, every parameter after the steps.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.dist.harness import _max_err

LAYERS = 2


def build(aux: bool = False, batch: int = 4, seq: int = 16):
    """A tiny Mixtral (``aux``: the router's load-balancing loss is part of the loss)."""
    import transformers as tf
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=256,
                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                           output_router_logits=aux, router_aux_loss_coef=0.5)
    ids = torch.randint(0, 128, (batch, seq))
    return tf.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def ep_pins(mesh: tuple[int, ...], axis: int) -> dict[str, str]:
    """Experts split on mesh ``axis``, the batch split on every axis, each experts op's
    output split on its tokens (so expert parallel, not gathered experts)."""
    s = "".join("S(0)" if a == axis else "R" for a in range(len(mesh)))
    batch = "S(0)" * len(mesh)
    pins = {"*experts.gate_up_proj": s, "*experts.down_proj": s, "input:0": batch,
            "input:1": batch}
    pins.update({("moe_experts" if i == 0 else f"moe_experts_{i}"): batch for i in range(LAYERS)})
    return pins


def ep_tp_pins(ep_axis: int = 0, tp_axis: int = 1) -> dict[str, str]:
    """EP x TP on a 2-D mesh: the batch and the experts split over ``ep_axis`` (the
    experts' tokens travel by the dispatch all-to-alls there), attention split
    Megatron-style over ``tp_axis`` (q/k/v by output rows, o by input columns), the
    batch whole over ``tp_axis``."""
    def on(axis: int, p: str) -> str:
        return "".join(p if a == axis else "R" for a in range(2))
    batch = on(ep_axis, "S(0)")
    pins = {"*experts.gate_up_proj": batch, "*experts.down_proj": batch, "input:0": batch,
            "input:1": batch}
    pins.update({("moe_experts" if i == 0 else f"moe_experts_{i}"): batch for i in range(LAYERS)})
    for proj in ("q_proj", "k_proj", "v_proj"):
        pins[f"*self_attn.{proj}.weight"] = on(tp_axis, "S(0)")
    pins["*self_attn.o_proj.weight"] = on(tp_axis, "S(1)")
    return pins


def run_case(c: dict) -> dict:
    """Every rank runs this; rank 0's dict goes back to the test."""
    from autopar import MeshSpec, auto_parallel
    from autopar.runtime.mesh import reset

    model, batch = build(aux=c.get("aux", False))
    if c.get("skew"):
        # a zero router ties every expert: top-2 takes the same two for every token
        # (experts 2 and 3 on this CPU), so the other rank's experts get no rows at all
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight"):
                    p.zero_()
    ref = copy.deepcopy(model)
    mesh = tuple(c["mesh"])
    if c.get("tp"):
        pins = ep_tp_pins(c["axis"], c["tp"])
    else:
        pins = ep_pins(mesh, c["axis"]) if c.get("axis") is not None else {}
    reset()
    pm = auto_parallel(model, example_kwargs=batch, mesh=MeshSpec.preset("cpu-gloo", shape=mesh),
                       pins=pins, search="ilp")
    res: dict = {"moe": [(n.in_placements, n.out_placements) for n in pm.plan.nodes.values()
                         if "moe_experts" in str(n.op)],
                 "params": pm.plan.params(),
                 "calls": sorted({getattr(n.target, "__name__", str(n.target))
                                  for n in pm.inner.graph.nodes if n.op == "call_function"}),
                 # the ranks compare the call's shapes where tokens cross them: the
                 # module's rule and the plan's listing
                 "agree": pm.routes._agree(pm).value,
                 "listed_agree": sum(c.what == "the call's shapes" for c in pm.plan.collectives())}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    names = [n for n, _ in ref.named_parameters()]
    for step in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        out = pm(**batch)
        out.loss.backward()
        rout = ref(**batch)
        rout.loss.backward()
        if step == 0:
            losses = [None] * dist.get_world_size()
            dist.all_gather_object(losses, float(out.loss))
            res["losses"], res["ref_loss"] = losses, float(rout.loss)
            res["aux"] = None if rout.aux_loss is None else float(rout.aux_loss)
            # a parameter with a gradient in the model has one on every rank: an
            # optimizer skips a None gradient (no weight decay, no momentum step)
            has = {n for n, p in ref.named_parameters() if p.grad is not None}
            mine = sorted(n for n, p in pm.named_parameters() if n in has and p.grad is None)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            res["missing_grads"] = sorted({n for m in everyone for n in m})
            grads = pm.full_grads()
            ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            res["grad_err"], res["grad_worst"] = _max_err(grads, ref_grads, ref_grads)
            res["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters()
                                    if p.grad is not None)
        opt.step()
        ropt.step()
    full = pm.full_state_dict()
    res["adam_err"], res["adam_worst"] = _max_err(full, ref.state_dict(), names)
    res["keys_match"] = sorted(full) == sorted(ref.state_dict())
    return res
