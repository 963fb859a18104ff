"""``@auto_parallel(mesh=...)`` on a factory plans on the first batch and trains on
real gloo ranks like the single-process model."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_fn_cases


def decorated(_case: dict) -> dict:
    """Every rank of tests/dist/harness.py's 2-rank group: the decorated factory's
    module and the plain model, two SGD steps each."""
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
    return {"losses": losses, "planned": model.pmodel is not None}


def test_decorated_factory_trains_like_the_original() -> None:
    res = run_fn_cases(2, "tests.dist.test_decorator:decorated", [{"id": "d"}])["d"]
    assert "error" not in res, res.get("error")
    assert res["planned"]
    for loss, ref in res["losses"]:
        assert loss == pytest.approx(ref, rel=1e-5)
