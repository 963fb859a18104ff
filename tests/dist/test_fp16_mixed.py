"""``precision="fp16-mixed"`` with loss scaling on real gloo ranks (issue 10).

Each case plans examples/gpt.py (2 layers) with fp16 casts in its graph and trains it
three steps in the loop a user writes for fp16 (``scaler = pm.grad_scaler()``,
``pm.train_step``, ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``,
``scaler.update``) against the single-process model under
``torch.autocast("cpu", torch.float16)`` with ``torch.amp.GradScaler``, from the same
weights and the same initial scale.  Then one rank alone gets an inf in a gradient:
every rank must skip the step and halve its scale (a rank that stepped would leave the
replicas apart for good).

Tolerances (fp16 has a 10-bit mantissa, relative rounding 2**-11 = 4.9e-4 per op, four
times finer than bf16's, so test_mixed_precision.py's bf16 bounds hold with margin).
Loss: each rank runs the reference's casts on its rows and the loss is computed in
fp32, rtol 1e-3 (a tensor-parallel matmul rounds each rank's partial sum to fp16
before the all-reduce).  Gradients, unscaled, after the first step: 5e-4 + 1e-2 x the
largest gradient.  After clipped AdamW steps (lr 1e-3) an element whose gradient is
within fp16 noise of zero may step +lr on one side and -lr on the other, so elementwise
parameters agree to 2 lr per step (6e-3 after three), and the update as a whole to 10%
of its norm, where a wrong update (a skipped step, an unscaled gradient, a lost shard)
is off by 100%.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_fn_cases
from tests.dist.test_equivalence import MEGATRON

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
ONE = {"pipeline_stages": 1}
CASES = [
    {"id": "fp16-dp2", "pins": DP, "options": ONE},
    {"id": "fp16-tp2", "pins": MEGATRON["gpt"], "options": ONE},
    {"id": "fp16-zero3-dp2", "pins": DP, "options": {**ONE, "zero_stage": 3}},
    {"id": "fp16-pp2", "pins": {}, "options": {"pipeline_stages": 2, "micro_batches": 2,
                                               "schedule": "1f1b"}},
]
STEPS, LR, SCALE = 3, 1e-3, 2.0 ** 12


def fp16_case(c: dict) -> dict:
    """Run on every rank: train ``c`` and the reference; rank 0's numbers come back."""
    import copy

    import gpt
    import torch
    import torch.distributed as dist

    from autopar import MeshSpec, auto_parallel
    from autopar.runtime.mesh import reset

    torch.manual_seed(0)
    model, (x, y) = gpt.build(layers=2, dim=64, heads=4, vocab=128, seq=16, batch=8)
    ref = copy.deepcopy(model)
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    reset()
    pm = auto_parallel(model, example_inputs=(x, y), mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       pins=c["pins"], precision="fp16-mixed", **c["options"])
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler = pm.grad_scaler(init_scale=SCALE)
    rscaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    res: dict = {"losses": [], "ref_losses": [], "scales": [], "ref_scales": []}
    for step in range(STEPS):
        loss = pm.train_step(x, y)
        with torch.autocast("cpu", dtype=torch.float16):
            rl = ref(x, y)
        rscaler.scale(rl).backward()
        scaler.unscale_(opt)
        rscaler.unscale_(ropt)
        if step == 0:
            names = [n for n, _ in ref.named_parameters()]
            grads = pm.full_grads()
            res["grad_err"] = max((grads[n].float() - p.grad.float()).abs().max().item()
                                  for n, p in ref.named_parameters())
            res["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters())
            res["grad_dtypes"] = sorted({str(grads[n].dtype) for n in names})
        torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(opt)
        rscaler.step(ropt)
        scaler.update()
        rscaler.update()
        opt.zero_grad()
        ropt.zero_grad()
        res["losses"].append(loss.item())
        res["ref_losses"].append(rl.item())
        res["scales"].append(scaler.get_scale())
        res["ref_scales"].append(rscaler.get_scale())
    full = pm.full_state_dict()
    rsd = ref.state_dict()
    res["adam_err"] = max((full[k].float() - rsd[k].float()).abs().max().item() for k in rsd)
    num = sum(((full[k].float() - rsd[k].float()) ** 2).sum().item() for k in rsd) ** 0.5
    den = sum(((rsd[k].float() - start[k].float()) ** 2).sum().item() for k in rsd) ** 0.5
    res["update_rel"] = num / den
    res["param_dtypes"] = sorted({str(v.dtype) for v in full.values() if v.is_floating_point()})
    res["code_casts"] = pm.code.count("torch.float16")
    # an inf in one rank's gradient only: every rank skips and halves its scale
    pm.train_step(x, y)
    if dist.get_rank() == 0:
        p = next(q for q in pm.parameters() if q.grad is not None)
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g.view(-1)[0] = float("inf")
    before = pm.full_state_dict()
    scale = scaler.get_scale()
    scaler.step(opt)  # unscales first
    scaler.update()
    after = pm.full_state_dict()
    changed = torch.tensor([float(any(not torch.equal(before[k], after[k]) for k in before))])
    dist.all_reduce(changed, op=dist.ReduceOp.MAX)
    scales = [None] * dist.get_world_size()
    dist.all_gather_object(scales, scaler.get_scale())
    res["inf_changed"], res["inf_scales"], res["inf_scale_before"] = changed.item(), scales, scale
    return res


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return run_fn_cases(2, "tests.dist.test_fp16_mixed:fp16_case", CASES)


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_fp16_mixed_matches_autocast_with_grad_scaler(results: dict, case: str) -> None:
    r = results[case]
    assert "error" not in r, r.get("error")
    for loss, ref in zip(r["losses"], r["ref_losses"]):
        assert loss == pytest.approx(ref, rel=1e-3)
    assert r["grad_err"] <= 5e-4 + 1e-2 * r["grad_scale"], r["grad_err"]
    assert r["adam_err"] <= 2 * LR * STEPS, r["adam_err"]
    assert r["update_rel"] <= 0.1, r["update_rel"]
    # no step overflowed on either side, so the scales moved alike
    assert r["scales"] == r["ref_scales"]
    # fp32 master weights and gradients; the graph computes in fp16
    assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"]
    assert r["code_casts"] > 0


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(results: dict, case: str) -> None:
    r = results[case]
    assert "error" not in r, r.get("error")
    assert r["inf_changed"] == 0.0, "a rank stepped although a gradient was inf"
    assert r["inf_scales"] == [r["inf_scale_before"] / 2] * 2
