"""The loss a ParallelModule returns, on every rank, for every loss kind and plan
(run by test_losses.py)."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset

KINDS = ["mse-mean", "mse-sum", "l1-mean", "ce-mean", "ce-sum", "ce-ignore", "ce-smooth", "nll-mean",
         "user-mean", "user-sum-div", "mse-none-mean"]


class LossNet(nn.Module):
    """A two-layer MLP ending in the loss named ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        o = self.fc2(torch.relu(self.fc1(x)))
        k = self.kind
        if k == "mse-mean":
            return F.mse_loss(o, y)
        if k == "mse-sum":
            return F.mse_loss(o, y, reduction="sum")
        if k == "mse-none-mean":
            return F.mse_loss(o, y, reduction="none").mean()
        if k == "l1-mean":
            return F.l1_loss(o, y)
        if k == "ce-mean":
            return F.cross_entropy(o, t)
        if k == "ce-sum":
            return F.cross_entropy(o, t, reduction="sum")
        if k == "ce-ignore":
            return F.cross_entropy(o, t.masked_fill(t % 3 == 0, -100), ignore_index=-100)
        if k == "ce-smooth":
            return F.cross_entropy(o, t, label_smoothing=0.1)
        if k == "nll-mean":
            return F.nll_loss(F.log_softmax(o, -1), t)
        if k == "user-mean":
            return (o - y).pow(2).mean()
        if k == "user-sum-div":
            return (o - y).pow(2).sum() / o.shape[0]
        raise ValueError(k)


def losses(c: dict) -> dict:
    """Every loss kind under the plan ``c["pins"]`` selects; every rank's loss."""
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = LossNet(kind)
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        ex = (torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g),
              torch.randint(0, 8, (8,), generator=g))
        reset()
        try:
            pm = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=tuple(c["mesh"])),
                               pins=c.get("pins", {}), search="ilp")
            loss = pm(*ex)
            loss.backward()
            rl = ref(*ex)
            rl.backward()
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, loss.item())
            grads = pm.full_grads()
            err = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
            out[kind] = {"losses": every, "ref": rl.item(), "grad_err": err,
                         "grad_scale": max(p.grad.abs().max().item() for p in ref.parameters())}
        except Exception:  # noqa: BLE001 - reported per kind
            import traceback
            out[kind] = {"error": traceback.format_exc()[-1500:]}
            print(kind, out[kind], file=sys.stderr)
    return out


def mlp_example(c: dict) -> dict:
    """examples/mlp.py at batch 4096 under the planner's choice (the issue's case)."""
    import mlp

    model, ex = mlp.build(batch=4096)
    ref = copy.deepcopy(model)
    reset()
    pm = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=tuple(c["mesh"])))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, pm(*ex).item())
    return {"losses": every, "ref": ref(*ex).item(), "params": pm.plan.params()}


def run(c: dict) -> dict:
    """Dispatch."""
    return {"losses": losses, "mlp": mlp_example}[c["fn"]](c)
