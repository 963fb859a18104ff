"""Training-loop habits that once gave a silently different run (issue "Nothing silent,
again"), on real gloo ranks; run by test_silent_habits.py.  Every rank runs each case;
a case returns what every rank saw (all-gathered), so the test can assert that each rank
got the same answer or the same clear error."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar import MeshSpec, auto_parallel
from autopar.runtime.mesh import reset

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


class ItemNet(nn.Module):
    """A loss scaled by a Python float read from an activation with ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x, y):
        h = self.fc2(F.relu(self.fc1(x)))
        scale = h.abs().mean().item()  # the batch's mean: a partial sum on a batch shard
        return F.mse_loss(h, y) * scale


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class Three(nn.Module):
    """Three linear layers (two get tensor-parallel pins, the third is the planner's), a
    buffer and a plain tensor attribute (export lifts it as a constant of the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("shift", torch.randn(8))
        self.proj = torch.randn(8, 8)  # neither a parameter nor a buffer

    def forward(self, x, y):
        h = self.fc2(F.relu(self.fc1(x)))
        return F.mse_loss(self.norm(self.fc3(h)) @ self.proj + self.shift, y)


def _batch(n: int = 8, seed: int = 1, d_out: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randn(n, d_out, generator=g)


def _mesh() -> MeshSpec:
    reset()
    return MeshSpec.preset("cpu-gloo", shape=(2,))


def _all(x) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def _outcome(fn) -> dict:
    """What ``fn()`` gave on this rank: its value, or the error's type and message."""
    try:
        return {"value": fn()}
    except Exception as e:  # noqa: BLE001 - the case reports what each rank saw
        return {"error": type(e).__name__, "message": str(e)}


def item_loss(c: dict) -> dict:
    """``.item()`` in the forward: the loss and gradients of the single-process model, on
    two different batches (the value is read per call, not frozen at capture)."""
    torch.manual_seed(0)
    model = ItemNet()
    ref = copy.deepcopy(model)
    x, y = _batch()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(), pins=c.get("pins", {}))
    res = {"losses": [], "refs": []}
    for scale in (1.0, 3.0):  # another batch: another mean
        res["losses"].append(pm(x * scale, y).item())
        res["refs"].append(ref(x * scale, y).item())
    loss = pm(x, y)
    loss.backward()
    ref(x, y).backward()
    grads = pm.full_grads()
    res["grad_err"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    res["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters())
    res["all_losses"] = _all(res["losses"])
    return res


def own_batch(c: dict) -> dict:
    """Each rank passes its own batch (the DistributedSampler habit) under the default
    batch="global": every rank must raise the same error, naming batch="local"."""
    torch.manual_seed(0)
    model = Three()
    x, y = _batch()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(), pins=DP)
    mine = _batch(seed=10 + dist.get_rank())
    # the first call is checked (and the first after train()/eval())
    res = {"own": _all(_outcome(lambda: pm(*mine).item())),
           "same": _outcome(lambda: pm(x, y).item())}  # the same batch on every rank runs
    # one rank refused (a keyword argument the plan was not made with): the others stop
    # with an error naming it rather than wait in the step's collectives
    extra = {"scale": 2.0} if dist.get_rank() == 1 else {}
    pm.eval()
    res["one_refused"] = _all(_outcome(lambda: pm(*_batch(8), **extra).item()))
    return res


def local_peers(c: dict) -> dict:
    """batch="local" on a 2x2 mesh (data parallel x tensor parallel): the two
    tensor-parallel peers of a data-parallel rank must pass the same rows."""
    torch.manual_seed(0)
    model = Three()
    x, y = _batch()
    reset()
    pins = {"fc1.weight": "RS(0)", "fc2.weight": "RS(1)", "input:0": "S(0)R", "input:1": "S(0)R"}
    pm = auto_parallel(model, example_inputs=(x, y), mesh=MeshSpec.preset("cpu-gloo", shape=(2, 2)),
                       pins=pins, batch="local")
    rows = slice(4 * pm.data_parallel_rank, 4 * pm.data_parallel_rank + 4)
    good = _outcome(lambda: pm(x[rows], y[rows]).item())
    pm.eval()  # the first call in eval mode is checked again
    bad_x = x[rows] + (dist.get_rank() % 2)  # tensor-parallel peers now differ
    return {"good": _all(good), "bad": _all(_outcome(lambda: pm(bad_x, y[rows]).item()))}


def seeds(c: dict) -> dict:
    """Ranks that built the model with different seeds, tensor-parallel pins on two
    layers and the rest left to the planner: every tensor the plan replicates starts
    equal on every rank (rank 0's), the graph's lifted constants too, and the loss is
    rank 0's model's.  (A sharded one, the planner's fc3 maybe, holds different halves
    of rank 0's tensor on each rank: only its full_tensor() compares.)"""
    torch.manual_seed(100 + dist.get_rank())
    model = Three()
    ref = copy.deepcopy(model)
    x, y = _batch()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(),
                       pins={"fc1.weight": "S(0)", "fc2.weight": "S(1)"})
    spread = {}
    for name, t in [*pm.named_parameters(), *pm.named_buffers()]:
        placements = getattr(t, "placements", ())
        if any(not p.is_replicate() for p in placements):
            continue
        local = (t.to_local() if hasattr(t, "to_local") else t).detach().float()
        every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(every, local.contiguous())
        spread[name] = max((e - every[0]).abs().max().item() for e in every)
    for name, t in [("proj (lifted constant)", pm.inner.proj)]:
        every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(every, t.contiguous())
        spread[name] = max((e - every[0]).abs().max().item() for e in every)
    return {"spread": spread, "loss": pm(x, y).item(), "ref0": _all(ref(x, y).item())[0]}


def dropout_seed(c: dict) -> dict:
    """``torch.manual_seed(s)`` reproduces the masks: the same seed and input give the
    same output, the single process's, while the data-parallel shards draw different
    masks (each rank keeps its rows of one global mask)."""
    torch.manual_seed(0)
    model = DropNet()
    ref = copy.deepcopy(model)
    x = torch.ones(8, 16)  # equal rows: only the masks tell the rows apart
    pm = auto_parallel(model, example_inputs=(x,), mesh=_mesh(), pins={"*": "R", "input:0": "S(0)"})
    torch.manual_seed(3)
    a = pm(x)
    torch.manual_seed(3)
    b = pm(x)
    c_ = pm(x)  # the generator moved on: new masks
    torch.manual_seed(3)
    r = ref(x)
    res = {"repeat_equal": torch.equal(a, b), "next_differs": not torch.equal(b, c_),
           "ref_err": (a - r).abs().max().item(),
           # rows 0-3 are rank 0's shard, 4-7 rank 1's: their masks differ
           "shards_differ": not torch.allclose(a[:4], a[4:])}
    # ranks seeded differently (per-rank seeds for data): a clear error on every rank
    # (a new seed arms the check again)
    torch.manual_seed(50 + dist.get_rank())
    res["per_rank_seeds"] = _all(_outcome(lambda: pm(x).sum().item()))
    pm.eval()  # dropout off: the generators do not matter
    res["eval_per_rank_seeds"] = _all(_outcome(lambda: pm(x).sum().item()))
    return res


def slow_planning(c: dict) -> dict:
    """The user's process group has a timeout shorter than capture and planning (each
    rank's capture made ``c["delay"]`` s longer here: rank 0's before its search, the
    others' after they receive the plan): every rank still gets the module, and it trains."""
    import autopar.api as api

    originals = {"_capture_and_plan": api._capture_and_plan, "capture": api.capture}

    def slowed(fn):
        def slow(*a, **k):
            time.sleep(c["delay"])
            return fn(*a, **k)
        return slow

    for name, fn in originals.items():
        setattr(api, name, slowed(fn))
    try:
        torch.manual_seed(0)
        model = Three()
        ref = copy.deepcopy(model)
        x, y = _batch()
        t0 = time.perf_counter()
        out = _outcome(lambda: auto_parallel(model, example_inputs=(x, y), mesh=_mesh(), pins=DP))
        seconds = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(api, name, fn)
    res = {"built": _all("error" not in out), "seconds": seconds, "error": out.get("message")}
    if all(res["built"]):
        res["loss"], res["ref"] = out["value"](x, y).item(), ref(x, y).item()
    return res


def run(c: dict) -> dict:
    """Dispatch ``c["fn"]``."""
    return globals()[c["fn"]](c)
