"""ZeRO-1/2's gathers after the step in chunks (``split_gathers=``): where the planner
takes them, where it does not, and the measured step against the predicted one.

    python benchmarks/split_gathers.py [--link-rate 1gbit] [--calibrate]
        [--rounds 7] [--steps 3] [--world 4] [--layers 6] [--dim 256] [--batch 64]

1. Planning only (4 devices, bf16-mixed, ZeRO-2 forced, examples/gpt.py): the chunks
   the planner picks on a GPT of wide layers and one of narrow layers on
   ``8xA100-nvlink`` (it splits where bytes hide behind the forward), the narrow one on
   the ``cpu-gloo`` preset (it merges where latencies dominate), and the wide one as a
   2-stage pipeline (no chunks: a stage gathers in its own first forward).
2. On ``--world`` gloo ranks: examples/gpt.py under data parallel with ZeRO-2, planned
   with chunks (``split_gathers`` searched) and with one blocking gather
   (``split_gathers=False``), AdamW as it comes; steps interleaved, medians of the
   slowest rank.  The measured saving is the second's step less the first's; the
   predicted one is the difference of their predictions (the waits the chunks hide).

``--link-rate`` shapes the loopback link (root and ``tc``); ``--calibrate`` plans on
the running group's measured numbers instead of the ``cpu-gloo`` preset.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


def planned_rows() -> list[str]:
    """Part 1: the planner's chunks on a few GPTs and meshes, planning only."""
    import gpt

    from autopar import MeshSpec
    from autopar.api import plan
    big = dict(layers=8, dim=1024, heads=16, seq=512, batch=32)
    small = dict(layers=8, dim=128, seq=64, batch=32)
    cases = [("8 x dim 1024", "8xA100-nvlink", big, {}), ("8 x dim 128", "8xA100-nvlink", small, {}),
             ("8 x dim 128", "cpu-gloo", small, {}),
             ("8 x dim 1024, 2 pipeline stages", "8xA100-nvlink", big,
              {"pipeline_stages": 2, "micro_batches": 4, "schedule": "1f1b"})]
    out = ["| GPT | mesh (4 devices) | chunks (parameters each) | one blocking gather | forward waits |",
           "|---|---|---|---:|---:|"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, preset, build, opts in cases:
            model, ex = gpt.build(**build)
            p = plan(model, ex, mesh=MeshSpec.preset(preset, shape=(4,)), pins=DP, zero_stage=2,
                     precision="bf16-mixed", **{"pipeline_stages": 1, **opts})
            d = p.decisions
            parts = max(d.stage_parts, key=lambda q: q.get("gather_step", 0.0))
            whole = parts.get("gather_step", 0.0) + parts.get("gather_hidden", 0.0)
            sizes = ", ".join(str(len(c)) for c in d.gather_chunks) or "-"
            waits = f"{parts['gather_step'] * 1e3:.3f} ms" if d.gather_chunks else "-"
            out.append(f"| {name} | {preset} | {len(d.gather_chunks)} ({sizes}) | {whole * 1e3:.3f} ms | {waits} |")
    return out


def main(argv: list[str] | None = None) -> dict:
    from _ranks import interleaved_args
    ap = interleaved_args(__doc__, rounds=7, steps=3)
    ap.add_argument("--link-rate", default=None)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no-plans", action="store_true", help="skip part 1")
    a = ap.parse_args(argv)
    if not a.no_plans:
        print("\n".join(planned_rows()) + "\n", flush=True)
    from _ranks import throttled_loopback

    from tests.dist.harness import run_fn_cases
    zero2 = {"pins": DP, "zero_stage": 2, "pipeline_stages": 1}
    case = {"id": "gpt", "build": {"layers": a.layers, "dim": a.dim, "batch": a.batch},
            "variants": {"chunks": zero2, "blocking": {**zero2, "split_gathers": False}},
            "rounds": a.rounds, "steps": a.steps, "calibrate": a.calibrate}
    load0 = os.getloadavg()[0]
    with throttled_loopback(a.link_rate):
        res = run_fn_cases(a.world, "tests.dist.timed_cases:timed", [case])["gpt"]
    print(f"{a.world} gloo ranks, GPT {a.layers} layers dim {a.dim} batch {a.batch}, ZeRO-2, "
          + (f"loopback shaped to {a.link_rate}, " if a.link_rate else "")
          + ("calibrated mesh" if a.calibrate else "cpu-gloo preset")
          + f"; load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| gathers | chunks | predicted step | measured step | predicted forward waits |")
    print("|---|---:|---:|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['chunks']} | {r['predicted'] * 1e3:.1f} ms | {r['measured'] * 1e3:.1f} ms | "
              f"{r['gather_step'] * 1e3:.1f} ms |")
    c, b = res["chunks"], res["blocking"]
    pred, meas = b["predicted"] - c["predicted"], b["measured"] - c["measured"]
    print(f"\nsaving of the chunks: predicted {pred * 1e3:.1f} ms, measured {meas * 1e3:.1f} ms"
          + (f" (measured / predicted {meas / pred:.2f})" if pred > 0 else ""))
    return res


if __name__ == "__main__":
    main()
