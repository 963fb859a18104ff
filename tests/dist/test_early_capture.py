"""The ranks other than 0 capture the model while rank 0 plans, not after its plan
arrives (that capture was on their path to the first step), and use it when the plan
is for the micro-batch size they guessed: the whole batch, or the forced count."""

from __future__ import annotations

import time

from tests.dist.harness import run_fn_cases


def capture_times(case: dict) -> dict:
    """Every rank of a 2-rank group plans ``mlp`` (``micro_batches`` forced or not);
    rank 0 returns when each rank started its captures and began to wait for rank 0's
    plan, and both ranks' first losses against the plain model's."""
    import mlp
    import torch.distributed as dist

    import autopar.api as api
    from autopar import auto_parallel
    from autopar.runtime import agree
    from autopar.runtime.mesh import reset

    reset()
    model, (x, y) = mlp.build()
    expected = float(model(x, y))
    starts: list[float] = []
    waited: list[float] = []
    real_capture, real_wait = api.capture, agree.wait

    def capture(*a, **k):
        starts.append(time.time())
        return real_capture(*a, **k)

    def wait(timeout):
        waited.append(time.time())
        return real_wait(timeout)

    api.capture, agree.wait = capture, wait
    try:
        forced = {"micro_batches": case["micro"]} if case["micro"] else {}
        pm = auto_parallel(model, example_inputs=(x, y), mesh=(2,), **forced)
        # (micro-batches: forward and backward in one call)
        loss = float(pm.train_step(x, y) if case["micro"] else pm(x, y))
    finally:
        api.capture, agree.wait = real_capture, real_wait
    every = [None, None]
    dist.all_gather_object(every, {"starts": starts, "waited": waited, "loss": loss,
                                   "micro": pm.plan.decisions.micro_batches})
    return {"ranks": every, "expected": expected}


def test_other_ranks_capture_while_rank_0_plans() -> None:
    out = run_fn_cases(2, "tests.dist.test_early_capture:capture_times",
                       [{"id": "whole", "micro": None}, {"id": "forced", "micro": 2}])
    for name, micro in (("whole", 1), ("forced", 2)):
        res = out[name]
        assert "error" not in res, res.get("error")
        r0, r1 = res["ranks"]
        assert r0["micro"] == r1["micro"] == micro
        # rank 1 captured once, before it began to wait for the plan (could be false:
        # a capture taken after the plan arrived, as before, starts after the wait)
        assert len(r1["starts"]) == 1 and len(r1["waited"]) == 1 and not r0["waited"]
        assert r1["starts"][0] < r1["waited"][0]
        # the plan ran on the early capture: both ranks' losses are the model's (the mean
        # over the batch; float32 sums in another order: 1e-5)
        for r in (r0, r1):
            assert abs(r["loss"] - res["expected"]) <= 1e-5 * max(1.0, abs(res["expected"]))
