"""Optimizer steps on the local tensors of replicated parameters
(autopar/runtime/local_step.py), on real ranks: run by test_training_loop.py through
loop_cases.py.  Every case steps the same module from the same weights twice, with
the local path on and off, and returns both results to compare bit for bit (the same
local arithmetic runs either way)."""

from __future__ import annotations

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


class _Boom(RuntimeError):
    pass


def _boom() -> float:
    raise _Boom("closure failed")


def _state(opt, names: dict[int, str]) -> dict:
    """Every state value, as (type name, placements or None, a plain copy)."""
    out = {}
    for p, s in opt.state.items():
        for k, v in s.items():
            if isinstance(v, DTensor):
                out[f"{names[id(p)]}.{k}"] = ("DTensor", str(v.placements), v.to_local().clone())
            elif isinstance(v, torch.Tensor):
                out[f"{names[id(p)]}.{k}"] = ("Tensor", None, v.clone())
            else:
                out[f"{names[id(p)]}.{k}"] = (type(v).__name__, None, v)
    return out


def _run(pm, make, x, y, init: list[torch.Tensor], replace_grad: bool, raise_once: bool) -> dict:
    with torch.no_grad():
        for p, v in zip(pm.parameters(), init):
            p.copy_(v)
    params = list(pm.parameters())
    names = {id(p): n for n, p in pm.named_parameters()}
    opt = make(params)
    taken = []
    swapped_after_raise = None
    for i in range(3):
        opt.zero_grad()
        pm(x, y).backward()
        if replace_grad and i == 1:  # a gradient the user replaced: stepped as left
            params[0].grad = params[0].grad * 2
        if raise_once and i == 1:
            try:
                opt.step(_boom)
            except _Boom:
                pass
            swapped_after_raise = opt.param_groups[0]["params"][0] is not params[0]
        before = local_step.steps_local
        opt.step()
        taken.append(local_step.steps_local - before)
    return {"taken": taken, "swapped_after_raise": swapped_after_raise,
            "params": {n: p.to_local().clone() for n, p in pm.named_parameters()},
            "state": _state(opt, names),
            "groups_hold_params": all(any(q is p for p in params)
                                      for g in opt.param_groups for q in g["params"]),
            "sd_keys": sorted(opt.state_dict()["state"])}


def local_steps(c: dict) -> dict:
    """Every optimizer of :data:`OPTIMIZERS`, then a replaced gradient and a step that
    raised, each with the local path on and off."""
    torch.manual_seed(0)
    model = Net()
    x, y = _batch()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(c["mesh"]), pins=c["pins"], zero_stage=0)
    init = [p.detach().clone() for p in pm.parameters()]
    runs = [(k, make, False, False) for k, make in OPTIMIZERS.items()]
    runs += [("replaced-grad", OPTIMIZERS["adamw-foreach"], True, False),
             ("raised", OPTIMIZERS["adamw-foreach"], False, True)]
    out = {}
    try:
        for name, make, replace, raise_once in runs:
            pair = []
            for on in (True, False):
                local_step.enabled = on
                pair.append(_run(pm, make, x, y, init, replace, raise_once))
            on, off = pair
            out[name] = {
                "taken_on": on["taken"], "taken_off": off["taken"],
                "swapped_after_raise": on["swapped_after_raise"],
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
    finally:
        local_step.enabled = True
    return out
