"""A preset named without a shape under torchrun: the world is the device count and the
mesh shape is searched (issue 47).  Four gloo ranks run the plan it gives and train."""

from __future__ import annotations

import torch

from tests.dist.harness import run_fn_cases


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 256, (8, 32), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _losses(module) -> list[float]:
    """Three AdamW steps of ``module`` (the parallel one or the plain model)."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    out = []
    for step in range(3):
        loss = module(*_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def train(case: dict) -> dict:
    """Every rank: plan with mesh="cpu-gloo", train 3 AdamW steps, return rank 0's view."""
    import gpt
    import torch.distributed as dist

    from autopar import auto_parallel

    model, _ = gpt.build(layers=2, dim=64, heads=4, seq=32, batch=8)
    pm = auto_parallel(model, example_inputs=_batch(0), mesh="cpu-gloo")
    losses = _losses(pm)
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, list(pm.plan.request.mesh_shape))
    return {"shapes": shapes, "searched": [r["shape"] for r in pm.plan.decisions.mesh_shapes],
            "losses": losses}


def _reference() -> list[float]:
    import gpt

    model, _ = gpt.build(layers=2, dim=64, heads=4, seq=32, batch=8)
    return _losses(model)


def test_preset_without_shape_searches_the_worlds_shape() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    got = run_fn_cases(4, "tests.dist.test_mesh_search_run:train", [{"id": "run"}])["run"]
    # every rank runs the same searched shape, one of 4 devices' shapes
    assert len({tuple(s) for s in got["shapes"]}) == 1
    assert sorted(map(tuple, got["searched"])) == [(2, 2), (4,)]
    # the same training as one process: fp32 sums in another order over 4 ranks
    # (test_equivalence's data-parallel tolerance)
    ref = _reference()
    assert max(abs(a - b) for a, b in zip(got["losses"], ref)) < 1e-4
