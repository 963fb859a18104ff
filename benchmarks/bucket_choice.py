"""Gradient buckets chosen by the cost model (MG-WFBP) against the two extremes.

    python benchmarks/bucket_choice.py [--steps 12] [--world 4] [--alpha 1e-3]
        [--calibrate] [--link-rate 1gbit]

On ``--world`` gloo ranks of this machine, examples/gpt.py (8 layers, dim 128, fp32)
trains data parallel (every parameter replicated, the batch split, ``batch="local"``)
with AdamW(foreach).  Three modules are built from the same weights and differ only in
their gradient buckets:

* ``chosen``: the buckets the planner chose (:mod:`autopar.search.buckets`);
* ``per-gradient``: ``bucket_bytes=1``, every gradient its own all-reduce;
* ``one bucket``: ``bucket_bytes=2**40``, all gradients in one all-reduce.

They are planned on a latency-bound mesh: the ``cpu-gloo`` preset with the
per-collective latency ``--alpha`` (gloo on this machine pays 0.5-1.3 ms per
collective, issue 12), and their steps run interleaved (A B C A B C ...), each timed as
the slowest rank's.  The exposed reduction is measured as the time the backward spends
after its last gradient, finishing the buckets (the runtime's ``_finish``: launching
what is left and waiting), on the rank that ends its backward last (the others also
wait for it: imbalance, reported beside), and compared with the plan's predicted
``sync_exposed``.
``--link-rate`` shapes the loopback link to that rate while the ranks run (root and
``tc``; see ``_ranks.throttled_loopback``): unshaped, a collective here is a memory copy
on the same two cores as the backward and cannot overlap it; shaped, its bytes wait for
the link, as on a network, and the bucket choice matters.
Prints one markdown row per variant: bucket count, median step, median exposed
reduction, predicted exposed reduction, the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
VARIANTS = {"chosen": None, "per-gradient": 1, "one bucket": 1 << 40}


def _mesh(world: int, alpha: float | None):
    from autopar.cost_models import MeshSpec
    if alpha is None:  # measured on the running group (cost_models/calibrate.py)
        from autopar.cost_models.calibrate import calibrate
        return calibrate()
    m = MeshSpec.preset("cpu-gloo", shape=(world,))
    return dataclasses.replace(m, links=tuple(dataclasses.replace(lk, alpha=alpha) for lk in m.links))


def _run(rank: int, world: int, steps: int, alpha: float | None) -> list[dict]:
    import copy

    import gpt

    import autopar
    from autopar.runtime.mesh import reset

    model, (x, y) = gpt.build(layers=8, dim=128, heads=4, vocab=256, seq=64, batch=8 * world)
    n = x.shape[0] // world
    xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    mods, opts, exposed, planned = {}, {}, {}, {}
    mesh = _mesh(world, alpha)
    for name, bb in VARIANTS.items():
        reset()
        extra = {} if bb is None else {"bucket_bytes": bb}
        pm = autopar.auto_parallel(copy.deepcopy(model), example_inputs=(x, y), mesh=mesh,
                                   pins=DP, batch="local", zero_stage=0, **extra)
        gs = pm.grad_sync
        exposed[name] = []
        finish = gs._finish

        def timed_finish(finish=finish, out=exposed[name]):
            t0 = time.perf_counter()
            finish()
            out.append(time.perf_counter() - t0)

        gs._finish = timed_finish
        mods[name] = pm
        opts[name] = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
        planned[name] = (len(gs.buckets), pm.plan.decisions.stage_parts[0]["sync_exposed"])
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}

    def step(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        opts[name].zero_grad()
        mods[name](xs, ys).backward()
        opts[name].step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for _ in range(2):  # warm-up
        for name in VARIANTS:
            step(name)
    for k in exposed:
        exposed[k].clear()
    for _ in range(steps):
        for name in VARIANTS:
            times[name].append(step(name))
    return [{"variant": k, "buckets": planned[k][0], "step_ms": statistics.median(times[k]) * 1e3,
             "exposed_ms": statistics.median(exposed[k]) * 1e3, "predicted_ms": planned[k][1] * 1e3}
            for k in VARIANTS]


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    from _ranks import finish, join
    join(rank, world, port)
    rows = _run(rank, world, args["steps"], args["alpha"])
    # ranks end their backward at different times (4 processes share 2 cores): a rank
    # that ends early waits in the all-reduce for the others, which is imbalance, not
    # communication; the rank that ends last waits least, so the MIN over ranks is the
    # reduction's own tail (the MAX, with the imbalance, is reported beside it)
    for r in rows:
        mine = r["exposed_ms"]
        for key, op in (("exposed_ms", dist.ReduceOp.MIN), ("exposed_max_ms", dist.ReduceOp.MAX)):
            t = torch.tensor([mine], dtype=torch.float64)
            dist.all_reduce(t, op=op)
            r[key] = float(t)
    finish(rank, rows, out)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the variants and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=1e-3, help="per-collective latency planned with (s)")
    ap.add_argument("--calibrate", action="store_true",
                    help="plan on a mesh measured on the running group instead (alpha ignored)")
    ap.add_argument("--link-rate", default=None,
                    help="shape the loopback link to this tc rate (e.g. 1gbit) while the ranks run")
    a = ap.parse_args(argv)
    if a.calibrate:
        a.alpha = None
    from _ranks import throttled_loopback

    from tests.dist.harness import free_port

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        load0 = os.getloadavg()[0]
        with throttled_loopback(a.link_rate):
            mp.spawn(_worker, args=(a.world, free_port(), {"steps": a.steps, "alpha": a.alpha}, out),
                     nprocs=a.world, join=True)
        rows = json.loads(Path(out).read_text())
    print(f"| buckets | count | step ms (median) | exposed reduction ms, measured (min over ranks) | "
          f"with imbalance (max) | predicted |  "
          f"(world {a.world}, {a.steps} interleaved steps, "
          + ("calibrated mesh, " if a.alpha is None else f"alpha {a.alpha * 1e3:g} ms, ")
          + (f"loopback shaped to {a.link_rate}, " if a.link_rate else "") +
          f"load {load0:.2f} before, {os.getloadavg()[0]:.2f} after)")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['buckets']} | {r['step_ms']:.1f} | {r['exposed_ms']:.2f} | "
              f"{r['exposed_max_ms']:.2f} | {r['predicted_ms']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
