"""Gradient compression (``grad_compression=``): where the search picks it, where it
does not, and each kind's measured step against its predicted one.

    python benchmarks/grad_compression.py [--link-rate 1gbit] [--calibrate]
        [--rounds 7] [--steps 4] [--world 4]

On ``--world`` gloo ranks of this machine, a data-parallel MLP (``Wide`` of
tests/dist/compression_cases.py: 4 square linear layers, every weight replicated, the
batch split) trains with AdamW as it comes, once per kind (``none``, ``bf16``,
``powersgd``), the steps interleaved (``--rounds`` rounds of ``--steps`` steps each,
after 12 warm-up steps that cover PowerSGD's whole first ones), each round timed as
the slowest rank's; medians.  Two models:

* ``comm``: 1024 wide, 4 rows a rank: 16 MiB of gradients a step against little compute;
* ``compute``: 128 wide, 4,096 rows a rank: the reduction hides under the backward.

``--link-rate`` shapes the loopback link (root and ``tc``, ``_ranks.throttled_loopback``):
unshaped, a collective here is a memory copy on the same two cores as the compression's
own passes, so nothing is saved.  ``--calibrate`` plans on the running group's measured
numbers (under the shaping) instead of the ``cpu-gloo`` preset.  Prints a markdown
table: model, kind, predicted and measured step, the measured ratio to ``none``, and
what ``grad_compression="auto"`` picks for the model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {"comm": {"width": 1024, "rows": 16}, "compute": {"width": 128, "rows": 16384}}


def main(argv: list[str] | None = None) -> dict:
    from _ranks import interleaved_args
    ap = interleaved_args(__doc__, rounds=7, steps=4)
    ap.add_argument("--link-rate", default=None)
    a = ap.parse_args(argv)
    from _ranks import throttled_loopback

    from tests.dist.harness import run_fn_cases
    cases = [{"id": name, "kinds": ["none", "bf16", "powersgd"], "depth": 4, "rounds": a.rounds,
              "steps": a.steps, "calibrate": a.calibrate, **shape} for name, shape in MODELS.items()]
    load0 = os.getloadavg()[0]
    with throttled_loopback(a.link_rate):
        res = run_fn_cases(a.world, "tests.dist.compression_cases:timed", cases)
    print(f"{a.world} gloo ranks, " + (f"loopback shaped to {a.link_rate}, " if a.link_rate else "")
          + ("calibrated mesh" if a.calibrate else "cpu-gloo preset")
          + f"; load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| model | kind | predicted ms | measured ms | measured / none | auto picks |")
    print("|---|---|---:|---:|---:|---|")
    for name, r in res.items():
        base = r["measured"]["none"]
        for kind, t in r["measured"].items():
            print(f"| {name} | {kind} | {r['predicted'][kind] * 1e3:.1f} | {t * 1e3:.1f} | "
                  f"{t / base:.2f} | {r['auto'] if kind == 'none' else ''} |")
    return res


if __name__ == "__main__":
    main()
