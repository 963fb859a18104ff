"""Host offload (decision ``offload``) trains exactly, on real gloo ranks, against the
single process: loss, every gradient and the parameters after two SGD-with-momentum and
two AdamW steps (test_equivalence.py's tolerances: the module only moves values between
copies, so nothing is computed differently from the same plan without offload).  On a
CPU the host copies live in the same memory as the device's, but they are separate
tensors: the optimizer steps the host copy, and a stale device copy would show as a
parameter error after the first step."""

from __future__ import annotations

import pytest

from tests.dist.harness import Case, run_cases, run_fn_cases
from tests.dist.test_equivalence import check

GPT2 = {"layers": 2}
DP = {"*": "R", "input:0": "S(0)"}
ONE = {"pipeline_stages": 1, "micro_batches": 1}
CASES = [
    Case("optimizer-dp2", "gpt", (2,), DP, GPT2, options={"offload": "optimizer", "zero_stage": 0, **ONE}),
    Case("optimizer-zero1", "gpt", (2,), DP, GPT2, options={"offload": "optimizer", "zero_stage": 1, **ONE}),
    Case("optimizer-accumulate", "gpt", (2,), DP, GPT2,
         options={"offload": "optimizer", "zero_stage": 0, "pipeline_stages": 1, "micro_batches": 2}),
    Case("params-zero3", "gpt", (2,), DP, GPT2, options={"offload": "params", **ONE}),
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return run_cases(2, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_offload_trains_exactly(results, case) -> None:
    res = results[case.id]
    check(res)
    memory = res["decisions"]["memory"]
    assert memory["optimizer"] == 0.0  # the optimizer state is on the host
    if case.options["offload"] == "params":
        assert res["decisions"]["zero"] == 3 and memory["params"] == 0.0


def hosted(c: dict) -> dict:
    """Every rank: where the optimizer's tensors are, and a load reaching them."""
    import copy

    import gpt
    import torch

    from autopar import auto_parallel
    model, (x, y) = gpt.build(layers=1)
    ref = copy.deepcopy(model)
    pm = auto_parallel(model, example_inputs=(x, y), mesh=(2,), pins=DP, zero_stage=0,
                       offload="optimizer")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(x, y).backward()
    opt.step()
    inner = dict(pm.inner.named_parameters())
    entries = pm._dparams.entries
    apart = all(e.host.data_ptr() != e.local.data_ptr() for e in entries)
    state_on_host = all(s["exp_avg"].to_local().data_ptr() != e.local.data_ptr()
                        for e in entries for s in [opt.state[e.param]])
    # the step changed the host copies only, until the next forward copies them down
    stale = any(not torch.equal(e.host, e.local) for e in entries)
    pm(x, y)
    synced = all(torch.equal(e.host, e.local) for e in entries)
    # loading the original weights reaches the copies the optimizer steps
    pm.load_state_dict(ref.state_dict())
    loaded = max((p.full_tensor() - ref.state_dict()[n]).abs().max().item()
                 for n, p in pm.named_parameters())
    return {"apart": apart, "state_on_host": state_on_host, "stale": stale, "synced": synced,
            "loaded": loaded, "inner": len(inner), "summary": pm.plan.summary()}


def resumed(c: dict) -> dict:
    """Every rank: an ordinary loop (AdamW, an LR schedule, clip_grad_norm_) under
    ``offload=c["offload"]``, saved after two steps and resumed into a fresh module, both
    then taking a third step: the parameters of the two third steps."""
    import gpt
    import torch

    import autopar

    def build():
        model, (x, y) = gpt.build(layers=1)
        pm = autopar.auto_parallel(model, example_inputs=(x, y), mesh=(2,), offload=c["offload"],
                                   **({"zero_stage": 3} if c["offload"] == "params" else {}))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return pm, opt, sched, (x, y)

    def step(pm, opt, sched, batch) -> None:
        opt.zero_grad()
        pm(*batch).backward()
        torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.5)
        opt.step()
        sched.step()

    pm, opt, sched, batch = build()
    for _ in range(2):
        step(pm, opt, sched, batch)
    autopar.save_checkpoint(pm, opt, c["dir"], scheduler=sched)
    step(pm, opt, sched, batch)
    first = pm.full_state_dict()  # the parameters in their own shapes (ZeRO's are flat)
    pm2, opt2, sched2, _ = build()
    autopar.load_checkpoint(pm2, opt2, c["dir"], scheduler=sched2)
    step(pm2, opt2, sched2, batch)
    second = pm2.full_state_dict()
    return {"err": max((first[n] - second[n]).abs().max().item() for n in first),
            "moved": max((first[n] - gpt.build(layers=1)[0].state_dict()[n]).abs().max().item()
                         for n in first),
            "offload": pm2.plan.decisions.offload}


@pytest.mark.parametrize("level", ["optimizer", "params"])
def test_resumes_exactly(level, tmp_path) -> None:
    r = run_fn_cases(2, "tests.dist.test_offload:resumed",
                     [{"id": "r", "offload": level, "dir": str(tmp_path / "ckpt")}])["r"]
    assert r["offload"] == level
    assert r["moved"] > 1e-3  # the steps trained
    assert r["err"] == 0.0  # the same third step from the saved state


def test_optimizer_steps_host_copies() -> None:
    r = run_fn_cases(2, "tests.dist.test_offload:hosted", [{"id": "h"}])["h"]
    assert r["apart"] and r["state_on_host"]
    assert r["stale"] and r["synced"]
    assert r["loaded"] == 0.0
    assert "  offload        the optimizer state" in r["summary"]
