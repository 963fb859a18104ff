"""Parameters under ZeRO keep their shapes, as FSDP2's do (issue 64, habit 7); run by
test_zero_shapes.py on real gloo ranks.  Every rank runs each case; rank 0's answer
comes back."""

from __future__ import annotations

import copy

import gpt
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from autopar import auto_parallel
from autopar.runtime.mesh import reset

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
STEPS, LR, WD = 3, 1e-3, 0.1


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (8, 32), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _model() -> nn.Module:
    """A 2-layer GPT whose embeddings are N(0, 1) (nn.Embedding's own default): large
    enough weights that decaying them or not moves them well past the test's
    tolerance in three steps (lr * wd * |w| = 1e-4 |w| a step)."""
    model, _ = gpt.build(layers=2)
    with torch.no_grad():
        for emb in (model.tok, model.pos):
            emb.weight.normal_(generator=torch.Generator().manual_seed(7))
    return model


class Odd(nn.Module):
    """Dims 0 that divide by no rank count here (5, 7, 3 rows), and one of 1 row: ranks
    hold different numbers of rows, the last ones none."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 7)
        self.fc2 = nn.Linear(7, 5)
        self.fc3 = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(1, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return F.mse_loss(h * self.scale, y)


def _odd_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)


def _groups(params, decay: bool = True) -> list[dict]:
    """The common grouping: no weight decay on biases and norms (``p.dim() < 2``)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD if decay else 0.0},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _train(model: nn.Module, decay: bool = True, batch=_batch) -> list[float]:
    opt = torch.optim.AdamW(_groups(model.parameters(), decay), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*batch(step))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _err(a: dict, b: dict) -> tuple[float, str]:
    worst = max(a, key=lambda k: float((a[k] - b[k]).abs().max()))
    return float((a[worst] - b[worst]).abs().max()), worst


def decay_groups(case: dict) -> dict:
    """AdamW with the ``p.dim() < 2`` no-decay grouping over ZeRO-``case["stage"]`` against
    the single process; also what the single process gets when the grouping puts every
    tensor in the no-decay group (what flat 1-D shards did)."""
    reset()
    odd = case.get("model") == "odd"
    torch.manual_seed(0)
    model, batch = (Odd(), _odd_batch) if odd else (_model(), _batch)
    ref, flat = copy.deepcopy(model), copy.deepcopy(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    mesh = tuple(case.get("mesh", (dist.get_world_size(),)))
    pins = {"*": "R" * len(mesh), "input:0": "S(0)" * len(mesh), "input:1": "S(0)" * len(mesh)}
    pm = auto_parallel(model, example_inputs=batch(0), mesh=mesh, pins=pins,
                       zero_stage=case["stage"], **case.get("options", {}))
    got = {n: (tuple(p.shape), p.dim(), p.numel(), type(p.data).__name__)
           for n, p in pm.named_parameters()}
    rows = {n: list(p.to_local().shape) for n, p in pm.named_parameters()}
    losses = _train(pm, batch=batch)
    ref_losses = _train(ref, batch=batch)
    _train(flat, decay=False, batch=batch)
    full = pm.full_state_dict()
    want = ref.state_dict()
    err, worst = _err(full, want)
    flat_err, _ = _err(flat.state_dict(), want)
    return {"layout": next(ln for ln in pm.plan.summary().splitlines() if "layout" in ln),
            "shapes": {n: list(s) for n, s in shapes.items()},
            "got": {n: [list(s), d, k, t] for n, (s, d, k, t) in got.items()},
            "decayed": sum(1 for p in pm.parameters() if p.dim() >= 2),
            "ref_decayed": sum(1 for p in ref.parameters() if p.dim() >= 2),
            "losses": losses, "ref_losses": ref_losses, "err": err, "worst": worst,
            "flat_err": flat_err, "rows": _all(rows)}


def _all(x) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def _dtensors(sd: dict) -> dict:
    return {k: [type(v).__name__, list(v.shape),
                [str(p) for p in v.placements] if isinstance(v, DTensor) else []]
            for k, v in sd.items()}


def save_alone(case: dict) -> dict:
    """Rank 0 alone calls ``pm.state_dict()`` under ZeRO-3 (DDP's save habit), then every
    rank saves it with DCP, trains on, loads it back and compares."""
    reset()
    model = _model()
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    pm = auto_parallel(model, example_inputs=_batch(0), mesh=(dist.get_world_size(),), pins=DP,
                       zero_stage=3)
    opt = torch.optim.AdamW(_groups(pm.parameters()), lr=LR)
    for step in range(2):
        opt.zero_grad()
        pm(*_batch(step)).backward()
        opt.step()
    alone = _dtensors(pm.state_dict()) if dist.get_rank() == 0 else None
    dist.barrier()  # rank 1 waits here: a collective in rank 0's call would never finish
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    dcp.save(pm.state_dict(), checkpoint_id=case["ckpt"])
    opt.zero_grad()
    pm(*_batch(5)).backward()
    opt.step()
    moved = _err(pm.full_state_dict(), before)[0]
    sd = pm.state_dict()
    dcp.load(sd, checkpoint_id=case["ckpt"])
    pm.load_state_dict(sd)
    after = pm.full_state_dict()
    return {"alone": alone, "shapes": shapes, "moved": moved,
            "exact": sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)}
