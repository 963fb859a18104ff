"""Gradients across steps (autopar/runtime/grad_sync.py), seen from a training loop on
real ranks: run by test_training_loop.py through loop_cases.py."""

from __future__ import annotations

import copy

import torch

from autopar import auto_parallel
from tests.dist.loop_cases import Net, _batch, _mesh


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


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
