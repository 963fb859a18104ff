"""Regenerate the timeline pictures in docs/ (docs/timeline.md shows them).

    python benchmarks/timeline_pictures.py [--out docs]

* ``timeline_1f1b.png``: examples/gpt.py (8 layers, dim 128) on 4 A100s as 4 pipeline
  stages with 1F1B and 8 micro-batches (forced, to show the schedule's warm-up,
  steady state, cool-down and bubbles);
* ``timeline_interleaved.png`` and ``timeline_zero_bubble.png``: the same model, stages
  and micro-batches under interleaved 1F1B (2 chunks per stage) and zero-bubble;
* ``timeline_zero3.png``: the same family (4 layers, dim 512, batch 32) with ZeRO-3
  forced on 4 A100s and 2 micro-batches: the per-micro-batch, per-layer parameter
  gathers, which the cost model runs in line with compute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def main(argv: list[str] | None = None) -> None:
    """Plan both cases and draw them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args(argv)
    import gpt

    import autopar
    from autopar import MeshSpec
    from autopar.report.timeline import draw_timeline

    mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
    model, ex = gpt.build(layers=8, dim=128)
    p = autopar.plan(model, ex, mesh, pipeline_stages=4, micro_batches=8, schedule="1f1b")
    print(draw_timeline(p, Path(args.out) / "timeline_1f1b.png"))
    for sched, name, extra in (("interleaved-1f1b", "interleaved", {"virtual_stages": 2}),
                               ("zero-bubble", "zero_bubble", {})):
        q = autopar.plan(model, ex, mesh, pipeline_stages=4, micro_batches=8, schedule=sched,
                         **extra)
        print(draw_timeline(q, Path(args.out) / f"timeline_{name}.png"))
    model, ex = gpt.build(layers=4, dim=512, batch=32, seq=128)
    z = autopar.plan(model, ex, mesh, zero_stage=3, pipeline_stages=1, micro_batches=2)
    print(draw_timeline(z, Path(args.out) / "timeline_zero3.png"))


if __name__ == "__main__":
    main()
