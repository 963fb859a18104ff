"""A plain training loop prints only warnings that ask the user to act.

On torch 2.13 the first call's check that every rank was called alike used
``all_gather_into_tensor``, deprecated there: one ``FutureWarning`` per rank from the
first step on.  (The shutdown's ``reduce_op`` warnings: tests/unit/test_release_groups.py.)
"""

from __future__ import annotations

import warnings

import torch

from tests.dist.harness import run_fn_cases


def loop_warnings(_case: dict) -> dict:
    """Every rank of a 2-rank group: plan, two clipped AdamW steps, shut down; the
    deprecation warnings raised meanwhile."""
    import mlp

    from autopar import auto_parallel
    from autopar.runtime.mesh import reset

    reset()
    model, (x, y) = mlp.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = auto_parallel(model, example_inputs=(x, y), mesh=(2,))
        opt = torch.optim.AdamW(pm.parameters())
        for _ in range(2):
            pm(x, y).backward()
            torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return {"deprecations": sorted({f"{w.category.__name__}: {w.message}" for w in caught
                                    if issubclass(w.category, (FutureWarning, DeprecationWarning))})}


def test_a_training_loop_prints_no_deprecation_warning() -> None:
    res = run_fn_cases(2, "tests.dist.test_quiet:loop_warnings", [{"id": "q"}])["q"]
    assert "error" not in res, res.get("error")
    assert res["deprecations"] == []
