"""autopar's generated module against what a user would write by hand, side by side.

    python benchmarks/runtime_vs_torch.py [--steps N] [--cases dp,zero3,tp] [--world 4]

On ``--world`` gloo ranks of this machine (one thread each), examples/gpt.py (4 layers,
dim 192, fp32) trains with AdamW; each case builds the hand-written module and
autopar's from the same weights and runs their steps interleaved, the order turned
every step (A B B A A B ...: neither side always runs first, right after the other's
collectives), each step timed as the slowest rank's (barrier before, MAX all-reduce of
the time after).
Both sides use the same AdamW: ``--optimizer foreach`` (default), ``fused`` or ``loop``
(the CPU default, where DTensor parameters pay a dispatch per op per parameter), except
the tensor-parallel cases, whose hand-written side mixes DTensor and plain parameters
(or DTensors on two meshes), which foreach and fused refuse: those keep the loop on
both sides. ``--calibrate`` plans on the link ``calibrate()`` measures on the running
group instead of the cpu-gloo preset. Cases:

* ``dp``: data parallel pinned (``{"*": "R", "input:0": "S(0)", "input:1": "S(0)"}``,
  ``batch="local"``) vs ``DistributedDataParallel``;
* ``dp2x2``: the same on a 2x2 mesh (weights replicated on both axes, the batch split
  over both: one all-reduce per bucket over a group spanning them) vs DDP;
* ``zero3``: the same with ``zero_stage=3`` vs FSDP2 ``fully_shard`` on every block and
  the root;
* ``tp``: Megatron pins (q/k/v, fc1 column; out_proj, fc2 row) vs ``parallelize_module``
  with ``ColwiseParallel`` / ``RowwiseParallel`` on the same layers (whole batch on
  every rank for both);
* ``hsdp``: on a 2x2 mesh, weights sharded over the second axis and replicated over the
  first (``zero_stage=3, zero_axes=(1,)``) vs FSDP2 ``fully_shard`` on the same 2-D
  mesh (FSDP2's HSDP: replicate over the first dimension, shard over the second);
* ``zero3tp2``: on a 2x2 mesh, the batch split over the first axis, the Megatron pins
  on the second and ``zero_stage=3`` vs ``parallelize_module`` on the second axis and
  FSDP2 on the first (each data-parallel pair passes its rows).

For one extra step per side, ``torch.profiler`` counts the collectives issued
(events of the process-group backend); for one more the bytes this rank sends are
read from ``/proc/self/io`` and set beside the analytic minimum of the case and beside
what ``plan.collectives()`` says autopar's rank sends (ring algorithms, gloo's
reduce-scatter as an all-reduce: ``Collective.wire_bytes``). Peak
resident memory is rank 0's ``ru_maxrss`` in fresh processes per side that build both
modules and run three steps of that side only. Prints one markdown row per case: medians, the ratio
with a 95% bootstrap interval over the steps (:func:`ratio_interval`),
the collective counts, bytes, peak RSS and the load average.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
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
    writes meanwhile (/proc/self/io ``wchar``; gloo sends the ring formula's bytes within 0.3%)."""
    dist.barrier()
    before = _wchar()
    step()
    return float(_wchar() - before)


def _peak_rss() -> float:
    """This process's peak resident MB so far (``ru_maxrss``, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _minimum(name: str, g: float, world: int, kept: float = 0.0) -> float | None:
    """Analytic minimum bytes a rank sends per step (ring collectives over ``world``):
    data parallel all-reduces the fp32 gradients once, 2(p-1)/p G; ZeRO-3 gathers the
    parameters in forward and again in backward and reduce-scatters the gradients,
    which gloo runs as an all-reduce: 4(p-1)/p G, less the backward's gather of the
    ``kept`` bytes (layers kept gathered from forward to backward); HSDP does that over
    its shard group and all-reduces the shards over the replicas.  None for tensor
    parallelism (it depends on the activations).  ``g``: the trainable parameters'
    bytes."""
    f = (world - 1) / world
    if name == "hsdp":  # ZeRO-3 over the s = 2 ranks of the second axis, then each
        # rank's shard (G / s) all-reduced over the r = world / 2 of the first
        s, r = 2, world // 2
        return (4 * g - kept) * (s - 1) / s + 2 * (r - 1) / r * g / s
    zero3 = (4 * g - kept) * f
    return {"dp": 2 * f * g, "dp2x2": 2 * f * g, "zero3": zero3, "zero3-reshard": zero3}.get(name)


def _kept_bytes(pm, sizes: dict[str, int]) -> float:
    """Bytes (``sizes``: parameter name -> bytes) of the parameters in the ZeRO-3 layers
    ``pm``'s plan keeps gathered from forward to backward (``decisions.zero_kept``)."""
    kept = set(pm.plan.decisions.zero_kept)
    layer = {n.param: n.layer for n in pm.plan.nodes.values() if n.param}
    return float(sum(b for name, b in sizes.items() if layer.get(name) in kept))


def _hand_dp(model, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def _hand_zero3(model, world, mesh=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _hand_tp(model, world, mesh=None):
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

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world,))
    for b in model.blocks:
        b.attn.forward = types.MethodType(local_attention, b.attn)
        parallelize_module(b, mesh, {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                                     "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
                                     "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    return model


def _hand_hsdp(model, world):
    """FSDP2's HSDP: ``fully_shard`` on a (world/2, 2) mesh, replicated over the first
    dimension and sharded over the second."""
    from torch.distributed.device_mesh import init_device_mesh

    return _hand_zero3(model, world, init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("rep", "shard")))


def _hand_zero3_tp(model, world):
    """FSDP2 over the first axis of a (world/2, 2) mesh, Megatron TP over the second."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    _hand_tp(model, world, mesh["tp"])
    return _hand_zero3(model, world, mesh["dp"])


DP2X2 = {"*": "RR", "input:0": "S(0)S(0)", "input:1": "S(0)S(0)"}
# the batch over the first axis, Megatron pins on the second, ZeRO-3 left to the planner's
# axis choice (it picks the first: the second holds tensor parallelism)
ZERO3_TP = {"*": "RR", "input:0": "S(0)R", "input:1": "S(0)R",
            **{k: "R" + v for k, v in MEGATRON.items() if not k.startswith("input")}}
# case: (hand-written builder, auto_parallel options, ways the batch is split: each rank
# passes the rows of its coordinate on the first ``ways`` ranks' axis, 1 = whole batch)
CASES = {"dp": (_hand_dp, dict(pins=DP, batch="local"), "world"),
         "dp2x2": (_hand_dp, dict(pins=DP2X2, batch="local", mesh=(2, 2)), "world"),
         # the planner's own choice, nothing pinned, against DDP (a user's first try)
         "auto": (_hand_dp, dict(batch="local"), "world"),
         # no pipeline, as FSDP2 (on a measured link the planner adds 2 stages)
         "zero3": (_hand_zero3, dict(pins=DP, batch="local", zero_stage=3, pipeline_stages=1), "world"),
         # every layer re-gathered in backward, as FSDP2 re-gathers its blocks (the planner
         # keeps what the memory budget allows gathered: all of this small GPT)
         "zero3-reshard": (_hand_zero3, dict(pins=DP, batch="local", zero_stage=3, pipeline_stages=1,
                                             reshard_after_forward=True), "world"),
         "tp": (_hand_tp, dict(pins=MEGATRON), "none"),
         "hsdp": (_hand_hsdp, dict(pins=DP2X2, batch="local", mesh=(2, 2), zero_stage=3, zero_axes=(1,),
                                   pipeline_stages=1), "world"),
         "zero3tp2": (_hand_zero3_tp, dict(pins=ZERO3_TP, batch="local", zero_stage=3, mesh=(2, 2),
                                                      pipeline_stages=1),
                      "first axis")}


def _case(name: str, rank: int, world: int, steps: int, optim: str, measured=None,
          only: str | None = None, defaults: bool = False) -> dict:
    """Build both modules for one case, run them interleaved and measure.  ``defaults``:
    as a user first calls autopar: the whole batch on every rank (``batch="global"``; the
    hand-written side still gets its rows, as from a DistributedSampler), no mesh
    description (the job's live calibration, :mod:`autopar.cost_models.live`) and AdamW
    as it comes on both sides."""
    import gpt

    import autopar
    from autopar.runtime.mesh import current, reset

    make_hand, opts, split = CASES[name]
    model, (x, y) = gpt.build(layers=4, dim=192, heads=4, vocab=256, seq=64, batch=8 * world)
    ref = copy.deepcopy(model)
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad}
    gbytes = sum(sizes.values())
    reset()
    opts = dict(opts)
    mesh = opts.pop("mesh", (world,))
    if defaults:
        opts.pop("batch", None)
        mesh = None if mesh == (world,) else mesh
        optim = "default"
    if measured is not None:
        # the measured 1-D mesh's link on every axis of the case's shape
        mesh = dataclasses.replace(measured, shape=tuple(mesh), axis_names=(),
                                   links=measured.links * len(mesh))
    pm = autopar.auto_parallel(model, example_inputs=(x, y), mesh=mesh, **opts)
    hand = make_hand(ref, world)
    # the rows this rank passes: its share of the batch over the data-parallel ranks
    ways, part = {"world": (world, rank), "first axis": (world // 2, rank // 2), "none": (1, 0)}[split]
    n = x.shape[0] // ways
    xs, ys = x[part * n:(part + 1) * n], y[part * n:(part + 1) * n]
    xa, ya = (x, y) if defaults else (xs, ys)  # what autopar's side is passed
    local = ways > 1
    # foreach: on CPU torch's optimizers default to a per-parameter loop, which costs
    # ~1 ms per DTensor parameter per step under gloo (CUDA defaults to foreach); both
    # sides use the same implementation
    # (hand-written TP leaves embeddings and norms plain tensors beside DTensors, which
    # foreach refuses to mix: that case keeps the loop on both sides)
    optim = "loop" if name in ("tp", "zero3tp2") and optim != "default" else optim
    kw = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False},
          "default": {}}[optim]
    oa = torch.optim.AdamW(pm.parameters(), lr=1e-3, **kw)
    ob = torch.optim.AdamW(hand.parameters(), lr=1e-3, **kw)
    losses: dict[str, list[float]] = {"autopar": [], "hand": []}

    def step_a():
        oa.zero_grad()
        loss = pm(xa, ya)
        loss.backward()
        oa.step()
        losses["autopar"].append(loss.detach().item())  # float(loss) warns each step

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

    if only is not None:
        # a process of its own per side (ru_maxrss never goes down): both modules are
        # built, only this side's steps run
        for _ in range(3):
            (step_a if only == "autopar" else step_b)()
        return {"case": name, "side": only, "rss": _peak_rss()}
    for _ in range(2):  # warm-up
        step_a()
        step_b()
    ta, tb = [], []
    for i in range(steps):
        # the order turns every step: a fixed A B put every A right after B's loss
        # all-reduce (gloo's threads still busy) and gave A the first slot after warm-up
        for run, out in ((step_a, ta), (step_b, tb))[::1 if i % 2 == 0 else -1]:
            out.append(_timed(run))
    ca, cb = _collectives(step_a), _collectives(step_b)
    sa, sb = _sent(step_a), _sent(step_b)
    return {"case": name, "autopar_ms": statistics.median(ta) * 1e3,
            "sent_autopar": sa, "sent_hand": sb, "sent_min": _minimum(name, gbytes, world, _kept_bytes(pm, sizes)),
            # what plan.collectives() says this rank puts on the wire (gloo's reduce-scatter
            # is an all-reduce of its input)
            "sent_planned": sum(c.count * c.wire_bytes(reduce_scatter_as_all_reduce=True)
                                for c in pm.plan.collectives(stage=current().stage)),
            "hand_ms": statistics.median(tb) * 1e3, "coll_autopar": ca, "coll_hand": cb,
            "interval": ratio_interval(ta, tb),
            "optim": optim, "link": measured.to_dict() if measured is not None else None,
            "layout": next((ln.split(None, 1)[1] for ln in pm.plan.summary().splitlines()
                            if ln.strip().startswith("layout")), "?"),
            "loss_diff": max(abs(a - b) for a, b in zip(losses["autopar"], losses["hand"]))}


def default_steps(case: str) -> int:
    """Interleaved steps per side for ``case``: 100 for the data-parallel cases, whose
    target (1.02x DDP) is inside the noise of 20 steps on the 2-core hosts (a 95%
    interval of ±0.04-0.07 there, ±0.03 at 100: :func:`ratio_interval`); 20 for the
    others, whose ratios sit well away from their targets and whose steps take 1.3-2.5x
    as long."""
    return 100 if case.startswith("dp") else 20


def ratio_interval(ta: list[float], tb: list[float], rounds: int = 2000,
                   level: float = 0.95) -> tuple[float, float]:
    """A ``level`` bootstrap interval of ``median(ta) / median(tb)``: the steps resampled
    with replacement ``rounds`` times, as pairs (step ``i`` of each side ran next to the
    other's, under the same load), a fixed seed so a run's numbers are its own.  It
    says how far the ratio of this run could move from the steps' noise alone."""
    rng = random.Random(0)
    n = len(ta)
    ratios = []
    for _ in range(rounds):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(ta[i] for i in idx) / statistics.median(tb[i] for i in idx))
    ratios.sort()
    cut = int((1 - level) / 2 * rounds)
    return ratios[cut], ratios[rounds - 1 - cut]


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    from _ranks import finish, join
    join(rank, world, port)
    link = None
    if args.get("link"):  # the link the timed run measured (peak RSS runs plan the same)
        from autopar import MeshSpec
        link = MeshSpec.from_dict(args["link"])
    elif args["calibrate"]:  # plan on this group's measured link (cost_models/calibrate.py)
        from autopar.cost_models.calibrate import calibrate
        link = calibrate()
    rows = [_case(name, rank, world, args["steps"] or default_steps(name), args["optim"], link,
                  args.get("only"), args.get("defaults", False))
            for name in args["cases"]]
    finish(rank, rows, out)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the cases and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="interleaved steps per side and case (default: default_steps())")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--cases", default="dp,zero3,tp")
    ap.add_argument("--optimizer", dest="optim", choices=("foreach", "fused", "loop"), default="foreach",
                    help="AdamW's implementation on both sides (loop: the CPU default)")
    ap.add_argument("--no-foreach", dest="optim", action="store_const", const="loop",
                    help="same as --optimizer loop")
    ap.add_argument("--calibrate", action="store_true",
                    help="plan on the link measured on the running group, not the cpu-gloo preset")
    ap.add_argument("--defaults", action="store_true",
                    help="a user's defaults: the whole batch to autopar, AdamW() as it comes, no "
                         "mesh description (live calibration, in a fresh cache directory)")
    ap.add_argument("--preset", action="store_true",
                    help="with --defaults: AUTOPAR_CALIBRATE=0, the cpu-gloo preset instead of the "
                         "live calibration (what the defaults gave before it)")
    a = ap.parse_args(argv)
    if a.defaults and a.calibrate:
        ap.error("--defaults plans on the live calibration; --calibrate on its own link")
    if a.defaults and a.preset:
        os.environ["AUTOPAR_CALIBRATE"] = "0"
    elif a.defaults:
        os.environ.pop("AUTOPAR_CALIBRATE", None)
        os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-cache-")
    else:  # the preset, or --calibrate's link: never the live calibration
        os.environ.setdefault("AUTOPAR_CALIBRATE", "0")
    from tests.dist.harness import free_port

    cases = [c for c in a.cases.split(",") if c]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        load0 = os.getloadavg()[0]
        run = {"steps": a.steps, "cases": cases, "optim": a.optim, "calibrate": a.calibrate,
               "defaults": a.defaults}
        mp.spawn(_worker, args=(a.world, free_port(), run, out), nprocs=a.world, join=True)
        rows = json.loads(Path(out).read_text())
        for r in rows:  # peak RSS: one run per side, each in fresh processes
            for side in ("autopar", "hand"):
                mp.spawn(_worker, args=(a.world, free_port(), run | {"cases": [r["case"]], "only": side,
                                                                    "link": r["link"]}, out),
                         nprocs=a.world, join=True)
                r[f"rss_{side}"] = json.loads(Path(out).read_text())[0]["rss"]
    print(f"| case | hand-written ms | autopar ms | autopar / hand (95% interval) | collectives per step, hand / "
          f"autopar | MB sent per rank per step, hand / autopar / analytic minimum | "
          f"autopar MB planned (plan.collectives()) | "
          f"peak RSS MB per rank, hand / autopar | max loss difference |  (world {a.world}, "
          f"{a.steps or 'dp cases 100, others 20'} interleaved steps, "
          + (f"a user's defaults: whole batch, AdamW(), {'cpu-gloo preset' if a.preset else 'live calibration'}, "
             if a.defaults else
             f"AdamW {a.optim} (tp cases: loop), "
             f"{'calibrated link' if a.calibrate else 'cpu-gloo preset'}, ")
          + f"load {load0:.2f} before)")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    layouts = "; ".join(f"{r['case']}: {r['layout']}" for r in rows)
    for r in rows:
        low = f"{r['sent_min'] / 1e6:.2f}" if r["sent_min"] else "-"
        print(f"| {r['case']} | {r['hand_ms']:.1f} | {r['autopar_ms']:.1f} | "
              f"{r['autopar_ms'] / r['hand_ms']:.2f} ({r['interval'][0]:.2f}-{r['interval'][1]:.2f}) | "
              f"{r['coll_hand']} / {r['coll_autopar']} | "
              f"{r['sent_hand'] / 1e6:.2f} / {r['sent_autopar'] / 1e6:.2f} / {low} | "
              f"{r['sent_planned'] / 1e6:.2f} | "
              f"{r['rss_hand']:.0f} / {r['rss_autopar']:.0f} | "
              f"{r['loss_diff']:.2e} |")
    print(f"\nautopar's layouts: {layouts}")
    return rows


if __name__ == "__main__":
    main()
