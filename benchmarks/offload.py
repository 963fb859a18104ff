"""Host offload (``offload=``): where the planner offloads, where it does not, each plan's
measured step against its predicted one, and Llama-3 70B on 8 H100s.

    python benchmarks/offload.py [--calibrate] [--rounds 5] [--steps 3] [--world 4]
        [--budget-mib 12] [--no-llama]

On ``--world`` gloo ranks of this machine, examples/gpt.py (4 layers, dim 256) trains
with AdamW as it comes under four plans: the planner's with the devices' own memory
(``fits``: no offload), the planner's under ``memory_budget=--budget-mib`` that nothing
fits without offload (``tight``), and the two levels forced on the first (``optimizer``,
``params``), interleaved, medians of the slowest rank's step.  On a CPU the host copies
live in the same memory as the device's: the copies cost what they cost, the memory
saved is only on paper.  ``--calibrate`` plans on the running group's numbers.  Then,
planning only (unless ``--no-llama``), Llama-3 70B on the ``8xH100-nvlink`` preset
(meta device, bf16-mixed, one 2,048-token sequence a device): what the planner offloads
and the host memory it states.  Prints markdown tables.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def llama70b() -> str:
    """The 70B plan's row: offload level, host and device memory per device, step."""
    import hf_llama

    import autopar
    from autopar import MeshSpec
    model, _, batch = hf_llama.build(hidden=8192, layers=80, heads=64, kv_heads=8, vocab=128256,
                                     batch=8, seq=2048, meta=True, ffn=28672)
    mesh = MeshSpec.preset("8xH100-nvlink")
    t0 = time.perf_counter()
    p = autopar.plan(model, example_kwargs=batch, mesh=mesh, precision="bf16-mixed", batch="local")
    d, gib = p.decisions, 2.0 ** 30
    return (f"| Llama-3 70B, 8 H100 | {d.offload} | ZeRO-{d.zero_stage} | {d.host_memory / gib:.1f} of "
            f"{mesh.host_memory / gib:.1f} | {p.memory['total'] / gib:.1f} of {mesh.usable_memory / gib:.1f} | "
            f"{d.step_seconds:.2f} s | {time.perf_counter() - t0:.0f} s |")


def main(argv: list[str] | None = None) -> dict:
    from _ranks import interleaved_args
    ap = interleaved_args(__doc__, rounds=5, steps=3)
    ap.add_argument("--budget-mib", type=float, default=12.0)
    ap.add_argument("--no-llama", action="store_true")
    a = ap.parse_args(argv)
    from tests.dist.harness import run_fn_cases
    variants = {"fits": {}, "tight": {"memory_budget": a.budget_mib * 2 ** 20},
                "optimizer": {"offload": "optimizer"}, "params": {"offload": "params"}}
    load0 = os.getloadavg()[0]
    res = run_fn_cases(a.world, "tests.dist.timed_cases:timed", [
        {"id": "gpt", "build": {"layers": 4, "dim": 256, "heads": 4, "vocab": 512, "seq": 64, "batch": 16},
         "variants": variants, "rounds": a.rounds, "steps": a.steps, "calibrate": a.calibrate}])["gpt"]
    print(f"{a.world} gloo ranks, " + ("calibrated mesh" if a.calibrate else "cpu-gloo preset")
          + f"; load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| plan | offload | ZeRO | host MiB | device MiB | predicted ms | measured ms | measured / fits |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    if "error" in res:
        raise SystemExit(f"the ranks failed: {res['error']}")
    base = res["fits"]["measured"]
    for name, r in res.items():
        print(f"| {name} | {r['offload']} | {r['zero']} | {r['host'] / 2**20:.1f} | {r['device'] / 2**20:.1f} | "
              f"{r['predicted'] * 1e3:.1f} | {r['measured'] * 1e3:.1f} | {r['measured'] / base:.2f} |")
    if not a.no_llama:
        print("\n| model | offload | ZeRO | host GiB (budget) | device GiB (budget) | predicted step | planned in |")
        print("|---|---|---|---:|---:|---:|---:|")
        print(llama70b())
    return res


if __name__ == "__main__":
    main()
