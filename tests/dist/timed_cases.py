"""Plans of one GPT measured side by side, run by benchmarks/offload.py,
benchmarks/multi_copy.py and benchmarks/split_gathers.py: planned once per variant (``auto_parallel`` options), trained
with AdamW as it comes, the steps interleaved."""

from __future__ import annotations

import copy

import torch

from autopar import auto_parallel
from tests.dist.compression_cases import interleaved, mesh_for


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

    # train_step: forward and backward, whatever the plan's schedule
    med = interleaved(runs, lambda pm: pm.train_step(x, y), 3, c["rounds"], c["steps"])
    out = {}
    for name, (pm, _) in runs.items():
        d = pm.plan.decisions
        out[name] = {"measured": med[name], "predicted": d.step_seconds, "offload": d.offload,
                     "zero": d.zero_stage, "host": d.host_memory, "device": pm.plan.memory["total"],
                     "optimizer": d.breakdown.get("optimizer_seconds", 0.0),
                     "copies": d.copies, "micro_batches": d.micro_batches,
                     "breakdown": dict(d.breakdown), "overlap": pm.plan.mesh.overlap,
                     "sync_seconds": pm.plan.mesh.sync_seconds, "pairing": pm.plan.mesh.collective_pairing,
                     "hidden": sum(p.get("copies_hidden", 0.0) for p in d.stage_parts) * d.micro_batches,
                     "chunks": len(d.gather_chunks),
                     "gather_step": sum(p.get("gather_step", 0.0) for p in d.stage_parts),
                     "gather_hidden": sum(p.get("gather_hidden", 0.0) for p in d.stage_parts)}
    return out
