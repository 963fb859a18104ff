"""Batch norm trained on real gloo ranks against the single process (run by
test_batch_norm.py): every rank runs each case and returns what it saw."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset
from autopar.runtime.norms import batch_norm as sync_batch_norm


class BNNet(nn.Module):
    """Two conv + BatchNorm2d blocks, pooling, a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.adaptive_avg_pool2d(F.relu(self.bn2(self.conv2(h))), 1)
        return F.cross_entropy(self.fc(torch.flatten(h, 1)), y)


def _all(x) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def _max_err(a: dict, b: dict) -> tuple[float, str]:
    errs = {k: (a[k].double() - b[k].double()).abs().max().item() for k in b}
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def train_bn(c: dict) -> dict:
    """Two SGD steps (momentum) in training mode, then one forward in eval mode: losses,
    parameters and running statistics against the single process's."""
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    reset()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       pins=c.get("pins", {}))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    targets = [n.target for n in pm.inner.graph.nodes if n.op == "call_function"]
    res: dict = {"losses": [], "refs": [],
                 # the local form with synced statistics (or channels split) ran
                 "sync_forms": sum(t is sync_batch_norm for t in targets)}
    for _ in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        loss = pm(x, y)
        loss.backward()
        rl = ref(x, y)
        rl.backward()
        opt.step()
        ropt.step()
        res["losses"].append(loss.item())
        res["refs"].append(rl.item())
    full = pm.full_state_dict()
    rsd = ref.state_dict()
    res["keys_match"] = sorted(full) == sorted(rsd)
    params = {k for k, _ in ref.named_parameters()}
    res["param_err"], res["param_worst"] = _max_err(full, {k: v for k, v in rsd.items() if k in params})
    stats = {k: v for k, v in rsd.items() if "running" in k or "num_batches" in k}
    res["stats_err"], res["stats_worst"] = _max_err(full, stats)
    res["stats_moved"] = rsd["bn1.running_mean"].abs().max().item()
    res["scale"] = max(v.abs().max().item() for k, v in rsd.items() if k in params)
    # every rank's running statistics (whole on each rank): the same values
    mine = {k: v.detach().clone() for k, v in pm.full_state_dict().items() if k in stats}
    res["ranks_stats"] = [{k: v.tolist() for k, v in d.items()} for d in _all(mine)]
    pm.eval()
    ref.eval()
    with torch.no_grad():
        res["eval_loss"], res["eval_ref"] = pm(x, y).item(), ref(x, y).item()
    return res
