"""Predicted against measured step time on the GPUs of one node, after calibration
(issue 12's "on a GPU node it does the same with NCCL and CUDA events").

Under ``torchrun --nproc-per-node N``: ``measure_cluster()`` calibrates the running
group (NCCL, CUDA events), then each case of a GPT (``examples/gpt.py``, bf16-mixed) is
planned on that calibration and on the node's preset, built, and timed (AdamW steps,
the slowest rank's, CUDA-synchronised; median after warm-up).  Rank 0 prints the
calibration, one ``ROW {json}`` line per case, and the rank correlation and median
error per preset.  Run where GPUs are lent:
``torchrun --nproc-per-node 1 benchmarks/gpu_fidelity.py --preset 8xH100-nvlink``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

CASES = {
    "auto": {},
    "recompute-all": {"recompute": "__all__"},
    "4-micro-batches": {"micro_batches": 4},
    "2-micro-batches": {"micro_batches": 2},
}


def _step_seconds(pm, inputs, steps: int) -> float:
    """Median seconds of an AdamW step of ``pm`` (the slowest rank's)."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        pm.train_step(*inputs)
        opt.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    """Calibrate, plan and time every case on the calibration and on the preset."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="8xH100-nvlink")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank (of 512 tokens)")
    args = ap.parse_args(argv)

    import os

    import gpt
    import torch.distributed as dist
    from autopar.cost_models import measure_cluster
    from cost_fidelity import summary

    import autopar
    from autopar import MeshSpec

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before NCCL starts
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = measure_cluster()
    if rank == 0:
        print(record.table(), flush=True)
    meshes = {"preset": MeshSpec.preset(args.preset, shape=(world,)), "calibrated": record.spec}
    rows = []
    for preset, mesh in meshes.items():
        for case, opts in CASES.items():
            model, inputs = gpt.build(layers=args.layers, dim=args.dim, heads=args.dim // 64,
                                      vocab=32000, seq=512, batch=args.batch * world)
            opts = dict(opts)
            if opts.get("recompute") == "__all__":
                opts["recompute"] = [f"blocks.{i}" for i in range(args.layers)]
            try:
                pm = autopar.auto_parallel(model, example_inputs=inputs, mesh=mesh,
                                           precision="bf16-mixed", **opts)
                measured = _step_seconds(pm, inputs, args.steps)
                row = {"preset": preset, "model": "gpt", "case": case,
                       "predicted_ms": pm.plan.decisions.step_seconds * 1e3,
                       "breakdown_ms": {k: round(v * 1e3, 2) for k, v in pm.plan.decisions.breakdown.items()},
                       "measured_ms": measured * 1e3, "layout": pm.plan.summary().splitlines()[0]}
                pm.shutdown()
            except Exception as e:  # noqa: BLE001 - a case that fails is a row, not the run's end
                row = {"preset": preset, "model": "gpt", "case": case,
                       "error": f"{type(e).__name__}: {e}"[:300]}
                if rank == 0:
                    traceback.print_exc()
            rows.append(row)
            if rank == 0:
                print("ROW " + json.dumps(row), flush=True)
            del model
            torch.cuda.empty_cache()
    if rank == 0:
        print("SUMMARY " + json.dumps(summary(rows)), flush=True)
    if dist.is_initialized():  # a module's shutdown() may have ended the group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
