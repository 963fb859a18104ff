"""Distributed checkpoints in a training loop on real ranks (DCP saves and loads across
meshes, ZeRO axes and pipeline stages); run by test_training_loop.py through
loop_cases.py, whose model and helpers they share."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autopar import auto_parallel
from tests.dist.loop_cases import TP_MLP, Net, _all, _batch, _mesh


def dcp_reshard(c: dict) -> dict:
    """DCP: save under TP2 x DP2, load bit-exactly into the same plan and into DP4;
    the test then loads the checkpoint into the plain model in one process.  ZeRO is
    ruled out where optimizer state is resharded (its flat state loads only into the
    same plan; the zero3 load below checks the model alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    path = Path(c["dir"])
    torch.manual_seed(0)
    model = Net()
    x, y = _batch()
    tp_dp = {k: "R" + v for k, v in TP_MLP.items()} | {"input:0": "S(0)R"}
    pm = auto_parallel(copy.deepcopy(model), example_inputs=(x, y), mesh=_mesh((2, 2)), pins=tp_dp,
                       zero_stage=0)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(x, y).backward()
    opt.step()
    saved = pm.full_state_dict()
    msd, osd = get_state_dict(pm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save(saved, path / "expected.pt")
    exp_avg = {k: v["exp_avg"].full_tensor() for k, v in osd["state"].items()}
    res = {}
    dp4 = {"*": "R", "input:0": "S(0)"}
    for tag, mesh, pins, opts in (("same", (2, 2), tp_dp, {"zero_stage": 0}), ("dp4", (4,), dp4, {"zero_stage": 0}),
                                  ("zero3", (4,), dp4, {"zero_stage": 3, "pipeline_stages": 1, "micro_batches": 1})):
        fresh = Net()  # other weights: loading must replace every one
        pm2 = auto_parallel(fresh, example_inputs=(x, y), mesh=_mesh(mesh), pins=pins, **opts)
        opt2 = torch.optim.AdamW(pm2.parameters(), lr=1e-2)
        pm2(x, y).backward()
        opt2.step()  # creates optimizer state to load into
        msd2, osd2 = get_state_dict(pm2, opt2)
        if opts.get("zero_stage"):  # ZeRO's flat optimizer state loads only into the same plan
            state = {"model": msd2}
            dcp.load(state, checkpoint_id=path)
            pm2.load_state_dict(state["model"])
            got = pm2.full_state_dict()
            res[tag] = all(torch.equal(got[k], saved[k]) for k in saved)
            continue
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=path)
        # strict=False: Net's never-used layer has no optimizer state (as in one process)
        set_state_dict(pm2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        got = pm2.full_state_dict()
        res[tag] = all(torch.equal(got[k], saved[k]) for k in saved)
        res[tag + "_placements"] = pm2.plan.params()["fc1.weight"]
        _, osd3 = get_state_dict(pm2, opt2)
        res[tag + "_optim"] = all(torch.equal(osd3["state"][k]["exp_avg"].full_tensor(), v)
                                  for k, v in exp_avg.items())
    return res


def dcp_zero_axes(c: dict) -> dict:
    """DCP under ZeRO over both axes of a 2x2 data-parallel mesh (its flat shards are
    DTensors sharded on both axes): save the model and AdamW's state after a step, load
    them into a fresh module with the same plan, and take one more step on both."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    path = Path(c["dir"]) / f"zero-axes-{c['stage']}"
    torch.manual_seed(0)
    x, y = _batch()
    pins = {"*": "RR", "input:0": "S(0)S(0)"}
    opts = {"zero_stage": c["stage"], "zero_axes": (0, 1), "pipeline_stages": 1, "micro_batches": 1}
    pms, opts_ = [], []
    for seed in (0, 1):  # the second starts from other weights: loading must replace them
        torch.manual_seed(seed)
        pm = auto_parallel(Net(), example_inputs=(x, y), mesh=_mesh((2, 2)), pins=pins, **opts)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        pm(x, y).backward()
        opt.step()
        opt.zero_grad()
        pms.append(pm)
        opts_.append(opt)
    msd, osd = get_state_dict(pms[0], opts_[0])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    msd2, osd2 = get_state_dict(pms[1], opts_[1])
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    # strict=False: Net's never-used layer has no optimizer state (as in one process)
    set_state_dict(pms[1], opts_[1], model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    same = lambda: all(torch.equal(a, b) for a, b in  # noqa: E731
                       zip(pms[0].full_state_dict().values(), pms[1].full_state_dict().values()))
    loaded = same()
    for pm, opt in zip(pms, opts_):
        pm(x, y).backward()
        opt.step()
    return {"loaded": loaded, "stepped": same(),
            "zero_axes": list(pms[0].plan.decisions.zero_axes)}


def dcp_pipeline(c: dict) -> dict:
    """DCP save and load under interleaved 1F1B (each rank holds two model chunks'
    weights and AdamW state): a module with other weights loads every parameter and
    moment bit-exactly, then trains on exactly like the saved one."""
    import gpt
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    # pipeline ranks hold different parameters, so their optimizers' param_groups differ:
    # flattened, each parameter's hyperparameters are saved under its own name (as
    # torchtitan does under pipelining); nested, DCP keeps one rank's groups
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model, ex = gpt.build(layers=2)
    opts = c.get("options") or {"pipeline_stages": 2, "micro_batches": 4,
                                "schedule": "interleaved-1f1b", "virtual_stages": 2}

    def trained(m: nn.Module):
        pm = auto_parallel(m, example_inputs=ex, mesh=_mesh((2,)), **opts)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        pm.train_step(*ex)
        opt.step()
        return pm, opt

    pm, opt = trained(copy.deepcopy(model))
    msd, osd = get_state_dict(pm, opt, options=flat)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=c["dir"])
    with torch.no_grad():
        for p in model.parameters():  # other weights: loading must replace every one
            p.add_(1.0)
    pm2, opt2 = trained(model)
    msd2, osd2 = get_state_dict(pm2, opt2, options=flat)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=c["dir"])
    set_state_dict(pm2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=flat)
    a, b = pm.full_state_dict(), pm2.full_state_dict()
    (_, o1), (_, o2) = get_state_dict(pm, opt), get_state_dict(pm2, opt2)
    moments = all(torch.equal(o1["state"][k][m].full_tensor(), o2["state"][k][m].full_tensor())
                  for k in o1["state"] for m in ("exp_avg", "exp_avg_sq"))
    losses = []
    for m, o in ((pm, opt), (pm2, opt2)):
        o.zero_grad()
        losses.append(float(m.train_step(*ex)))
        o.step()
    return {"params": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
            "moments": moments and len(o1["state"]) > 0, "losses": _all(losses),
            "chunks": len(pm.runner.chunks)}
