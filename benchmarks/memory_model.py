"""Measured per-rank peak memory vs the memory model, and the numerical errors, for
every plan-level parallelism kind on real gloo ranks (the cases of
tests/dist/test_parallelism_kinds.py); prints its section of docs/benchmarks.md, and
with ``--write`` rewrites the section's table there.

Run: ``python benchmarks/memory_model.py [--write]`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plan_time import regenerate, write_section  # noqa: E402
from tests.dist.harness import run_cases  # noqa: E402
from tests.dist.test_parallelism_kinds import FOUR, TWO, TWO_BF16, TWO_MORE  # noqa: E402

SECTION = "## Parallelism kinds: equivalence and memory (benchmarks/memory_model.py)"


def _describe(res: dict) -> str:
    d = res["decisions"]
    parts = [d["precision"]] if d.get("precision", "native") != "native" else []
    parts += [f"ZeRO-{d['zero']}"] if d["zero"] else []
    if d["stages"] > 1:
        parts.append(f"{d['stages']} stages {d['schedule']}")
    if d["micro_batches"] > 1:
        parts.append(f"{d['micro_batches']} micro-batches")
    if d["recompute"]:
        parts.append("recompute " + ",".join(d["recompute"]))
    return ", ".join(parts) or "plain"


def table(results: dict[str, dict], meshes: dict[str, tuple]) -> str:
    """Markdown rows: errors and measured/predicted memory per case."""
    rows = ["| case | mesh | decisions | grad err | AdamW err | measured / predicted peak per rank |",
            "|---|---|---|---|---|---|"]
    for cid, res in results.items():
        if "error" in res:
            rows.append(f"| {cid} | | ERROR | | | |")
            continue
        mem = res.get("memory") or []
        ratios = ", ".join(f"r{m['rank']}: {m['measured'] / 1024:.0f}/{m['predicted'] / 1024:.0f} KiB "
                           f"= {m['measured'] / m['predicted']:.2f}" for m in mem) or "not measured"
        rows.append(f"| {cid} | {'x'.join(map(str, meshes[cid]))} | {_describe(res)} | "
                    f"{res['grad_err']:.1e} | {res['adam_err']:.1e} | {ratios} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the cases on 2 and 4 gloo ranks, print the section; ``--write``: update the docs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    args = ap.parse_args(argv)
    two, four = TWO + TWO_MORE + TWO_BF16, FOUR  # and the slow step's two-rank cases
    results = {**run_cases(2, two), **run_cases(4, four)}
    meshes = {c.id: c.mesh for c in two + four}
    tab = table(results, meshes)
    mem = [m["measured"] / m["predicted"] for r in results.values() for m in r.get("memory", [])]
    text = (f"{SECTION}\n\nGPT (2 blocks, dim 64, batch 8) on real gloo ranks, each kind forced through "
            "`auto_parallel(...)` and compared with the single-process model (tolerances as above). "
            "Peak memory per rank is measured over one training step with "
            "`autopar.runtime.memstats` (parameters, gradients, optimizer state and every tensor "
            "allocated during the step, tracked per aten op) and compared with the plan's "
            "prediction for that rank's pipeline stage. "
            f"Measured / predicted ranges over {min(mem):.2f}-{max(mem):.2f} "
            "(target: within 10%). The bf16-mixed rows' errors are against the fp32 model "
            "(bf16 rounding; their equivalence against the model under autocast is "
            "tests/dist/test_mixed_precision.py's).\n\n"
            "The model's peak is the largest of three moments: the end of forward (every kept "
            "activation), during backward (the activations still kept, the gradients made so "
            "far, and two of the layer's widest gradients in flight) and at its end (every "
            "gradient and ZeRO-1/2's flat buckets). An activation counts when backward reads "
            "it: an op's output read only by casts, sums, means and residual adds is not kept."
            f"\n\n{tab}\n\n{regenerate('memory_model.py', argv)}\n")
    print(text)
    if args.write:
        write_section(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
