"""``@auto_parallel(mesh=...)`` on a factory plans on the first batch and trains on
real gloo ranks like the single-process model."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist.harness import ROOT, free_port


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    sys.path.insert(0, str(ROOT / "examples"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import mlp

    from autopar import auto_parallel
    from autopar.runtime.mesh import reset

    reset()
    ref, ex = mlp.build()
    build = auto_parallel(mesh=(2,))(mlp.build)
    model, _ = build()
    losses = []
    opt = None
    for _ in range(2):
        loss = model(*ex)  # first call plans
        loss.backward()
        opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
        opt.step()
        opt.zero_grad()
        r = ref(*ex)
        r.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append((loss.item(), r.item()))
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "planned": model.pmodel is not None}))
    dist.destroy_process_group()


def test_decorated_factory_trains_like_the_original() -> None:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    assert res["planned"]
    for loss, ref in res["losses"]:
        assert loss == pytest.approx(ref, rel=1e-5)
