"""Gradient buffers that serve every step (autopar/runtime/grad_sync.py), seen from a
training loop on real ranks: run by test_training_loop.py through loop_cases.py."""

from __future__ import annotations

import copy
import weakref

import torch

from autopar import auto_parallel
from tests.dist.loop_cases import Net, _batch, _mesh


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def kept_gradients(c: dict) -> dict:
    """Data parallel, one bucket per parameter: the DTensor gradients and their buffers
    serve the next step; a gradient the loop keeps across ``zero_grad()`` (the DTensor,
    or its ``to_local()``) keeps its values; ``zero_grad(set_to_none=False)`` and
    accumulation over two backwards still give the single process's gradients."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = _batch()
    # bucket_bytes=1: each parameter alone in its bucket, so one kept gradient pins
    # one buffer (ZeRO pinned off: with such buckets the planner prefers ZeRO-3)
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(c["mesh"]),
                       pins={"*": "R", "input:0": "S(0)", "input:1": "S(0)"}, bucket_bytes=1,
                       zero_stage=0)
    opt = torch.optim.SGD(pm.parameters(), lr=0.0)  # zero_grad only: weights stay put
    batches = [(x * (k + 1), y.flip(0) * (k + 1)) for k in range(4)]

    def reference(*steps) -> dict[str, torch.Tensor]:
        ref.zero_grad(set_to_none=True)
        for k in steps:
            ref(*batches[k]).backward()
        return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                for n, p in ref.named_parameters() if p.grad is not None}

    def err(want: dict[str, torch.Tensor]) -> float:
        got = pm.full_grads()
        return max((got[n] - g).abs().max().item() for n, g in want.items())

    pm(*batches[0]).backward()
    errs = [err(reference(0))]
    named = dict(pm.named_parameters())
    first = {n: weakref.ref(p.grad) for n, p in named.items() if p.grad is not None}
    kept, kept_local = named["fc2.weight"].grad, named["fc1.bias"].grad.to_local()
    kept_values = (kept.to_local().clone(), kept_local.clone())
    opt.zero_grad(set_to_none=True)
    pm(*batches[1]).backward()
    errs.append(err(reference(1)))
    # the same DTensor gradient objects again, except where the loop kept one
    same = sorted(n for n, w in first.items() if named[n].grad is w())
    intact = torch.equal(kept.to_local(), kept_values[0]) and torch.equal(kept_local, kept_values[1])
    pm(*batches[2]).backward()  # no zero_grad: accumulates
    errs.append(err(reference(1, 2)))
    opt.zero_grad(set_to_none=False)  # zeros in place
    pm(*batches[3]).backward()
    errs.append(err(reference(3)))
    return {"errs": errs, "same": same, "intact": intact,
            "names": sorted(first), "kept_plan": pm.plan.decisions.grad_buffers_kept}


def accumulated_backwards(c: dict) -> dict:
    """Three ``backward()`` calls without ``zero_grad()`` between them (gradient
    accumulation as a plain loop writes it), then ``zero_grad()`` and one more: the
    gradients after each against the single process's.  ``c["kw"]``: the plan's
    options; ``c["local"]``: each data-parallel rank passes its rows."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = _batch()
    kw = dict(c["kw"])
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(c["mesh"]), **kw)
    ways, part = (dist.get_world_size(), dist.get_rank()) if c.get("local") else (1, 0)
    n = x.shape[0] // ways
    errs = []
    for k in range(4):
        if k == 3:
            ref.zero_grad(set_to_none=True)
            pm.zero_grad(set_to_none=True)
        xb, yb = x * (k + 1), y.flip(0) * (k + 1)
        ref(xb, yb).backward()
        args = (xb[part * n:(part + 1) * n], yb[part * n:(part + 1) * n])
        if kw.get("micro_batches", 1) > 1:
            pm.train_step(*args)
        else:
            pm(*args).backward()
        got = pm.full_grads()
        errs.append(max((got[m] - p.grad).abs().max().item()
                        for m, p in ref.named_parameters() if p.grad is not None))
    return {"errs": errs, "layout": pm.plan.summary().splitlines()[1]}


def grads_around_backward(c: dict) -> dict:
    """Data parallel: ``torch.autograd.grad`` after a reducing backward leaves the
    parameters' gradients as they were (it adds to none and reduces nothing); a
    ``zero_grad()`` between a forward and its backward (``out = pm(x);
    opt.zero_grad(); out.backward()``) leaves only that backward's gradients; the
    DTensor gradients kept for the next step are those of bucketed parameters only."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = _batch()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=_mesh(c["mesh"]), pins=c["pins"], zero_stage=0)
    opt = torch.optim.SGD(pm.parameters(), lr=0.0)

    def err(*steps) -> float:
        ref.zero_grad(set_to_none=True)
        for k in steps:
            ref(x * (k + 1), y).backward()
        got = pm.full_grads()
        return max((got[n] - p.grad).abs().max().item() for n, p in ref.named_parameters()
                   if p.grad is not None)

    pm(x, y).backward()
    xi = (x * 2).requires_grad_()
    gx = torch.autograd.grad(pm(xi, y), xi)[0]  # an input's gradient: no .grad touched
    after_grad = err(0)
    out = pm(x * 3, y)
    opt.zero_grad(set_to_none=True)
    out.backward()
    after_zero = err(2)
    names = {id(p): n for n, p in pm.inner.named_parameters()}
    bucketed = sorted(names[id(p)] for b in pm.grad_sync.buckets for p in b.params)
    cached = sorted(e.target for e in pm._dparams.entries if e.grad is not None)
    return {"after_grad": after_grad, "after_zero": after_zero, "gx": bool(gx.abs().sum() > 0),
            "bucketed": bucketed, "cached": cached}
