"""The mesh shape searched from a device count against the shapes a user would name.

For Llama-3 8B and 70B (``transformers.LlamaForCausalLM`` on the meta device, one
2,048-token sequence per device, ``precision="bf16-mixed"``, ``batch="local"``) on 64 and
1,024 devices of ``multinode-h100-ib``, each cell plans the hand-picked shapes one by one
(8x8, 4x16, 16x4 / 128x8, 64x16, 256x4: a fixed shape's whole ``autopar.plan``) and then
``MeshSpec.preset(..., devices=N)`` (the shape searched), and prints each one's
predicted step and seconds; then the scaling curve of the 8B shape over 8..1,024
devices (:func:`autopar.scaling.scaling_curve`, its time)::

    python benchmarks/mesh_search.py                 # every cell and the curve
    python benchmarks/mesh_search.py --cells 8B:64 --no-curve
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from search_scaling_hf import _model  # noqa: E402  (same folder: the Llama shapes)

PRESET = "multinode-h100-ib"
HAND = {64: [(8, 8), (4, 16), (16, 4)], 1024: [(128, 8), (64, 16), (256, 4)]}
CURVE = [8, 16, 32, 64, 128, 256, 512, 1024]


def _plan(model, n: int, mesh):
    import torch

    import autopar

    ids = torch.zeros((n, 2048), dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = autopar.plan(model, (), example_kwargs={"input_ids": ids, "labels": ids}, mesh=mesh,
                         precision="bf16-mixed", batch="local")
    return p, time.perf_counter() - t0


def cell(name: str, n: int) -> list[str]:
    from autopar import MeshSpec
    from autopar.errors import PlanError
    from autopar.plans.roles import layout

    model = _model(name)
    try:  # torch.export's and transformers' one-time set-up, untimed
        _plan(model, 8, MeshSpec.preset(PRESET, shape=(8,)))
    except PlanError:  # 70B does not fit 8 devices: the set-up ran all the same
        pass
    rows, fixed = [], []
    for shape in HAND[n]:
        p, s = _plan(model, n, MeshSpec.preset(PRESET, shape=shape))
        fixed.append((p.decisions.step_seconds, s))
        rows.append(f"| {name} | {n} | {'x'.join(map(str, shape))} (named) | {p.decisions.step_seconds * 1e3:.1f} | "
                    f"{s:.1f} | {layout(p)} |")
    p, s = _plan(model, n, MeshSpec.preset(PRESET, devices=n))
    shape = "x".join(map(str, p.request.mesh_shape))
    best = min(f[0] for f in fixed)
    rows.append(f"| {name} | {n} | **searched: {shape}** | **{p.decisions.step_seconds * 1e3:.1f}** "
                f"({p.decisions.step_seconds / best:.3f}x the best named) | **{s:.1f}** "
                f"({s / max(f[1] for f in fixed):.2f}-{s / min(f[1] for f in fixed):.2f}x a named "
                f"shape's) | {layout(p)} |")
    rows.append("")
    rows.append(f"<!-- {name} on {n}: {p.decisions.why['mesh'].splitlines()[0]} -->")
    rows.extend(f"<!-- {ln} -->" for ln in p.decisions.why["mesh"].splitlines()[1:])
    return rows


def curve() -> str:
    import torch

    from autopar.scaling import scaling_curve, scaling_table

    model = _model("8B")
    ids = torch.zeros((CURVE[0], 2048), dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pts = scaling_curve(model, example_kwargs={"input_ids": ids, "labels": ids}, preset=PRESET,
                            devices=CURVE, precision="bf16-mixed", batch="local")
    return scaling_table(pts) + f"\ncurve of {len(CURVE)} counts in {time.perf_counter() - t0:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=["8B:64", "8B:1024", "70B:64", "70B:1024"],
                    metavar="MODEL:DEVICES")
    ap.add_argument("--no-curve", action="store_true")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| model | devices | shape | predicted step ms | plan seconds | layout |")
    print("|---|---:|---|---:|---:|---|")
    for c in args.cells:
        name, n = c.split(":")
        for row in cell(name, int(n)):
            print(row, flush=True)
    if not args.no_curve:
        print()
        print(curve())
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
