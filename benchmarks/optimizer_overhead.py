"""What DTensor parameters cost the optimizer step: AdamW (foreach and fused) over a
ParallelModule's DTensor parameters (through DTensor's dispatch, and as autopar steps
them: replicated ones on their local tensors) vs over the same local shards as plain
tensors, the way a hand-written sharded loop would step them.  Prints its section of
docs/benchmarks.md; ``--write`` rewrites the section's table there.

A and B are interleaved step by step on the same ranks (A B A B ...), medians are
reported with the machine's load average.
Run: ``python benchmarks/optimizer_overhead.py [--write]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plan_time import machine, regenerate, write_section  # noqa: E402
from tests.dist.harness import run_fn_cases  # noqa: E402

SECTION = "## Optimizer step over DTensor parameters (benchmarks/optimizer_overhead.py)"


def measure(c: dict) -> dict:
    """Every rank: time AdamW steps over DTensor parameters (through DTensor's dispatch,
    and as autopar steps them) and over plain locals."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    from autopar import MeshSpec, auto_parallel
    from autopar.runtime.mesh import reset

    torch.manual_seed(0)
    model, ex = gpt.build(layers=c["layers"], dim=c["dim"])
    reset()
    pm = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       pins=c["pins"])
    pm.train_step(*ex)
    dts = list(pm.parameters())
    # the plain side: copies of the local shards with copies of their gradients
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in dts]
    for q, p in zip(plain, dts):
        q.grad = p.grad.to_local().clone()
    from autopar.runtime import local_step

    out = {}
    for kind in ("foreach", "fused"):
        flag = {kind: True}
        a = torch.optim.AdamW(dts, lr=1e-4, **flag)  # stepped both ways, in turn
        b = torch.optim.AdamW(plain, lr=1e-4, **flag)
        ts: dict[str, list[float]] = {"dtensor": [], "autopar": [], "plain": []}
        for i in range(c["steps"] + 3):
            for side, opt in (("dtensor", a), ("autopar", a), ("plain", b)):
                # the DTensor side as before: every op through DTensor's dispatch;
                # autopar's: replicated parameters step on their local tensors
                local_step.enabled = side == "autopar"
                t0 = time.perf_counter()
                opt.step()
                if i >= 3:  # the first steps allocate state
                    ts[side].append(time.perf_counter() - t0)
        local_step.enabled = True
        out[kind] = {f"{k}_ms": 1e3 * statistics.median(v) for k, v in ts.items()}
    out["params"] = len(dts)
    out["numel"] = sum(p.to_local().numel() for p in dts)
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure on 2 gloo ranks and print the section; ``--write``: update the docs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    tp = {"*fc1.weight": "S(0)", "*fc2.weight": "S(1)", "*q_proj.weight": "S(0)",
          "*out_proj.weight": "S(1)"}
    cases = [{"id": f"{n}-L{L}-d{d}", "layers": L, "dim": d, "pins": pins, "steps": args.steps}
             for L, d in ((4, 256), (12, 64)) for n, pins in (("dp", {"*": "R"}), ("tp", tp))]
    load0 = os.getloadavg()[0]
    res = run_fn_cases(2, "benchmarks.optimizer_overhead:measure", cases)
    load1 = os.getloadavg()[0]
    rows = ["| case | params | local elements | AdamW | DTensor ms | autopar ms | plain ms | DTensor / plain "
            "| autopar / plain | DTensor's extra per tensor |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for cid, r in res.items():
        if "error" in r:
            rows.append(f"| {cid} | ERROR | | | | | |")
            continue
        for kind in ("foreach", "fused"):
            m = r[kind]
            extra = 1e3 * (m["dtensor_ms"] - m["plain_ms"]) / r["params"]
            rows.append(f"| {cid} | {r['params']} | {r['numel']} | {kind} | {m['dtensor_ms']:.2f} | "
                        f"{m['autopar_ms']:.2f} | {m['plain_ms']:.2f} | {m['dtensor_ms'] / m['plain_ms']:.2f} | "
                        f"{m['autopar_ms'] / m['plain_ms']:.2f} | {extra:.0f} us |")
    text = (f"{SECTION}\n\nMachine: {machine()}; load average {load0:.1f} before, {load1:.1f} after. "
            f"GPT from examples/gpt.py on 2 gloo ranks, rank 0's medians of {args.steps} "
            "interleaved steps (DTensor, autopar, plain, DTensor, ...).  `dp`: every weight "
            "replicated; `tp`: Megatron pins.  `DTensor`: the ParallelModule's optimizer with "
            "every op through DTensor's dispatch (`autopar.runtime.local_step.enabled = False`); "
            "`autopar`: as it runs, every parameter (replicated or sharded) stepped on its "
            "local tensor (`autopar/runtime/local_step.py`); `plain`: copies of the same local "
            "shards, as a hand-sharded "
            "loop would (and gives wrong clipping and checkpoints).  DTensor's extra time is its "
            "dispatch, paid per parameter tensor whatever its size; FSDP2 and "
            "`parallelize_module` step DTensor parameters too, so a user pays it with them "
            "as well.\n\n"
            + "\n".join(rows) + f"\n\n{regenerate('optimizer_overhead.py', argv)}\n")
    print(text)
    if args.write:
        write_section(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
