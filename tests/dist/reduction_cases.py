"""A 2-norm and a variance over the hidden dim that tensor parallelism splits, on real
gloo ranks (run by test_split_reductions.py): the planner lowers them to all-reduced
sums (autopar/runtime/reductions.py) and the loss and gradients are the single
process's."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset

# Megatron's column/row split, and fc1's output and the product kept split on the hidden
# dim (pins name nodes), so the norm and the variance choose between gathering it and
# their local forms
PINS = {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)", "fc2.bias": "R",
        "linear": "S(1)", "mul": "S(1)"}


def _mesh() -> MeshSpec:
    """gloo's mesh priced without latency: at these toy sizes every collective costs its
    latency, and the planner rightly gathers the hidden dim once rather than all-reduce
    six times; without it the bytes decide, as at a real model's sizes."""
    m = MeshSpec.preset("cpu-gloo", shape=(2,))
    return dataclasses.replace(m, links=tuple(dataclasses.replace(link, alpha=1e-9, kinds=())
                                              for link in m.links))


class NormNet(nn.Module):
    """Column-parallel fc1 leaves its output split on the hidden dim; the norm and the
    variance reduce that dim."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h / torch.linalg.vector_norm(h, dim=-1, keepdim=True) * h.var(-1, keepdim=True)
        return F.mse_loss(self.fc2(h), y)


def run(c: dict) -> dict:
    """Loss, gradient error against one process, and the placements of the reductions."""
    torch.manual_seed(0)
    model = NormNet()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ex = (torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g))
    reset()
    pm = auto_parallel(model, example_inputs=ex, mesh=_mesh(), pins=PINS, search="ilp")
    loss = pm(*ex)
    loss.backward()
    rl = ref(*ex)
    rl.backward()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, loss.item())
    grads = pm.full_grads()
    err = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    placed = {n.op: n.in_placements[0] for n in pm.plan.nodes.values()
              if n.op in ("linalg_vector_norm", "var.dim")}
    return {"losses": every, "ref": rl.item(), "grad_err": err, "grad_scale": scale,
            "placed": placed}
