"""Host offload measured (decision ``offload``), run by benchmarks/offload.py: one GPT,
planned once per variant (a plan that fits the devices, one under a budget only
offload meets, forced levels), trained with AdamW as it comes, the steps interleaved."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from autopar import auto_parallel
from tests.dist.compression_cases import mesh_for


def timed(c: dict) -> dict:
    """Every rank: each variant of ``c["variants"]`` (name -> auto_parallel options),
    ``c["rounds"]`` rounds of ``c["steps"]`` steps each after 3 warm-up steps, medians
    of the slowest rank's step; with each plan's prediction and decisions."""
    import gpt

    torch.manual_seed(0)
    base, (x, y) = gpt.build(**c["build"])
    runs = {}
    for name, opts in c["variants"].items():
        pm = auto_parallel(copy.deepcopy(base), example_inputs=(x, y), mesh=mesh_for(c), **opts)
        runs[name] = (pm, torch.optim.AdamW(pm.parameters()))

    def step(pm, opt) -> None:
        opt.zero_grad()
        pm.train_step(x, y)  # forward and backward, whatever the plan's schedule
        opt.step()

    for pm, opt in runs.values():
        for _ in range(3):
            step(pm, opt)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(c["rounds"]):
        for name, (pm, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(c["steps"]):
                step(pm, opt)
            t = torch.tensor([(time.perf_counter() - t0) / c["steps"]])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    out = {}
    for name, (pm, _) in runs.items():
        d = pm.plan.decisions
        v = sorted(times[name])
        out[name] = {"measured": v[len(v) // 2], "predicted": d.step_seconds, "offload": d.offload,
                     "zero": d.zero_stage, "host": d.host_memory, "device": pm.plan.memory["total"],
                     "optimizer": d.breakdown.get("optimizer_seconds", 0.0)}
    return out
