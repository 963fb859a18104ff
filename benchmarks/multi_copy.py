"""Multi-copy overlap (``copies=``): where the planner runs two interleaved copies,
the gain it predicts on Megatron-LM's tensor-parallel layouts, and the overlap measured
against the predicted one on gloo.

    python benchmarks/multi_copy.py [--calibrate] [--rounds 15] [--steps 3] [--world 4]
        [--models 1.7B 7.5B 18.4B 39.1B 145.6B]

1. Planning only: each Megatron-LM run of ``benchmarks/reference_plans.py`` (its GPT
   shape on ``multinode-a100-ib``, bf16-mixed, Megatron's TP pins and PP, no ZeRO),
   planned as two micro-batches in turn, as two copies, and with ``copies="auto"``:
   the gain the copies predict over the same micro-batches, and whether the search
   picks them.  Copies need one pipeline stage: the PP > 1 runs cannot take them.
2. On ``--world`` gloo ranks: examples/gpt.py (4 layers, dim 256) in Megatron's layout
   over all ranks, planned as two micro-batches one after the other and as two
   interleaved copies; steps interleaved, medians of the slowest rank.  The measured
   overlap is the first's step less the second's; the predicted one is what the plan
   says the copies hide (``copies_hidden``, a step's worth).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def megatron_row(name: str) -> str:
    """One Megatron run planned with and without ``copies="auto"``."""
    import warnings

    from reference_plans import BY_NAME, PRECISION, PRESET, build_model, megatron_pins

    from autopar import MeshSpec
    from autopar.api import plan
    ref = BY_NAME[name]
    shape = ref.megatron_shape()
    mesh = MeshSpec.preset(PRESET, shape=shape)
    sub_ndim = len(shape) - (1 if ref.pp == shape[0] else 0)
    kw = dict(pins=megatron_pins(ref, sub_ndim), pipeline_stages=ref.pp, zero_stage=0,
              schedule="1f1b" if ref.pp > 1 else None, pipeline_axis=0 if ref.pp > 1 else None,
              search="ilp", blocks=ref.layers, precision=PRECISION)
    model, ex = build_model(ref, ref.batch)
    t0 = time.perf_counter()
    if ref.pp > 1:
        return f"| {name} | TP {ref.tp}, PP {ref.pp} | - | - | not possible (a pipeline) | - | - |"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seq = plan(model, ex, mesh, micro_batches=2, **kw).decisions
        two = plan(model, ex, mesh, copies=2, **kw).decisions
        auto = plan(model, ex, mesh, copies="auto", **kw).decisions
    picked = f"{'yes' if auto.copies > 1 else 'no'} ({auto.step_seconds:.3f} s, {auto.micro_batches} micro)"
    return (f"| {name} | TP {ref.tp}, PP {ref.pp} | {seq.step_seconds:.3f} s | {two.step_seconds:.3f} s | "
            f"{picked} | {(seq.step_seconds - two.step_seconds) / seq.step_seconds:+.1%} | "
            f"{time.perf_counter() - t0:.0f} s |")


def main(argv: list[str] | None = None) -> dict:
    from _ranks import interleaved_args
    ap = interleaved_args(__doc__, rounds=15, steps=3)
    ap.add_argument("--models", nargs="*", default=["1.7B", "7.5B", "18.4B", "39.1B", "145.6B"])
    a = ap.parse_args(argv)
    if a.models:
        print("| Megatron run | layout | 2 micro-batches in turn | 2 copies | copies='auto' picks | "
              "predicted gain of the copies | planned in |")
        print("|---|---|---:|---:|---|---:|---:|")
        for name in a.models:
            print(megatron_row(name), flush=True)
    from tests.dist.harness import run_fn_cases
    from tests.dist.test_equivalence import MEGATRON
    pins = MEGATRON["gpt"]
    variants = {"micro-batches": {"pins": pins, "micro_batches": 2, "zero_stage": 0},
                "copies": {"pins": pins, "copies": 2, "zero_stage": 0}}
    load0 = os.getloadavg()[0]
    res = run_fn_cases(a.world, "tests.dist.timed_cases:timed", [
        {"id": "gpt", "build": {"layers": 4, "dim": 256, "heads": 4, "vocab": 512, "seq": 64, "batch": 16},
         "variants": variants, "rounds": a.rounds, "steps": a.steps, "calibrate": a.calibrate}])["gpt"]
    if "error" in res:
        raise SystemExit(f"the ranks failed: {res['error']}")
    print(f"\n{a.world} gloo ranks, Megatron's layout over all of them, "
          + ("calibrated mesh" if a.calibrate else "cpu-gloo preset")
          + f"; load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| plan | predicted ms | measured ms |")
    print("|---|---:|---:|")
    for name, r in res.items():
        print(f"| {name} | {r['predicted'] * 1e3:.1f} | {r['measured'] * 1e3:.1f} |")
    m = res["micro-batches"]["measured"] - res["copies"]["measured"]
    p = res["copies"]["hidden"]
    print(f"\noverlap: measured {m * 1e3:.1f} ms, predicted {p * 1e3:.1f} ms "
          f"(predicted / measured {p / m if m else float('nan'):.2f}); the mesh's overlap "
          f"{res['copies']['overlap']:.2f}, sync {res['copies']['sync_seconds'] * 1e3:.2f} ms, "
          f"collective pairing {res['copies']['pairing']:.2f}")
    return res


if __name__ == "__main__":
    main()
