"""Gradient compression on real ranks (decision ``grad_compression``), run by
test_compression.py and benchmarks/grad_compression.py: a data-parallel MLP trained as a
user would (AdamW as it comes, ``model(x, y).backward()``), against the single process."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar import MeshSpec, auto_parallel

DATA_PARALLEL = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


class Wide(nn.Module):
    """``depth`` square linear layers of ``width``: few rows per rank make the
    gradient all-reduce the step (communication-bound); many make it compute."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for lin in self.layers[:-1]:
            x = torch.tanh(lin(x))
        return F.mse_loss(self.layers[-1](x), y)


def _task(width: int, rows: int, batch: int = 0, noise: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``batch`` of a regression task whose target a fixed low-rank map of the
    input gives, plus ``noise`` (the loss no model goes below is about ``noise**2``)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(width, 4, generator=g) @ torch.randn(4, width, generator=g) / width ** 0.5
    g.manual_seed(1 + batch)
    x = torch.randn(rows, width, generator=g)
    return x, torch.tanh(x @ w) + noise * torch.randn(rows, width, generator=g)


_CALIBRATED: list[MeshSpec] = []


def mesh_for(c: dict) -> MeshSpec:
    """The ``cpu-gloo`` preset, or with ``c["calibrate"]`` the running group's numbers
    (measured once per process)."""
    if not c.get("calibrate"):
        return MeshSpec.preset("cpu-gloo", shape=(dist.get_world_size(),))
    if not _CALIBRATED:
        from autopar.cost_models.calibrate import calibrate
        _CALIBRATED.append(calibrate())
    return _CALIBRATED[0]


def _plan(c: dict, model: nn.Module, ex: tuple, compression: str | None):
    return auto_parallel(model, example_inputs=ex, mesh=mesh_for(c), pins=DATA_PARALLEL,
                         zero_stage=0, grad_compression=compression, **c.get("options", {}))


def gradients(c: dict) -> dict:
    """One backward under ``c["kind"]``: the largest gradient error against the single
    process, relative to the gradient's largest element, and what the plan decided."""
    torch.manual_seed(0)
    model = Wide(c["width"], c["depth"])
    ref = copy.deepcopy(model)
    ex = _task(c["width"], c["rows"])
    pm = _plan(c, model, ex, c["kind"])
    pm(*ex).backward()
    ref(*ex).backward()
    got = pm.full_grads()
    err = max(((got[n] - p.grad).abs().max() / p.grad.abs().max()).item()
              for n, p in ref.named_parameters())
    d = pm.plan.decisions
    return {"err": err, "kind": d.grad_compression, "rank": d.compression_rank,
            "why": pm.plan.explain("compression"), "summary": pm.plan.summary()}


def converge(c: dict) -> dict:
    """``c["steps"]`` AdamW steps on the regression task, a new batch each step (the
    loss then measures the model, not how well it memorised one batch), with whole
    gradients and with ``c["kind"]``: both runs' last losses (the mean of the last
    ten steps)."""
    out = {}
    for kind in ("none", c["kind"]):
        torch.manual_seed(0)
        model = Wide(c["width"], c["depth"])
        ex = _task(c["width"], c["rows"], noise=c.get("noise", 0.0))
        pm = _plan(c, model, ex, kind)
        opt = torch.optim.AdamW(pm.parameters(), lr=c.get("lr", 1e-3))
        losses = []
        for k in range(c["steps"]):
            opt.zero_grad()
            loss = pm(*_task(c["width"], c["rows"], k, c.get("noise", 0.0)))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[kind] = sum(losses[-10:]) / 10
        out[f"{kind}_first"] = losses[0]
        out[f"{kind}_decided"] = pm.plan.decisions.grad_compression
    return out


def interleaved(runs: dict, backward, warm: int, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each ``(module, optimizer)`` in ``runs``: ``warm``
    steps each, then ``rounds`` rounds of ``steps`` steps of each in turn (zero_grad,
    ``backward(module)``, step), each round timed as the slowest rank's."""
    def step(pm, opt) -> None:
        opt.zero_grad()
        backward(pm)
        opt.step()

    for pm, opt in runs.values():
        for _ in range(warm):
            step(pm, opt)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, (pm, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(pm, opt)
            t = torch.tensor([(time.perf_counter() - t0) / steps])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def timed(c: dict) -> dict:
    """Measured and predicted steps of every kind in ``c["kinds"]`` on one model,
    interleaved (``c["rounds"]`` rounds of ``c["steps"]`` steps each, after PowerSGD's
    uncompressed warm-up), medians per step; and the kind ``"auto"`` picks."""
    torch.manual_seed(0)
    base = Wide(c["width"], c["depth"])
    ex = _task(c["width"], c["rows"])
    runs = {}
    for kind in c["kinds"]:
        pm = _plan(c, copy.deepcopy(base), ex, kind)
        opt = torch.optim.AdamW(pm.parameters())
        runs[kind] = (pm, opt)
    auto = _plan(c, copy.deepcopy(base), ex, "auto").plan.decisions

    # warm-up: PowerSGD's whole steps, first-call checks
    med = interleaved(runs, lambda pm: pm(*ex).backward(), 12, c["rounds"], c["steps"])
    return {"measured": med,
            "predicted": {k: pm.plan.decisions.step_seconds for k, (pm, _) in runs.items()},
            "exposed": {k: pm.plan.decisions.breakdown.get("exposed_comm_seconds", 0.0)
                        for k, (pm, _) in runs.items()},
            "auto": auto.grad_compression, "auto_step": auto.step_seconds}
