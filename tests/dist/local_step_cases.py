"""Optimizer steps on the local tensors of DTensor parameters, replicated or sharded
(autopar/runtime/local_step.py), on real ranks: run by test_training_loop.py through
loop_cases.py.  Every case steps the same module from the same weights twice, with
the local path on and off, and returns both results to compare bit for bit (the same
local arithmetic runs either way)."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from autopar import auto_parallel
from autopar.runtime import local_step
from tests.dist.loop_cases import Net, _batch, _mesh

OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    # two groups, one without weight decay (a habit of LLM training loops)
    "adamw-groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2),
}


class Scaled(torch.nn.Module):
    """A layer and a 0-dim parameter (CLIP's ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc(x) * self.scale, labels)


def _state(opt, names: dict[int, str]) -> dict:
    """Every state value, as (type name, placements or None, a plain copy)."""
    out = {}
    for p, s in opt.state.items():
        for k, v in s.items():
            if isinstance(v, DTensor):
                # placements and global shape: a wrapped shard must be the whole tensor's
                out[f"{names[id(p)]}.{k}"] = ("DTensor", f"{v.placements} {tuple(v.shape)}",
                                              v.to_local().clone())
            elif isinstance(v, torch.Tensor):
                out[f"{names[id(p)]}.{k}"] = ("Tensor", None, v.clone())
            else:
                out[f"{names[id(p)]}.{k}"] = (type(v).__name__, None, v)
    return out


def _run(pm, make, x, y, init: list[torch.Tensor], how: str) -> dict:
    with torch.no_grad():
        for p, v in zip(pm.parameters(), init):
            p.copy_(v)
    params = list(pm.parameters())
    names = {id(p): n for n, p in pm.named_parameters()}
    opt = make(params)
    taken = []
    seen: list[str] = []
    swapped = {}
    if how == "own-hook":  # a hook of the user's sees what the optimizer holds
        opt.register_step_post_hook(lambda o, a, k: seen.append(type(o.param_groups[0]["params"][0]).__name__))

    def closure():
        opt.zero_grad()
        loss = pm(x, y)
        loss.backward()
        params[0].grad = params[0].grad * 2  # replaced after the pre-hook looked
        return loss

    for i in range(3):
        opt.zero_grad()
        pm(x, y).backward()
        if how == "replaced-grad" and i == 1:  # a gradient the user replaced: stepped as left
            params[0].grad = params[0].grad * 2
        if how == "late-state" and i == 0:  # no gradient yet: its state comes a step later
            params[0].grad = None
            next(e for e in pm._dparams.entries if e.param is params[0]).local.grad = None
        if how == "raised" and i == 1:  # a step that raises inside the optimizer's body
            group = opt.param_groups[0]
            lr, group["lr"] = group["lr"], "not a number"
            try:
                opt.step()
            except TypeError:
                pass
            group["lr"] = lr
            swapped["after_raise"] = opt.param_groups[0]["params"][0] is not params[0]
            opt.state_dict()
            swapped["after_state_dict"] = opt.param_groups[0]["params"][0] is not params[0]
        before = local_step.steps_local
        if how == "closure":
            opt.step(closure)
        else:
            opt.step()
        taken.append(local_step.steps_local - before)
    return {"taken": taken, "swapped": swapped, "seen": seen,
            "order": [names[id(p)] for p in opt.state],
            "params": {n: p.to_local().clone() for n, p in pm.named_parameters()},
            "state": _state(opt, names),
            "groups_hold_params": all(any(q is p for p in params)
                                      for g in opt.param_groups for q in g["params"]),
            "sd_keys": sorted(opt.state_dict()["state"])}


def local_steps(c: dict) -> dict:
    """Every optimizer of :data:`OPTIMIZERS`, then the habits that must keep the
    DTensor path or its results (a replaced gradient, a closure, a hook of the user's,
    state created a step late, a step that raised, a 0-dim parameter), each with the
    local path on and off."""
    torch.manual_seed(0)
    model = Net()
    x, y = _batch()
    zero = c.get("zero_stage", 0)
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(c["mesh"]), pins=c["pins"],
                       zero_stage=zero)
    adamw = OPTIMIZERS["adamw-foreach"]
    runs = [(k, pm, make, "plain") for k, make in OPTIMIZERS.items()]
    runs += [(how, pm, adamw, how) for how in ("replaced-grad", "closure", "own-hook", "late-state", "raised")]
    if all(set(v) <= {"R"} for k, v in c["pins"].items() if not k.startswith("input")):
        scaled = auto_parallel(Scaled(), example_inputs=(x, y), mesh=_mesh(c["mesh"]), pins=c["pins"],
                               zero_stage=zero)
        runs += [("0-dim", scaled, adamw, "plain")]
    out = {}
    try:
        for name, mod, make, how in runs:
            init = [p.detach().clone() for p in mod.parameters()]
            pair = []
            for on in (True, False):
                local_step.enabled = on
                pair.append(_run(mod, make, x, y, init, how))
            on, off = pair
            out[name] = {
                "taken_on": on["taken"], "taken_off": off["taken"],
                "swapped": on["swapped"], "seen_on": on["seen"],
                "order_equal": on["order"] == off["order"],
                "params_equal": on["params"].keys() == off["params"].keys()
                and all(torch.equal(on["params"][k], off["params"][k]) for k in on["params"]),
                "state_keys_equal": on["state"].keys() == off["state"].keys(),
                "state_equal": all(on["state"][k][:2] == off["state"][k][:2]
                                   and (torch.equal(on["state"][k][2], off["state"][k][2])
                                        if isinstance(on["state"][k][2], torch.Tensor)
                                        else on["state"][k][2] == off["state"][k][2])
                                   for k in on["state"]),
                "state_types": sorted({v[0] for v in on["state"].values()}),
                "groups_hold_params": on["groups_hold_params"],
                "sd_keys_equal": on["sd_keys"] == off["sd_keys"],
                "moved": any(not torch.equal(on["params"][k], i.to_local())
                             for k, i in zip(on["params"], init)),
            }
        out["deepcopy"] = _copies(pm, x, y)
    finally:
        local_step.enabled = True
    return out


def _copies(pm, x, y) -> dict:
    """Deep copies of the parameters stepped by an optimizer of their own: they are
    not the module's, so they step as DTensors and move.  (torch cannot deep-copy a
    DTensor with its gradient: the copies get theirs after.)"""
    params = list(pm.parameters())
    for p in params:
        p.grad = None
    copies = copy.deepcopy(params)
    pm(x, y).backward()
    for c, p in zip(copies, params):
        c.grad = None if p.grad is None else p.grad.clone()
    before = [p.to_local().clone() for p in copies]
    taken = local_step.steps_local
    torch.optim.AdamW(copies, lr=1e-2).step()
    return {"taken": local_step.steps_local - taken,
            "moved": all(not torch.equal(p.to_local(), b) for p, b in zip(copies, before)
                         if p.grad is not None)}
