"""autopar's generated module against what a user would write by hand, side by side.

    python benchmarks/runtime_vs_torch.py [--steps 10] [--cases dp,zero3,tp] [--world 4]

On ``--world`` gloo ranks of this machine (one thread each), examples/gpt.py (4 layers,
dim 192, fp32) trains with AdamW; each case builds the hand-written module and
autopar's from the same weights and runs their steps interleaved (A B A B ...), each
step timed as the slowest rank's (barrier before, MAX all-reduce of the time after).
Both sides use ``AdamW(foreach=True)`` (``--no-foreach``: the CPU default loop, where
DTensor parameters pay a dispatch per op per parameter), except ``tp``, whose
hand-written side mixes DTensor and plain parameters, which foreach refuses. Cases:

* ``dp``: data parallel pinned (``{"*": "R", "input:0": "S(0)", "input:1": "S(0)"}``,
  ``batch="local"``) vs ``DistributedDataParallel``;
* ``dp2x2``: the same on a 2x2 mesh (weights replicated on both axes, the batch split
  over both: one all-reduce per bucket over a group spanning them) vs DDP;
* ``zero3``: the same with ``zero_stage=3`` vs FSDP2 ``fully_shard`` on every block and
  the root;
* ``tp``: Megatron pins (q/k/v, fc1 column; out_proj, fc2 row) vs ``parallelize_module``
  with ``ColwiseParallel`` / ``RowwiseParallel`` on the same layers (whole batch on
  every rank for both).

For one extra step per side, ``torch.profiler`` counts the collectives issued
(events of the process-group backend), and for one more the bytes this rank sends are
read from ``/proc/self/io`` and set beside the analytic minimum of the case. Prints one markdown row per case: medians, the
ratio, the collective counts and the load average.
"""

from __future__ import annotations

import argparse
import copy
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

MEGATRON = {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
            "*q_proj.bias": "S(0)", "*k_proj.bias": "S(0)", "*v_proj.bias": "S(0)",
            "*out_proj.weight": "S(1)", "*out_proj.bias": "R", "*fc1.weight": "S(0)",
            "*fc1.bias": "S(0)", "*fc2.weight": "S(1)", "*fc2.bias": "R",
            # the batch stays whole on every rank, as with parallelize_module; without
            # these the planner splits it too and gathers the pinned weights (FSDP-like)
            "input:0": "R", "input:1": "R"}
DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


def _timed(step) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _collectives(step) -> int:
    """Collectives one step issues on this rank (profiler events of the c10d backend)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = [e.name for e in prof.events()]
    return sum(1 for n in names if n.startswith(("gloo:", "nccl:")))


def _sent(step) -> float:
    """Bytes this rank writes during one step: gloo's TCP sends are the process's only
    writes meanwhile (/proc/self/io ``wchar``; design.md: within 0.3% of the ring bytes)."""
    dist.barrier()
    before = _wchar()
    step()
    return float(_wchar() - before)


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _minimum(name: str, g: float, world: int) -> float | None:
    """Analytic minimum bytes a rank sends per step (ring collectives over ``world``):
    data parallel all-reduces the fp32 gradients once, 2(p-1)/p G; ZeRO-3 gathers the
    parameters in forward and again in backward and reduce-scatters the gradients,
    which gloo runs as an all-reduce: 4(p-1)/p G.  None for tensor parallelism (it
    depends on the activations).  ``g``: the trainable parameters' bytes."""
    f = (world - 1) / world
    return {"dp": 2 * f * g, "dp2x2": 2 * f * g, "zero3": 4 * f * g}.get(name)


def _hand_dp(model, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def _hand_zero3(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _hand_tp(model, world):
    import types

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def local_attention(self, x):
        # as examples/gpt.py's Attention, with this rank's heads only (q/k/v column-split)
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = (p(x).view(b, t, -1, hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))

    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        b.attn.forward = types.MethodType(local_attention, b.attn)
        parallelize_module(b, mesh, {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                                     "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
                                     "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    return model


DP2X2 = {"*": "RR", "input:0": "S(0)S(0)", "input:1": "S(0)S(0)"}
CASES = {"dp": (_hand_dp, dict(pins=DP, batch="local"), True),
         "dp2x2": (_hand_dp, dict(pins=DP2X2, batch="local", mesh=(2, 2)), True),
         "zero3": (_hand_zero3, dict(pins=DP, batch="local", zero_stage=3), True),
         "tp": (_hand_tp, dict(pins=MEGATRON), False)}


def _case(name: str, rank: int, world: int, steps: int, foreach: bool, measured=None) -> dict:
    """Build both modules for one case, run them interleaved and measure."""
    import gpt

    import autopar
    from autopar.runtime.mesh import reset

    make_hand, opts, local = CASES[name]
    model, (x, y) = gpt.build(layers=4, dim=192, heads=4, vocab=256, seq=64, batch=8 * world)
    ref = copy.deepcopy(model)
    gbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    reset()
    opts = dict(opts)
    mesh = opts.pop("mesh", (world,))
    if measured is not None:
        # the measured 1-D mesh's link on every axis of the case's shape
        mesh = dataclasses.replace(measured, shape=tuple(mesh), axis_names=(),
                                   links=measured.links * len(mesh))
    pm = autopar.auto_parallel(model, example_inputs=(x, y), mesh=mesh, **opts)
    hand = make_hand(ref, world)
    n = x.shape[0] // world
    xs, ys = (x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]) if local else (x, y)
    # foreach: on CPU torch's optimizers default to a per-parameter loop, which costs
    # ~1 ms per DTensor parameter per step under gloo (CUDA defaults to foreach); both
    # sides use the same implementation
    # (hand-written TP leaves embeddings and norms plain tensors beside DTensors, which
    # foreach refuses to mix: that case keeps the loop on both sides)
    foreach = foreach and name != "tp"
    oa = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=foreach)
    ob = torch.optim.AdamW(hand.parameters(), lr=1e-3, foreach=foreach)
    losses: dict[str, list[float]] = {"autopar": [], "hand": []}

    def step_a():
        oa.zero_grad()
        loss = pm(xs, ys)
        loss.backward()
        oa.step()
        losses["autopar"].append(float(loss))

    def step_b():
        ob.zero_grad()
        loss = hand(xs, ys)
        loss.backward()
        ob.step()
        lv = loss.detach().clone()
        if local:  # DDP/FSDP return this rank's loss: average it for the comparison
            dist.all_reduce(lv)
            lv /= world
        losses["hand"].append(float(lv))

    for _ in range(2):  # warm-up
        step_a()
        step_b()
    ta, tb = [], []
    for _ in range(steps):
        ta.append(_timed(step_a))
        tb.append(_timed(step_b))
    ca, cb = _collectives(step_a), _collectives(step_b)
    sa, sb = _sent(step_a), _sent(step_b)
    return {"case": name, "autopar_ms": statistics.median(ta) * 1e3,
            "sent_autopar": sa, "sent_hand": sb, "sent_min": _minimum(name, gbytes, world),
            "hand_ms": statistics.median(tb) * 1e3, "coll_autopar": ca, "coll_hand": cb,
            "loss_diff": max(abs(a - b) for a, b in zip(losses["autopar"], losses["hand"]))}


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    from _ranks import finish, join
    join(rank, world, port)
    link = None
    if args["calibrate"]:  # plan on this group's measured link (cost_models/calibrate.py)
        from autopar.cost_models.calibrate import calibrate
        link = calibrate()
    rows = [_case(name, rank, world, args["steps"], args["foreach"], link) for name in args["cases"]]
    finish(rank, rows, out)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the cases and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--cases", default="dp,zero3,tp")
    ap.add_argument("--no-foreach", dest="foreach", action="store_false",
                    help="the optimizers' default per-parameter loop on CPU")
    ap.add_argument("--calibrate", action="store_true",
                    help="plan on the link measured on the running group, not the cpu-gloo preset")
    a = ap.parse_args(argv)
    from tests.dist.harness import free_port

    cases = [c for c in a.cases.split(",") if c]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        load0 = os.getloadavg()[0]
        mp.spawn(_worker, args=(a.world, free_port(), {"steps": a.steps, "cases": cases,
                                                  "foreach": a.foreach, "calibrate": a.calibrate}, out),
                 nprocs=a.world, join=True)
        rows = json.loads(Path(out).read_text())
    print(f"| case | hand-written ms | autopar ms | autopar / hand | collectives per step, hand / "
          f"autopar | MB sent per rank per step, hand / autopar / analytic minimum | "
          f"max loss difference |  (world {a.world}, {a.steps} interleaved steps, "
          f"AdamW foreach={a.foreach}, {'calibrated link' if a.calibrate else 'cpu-gloo preset'}, "
          f"load {load0:.2f} before)")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        low = f"{r['sent_min'] / 1e6:.2f}" if r["sent_min"] else "-"
        print(f"| {r['case']} | {r['hand_ms']:.1f} | {r['autopar_ms']:.1f} | "
              f"{r['autopar_ms'] / r['hand_ms']:.2f} | {r['coll_hand']} / {r['coll_autopar']} | "
              f"{r['sent_hand'] / 1e6:.2f} / {r['sent_autopar'] / 1e6:.2f} / {low} | "
              f"{r['loss_diff']:.2e} |")
    return rows


if __name__ == "__main__":
    main()
