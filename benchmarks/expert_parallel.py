"""Expert parallel against data parallel and a Megatron-style expert split: predicted vs
measured step.

    python benchmarks/expert_parallel.py [--steps 20] [--seq 128] [--batch 4] [--write]

On 4 gloo ranks of this machine (one thread each; one run, one process group),
``examples/moe.py`` (GShard top-2 MoE GPT: 2 layers, dim 128, hidden 512, 8 experts,
capacity factor 1.0, fp32; the experts hold ~90% of the weights) is planned with
``auto_parallel`` on mesh (4,) of the ``cpu-gloo`` preset as:

* ``ep``: ``moe.ep_pins(layers, 1)`` (expert weights ``S(0)`` on E, groups on the batch,
  the dispatched tokens moved groups -> experts by an all-to-all and back);
* ``planner``: no pins, the planner's own choice;
* ``dp``: batch pinned split (``S(0)``), every weight ``R``;
* ``expert-tp``: the experts' hidden dim split Megatron-style (``w_in`` ``S(2)``,
  ``w_out`` ``S(1)``), tokens whole on every rank; the rest is the planner's.

Every plan is built in the same group and their steps are interleaved round-robin
(A B C ... A B C ...), so load drifts hit all alike. A step is ``zero_grad``,
``pm.train_step(x, y)`` (forward + backward) and ``AdamW(foreach=True).step()``,
timed as the slowest rank's (barrier before, MAX all-reduce after). Reported per plan:
``plan.decisions.step_seconds``, the median measured step, its spread, the collectives
of one profiled step (all of them, and the all-to-alls alone beside the plan's: each
all-to-all it lists runs once forward and its dual once backward), the bytes rank 0
sends in one step (``/proc/self/io`` ``wchar``, as benchmarks/runtime_vs_torch.py
reads it: gloo's TCP sends are the process's only writes meanwhile) beside the analytic
bytes of the plan's all-to-alls and of the replicated gradients' ring all-reduce, and
the measured and predicted step ratios against DP.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTION = "## Expert parallel: predicted vs measured step (benchmarks/expert_parallel.py)"
WORLD = 4
MODEL = {"layers": 2, "dim": 128, "heads": 4, "hidden": 512, "experts": 8, "vocab": 256}
DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
# the experts' hidden dim split as Megatron splits an MLP, tokens whole on every rank
# (no "*": "R" here: two globs would both match the expert weights; the dense part is
# left to the planner)
EXPERT_TP = {"*w_in": "S(2)", "*w_out": "S(1)", "input:0": "R", "input:1": "R"}
COLLECTIVES_MODULE = "autopar.runtime.collectives"


def _plans() -> list[tuple[str, dict | None]]:
    import moe

    return [("ep", moe.ep_pins(MODEL["layers"], 1)), ("planner", None), ("dp", DP),
            ("expert-tp", EXPERT_TP)]


def _collectives(step: Callable[[], None]) -> tuple[int, int]:
    """(collectives, all-to-alls) one step issues on this rank (gloo profiler events)."""
    from _ranks import gloo_events

    names = gloo_events(step)
    return len(names), sum(1 for n in names if "all_to_all" in n or "alltoall" in n)


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _sent(step: Callable[[], None]) -> float:
    """Bytes this rank writes during one step (gloo's sends: see the module docstring)."""
    import torch.distributed as dist

    dist.barrier()
    before = _wchar()
    step()
    return float(_wchar() - before)


def _analytic(plan, model: torch.nn.Module) -> tuple[int, float, float]:
    """(all-to-alls per step, their bytes, the replicated gradients' ring all-reduce
    bytes) one rank sends per step by the plan: every all-to-all the plan lists moves
    (p-1)/p of this rank's shard of its tensor, forward and (its dual) backward; every
    weight replicated on the mesh has its fp32 gradient all-reduced, 2(p-1)/p of it."""
    f = (WORLD - 1) / WORLD
    n, a2a = 0, 0.0
    for node in plan.nodes.values():
        for r in node.redistributions:
            for s in r.steps:
                if s.startswith("all_to_all"):
                    src = plan.nodes.get(r.input)
                    numel = math.prod(src.shape[0]) if src is not None and src.shape else 0
                    n += 2
                    a2a += 2 * f * 4 * numel / WORLD
    sizes = dict(model.named_parameters())
    grads = sum(sizes[k].numel() * 4 for k, v in plan.params().items()
                if k in sizes and sizes[k].requires_grad and set(v) == {"R"})
    return n, a2a, 2 * f * grads


def _build(name: str, pins, shape: dict):
    """(row, step function or None): the plan's facts and one training step."""
    import moe

    import autopar
    from autopar import MeshSpec
    from autopar.plans.roles import layout
    from autopar.runtime.mesh import reset

    model, (x, y) = moe.build(**shape)
    row: dict = {"plan": name}
    reset()
    try:
        pm = autopar.auto_parallel(model, example_inputs=(x, y),
                                   mesh=MeshSpec.preset("cpu-gloo", shape=(WORLD,)), pins=pins)
    except Exception as e:  # noqa: BLE001 - raised alike on every rank: a table entry
        return {**row, "error": f"{type(e).__name__}: {str(e)[:160]}"}, None
    calls = Counter(n.target.__name__ for n in pm.inner.graph.nodes
                    if n.op == "call_function"
                    and getattr(n.target, "__module__", "") == COLLECTIVES_MODULE)
    experts = sorted({v for k, v in pm.plan.params().items() if k.endswith(("w_in", "w_out"))})
    n_a2a, a2a_bytes, ar_bytes = _analytic(pm.plan, model)
    row.update(layout=layout(pm.plan), predicted_ms=pm.plan.decisions.step_seconds * 1e3,
               experts="/".join(experts),
               calls=", ".join(f"{k} x{v}" for k, v in sorted(calls.items())) or "none",
               a2a_planned=n_a2a, a2a_bytes=a2a_bytes, ar_bytes=ar_bytes)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        opt.zero_grad()
        loss = pm.train_step(x, y)
        opt.step()
        row["loss"] = loss.detach()  # the last step's: the plans must agree

    return row, step


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    from _ranks import finish, join, timed

    join(rank, world, port)
    shape = {**MODEL, "seq": args["seq"], "batch": args["batch"]}
    built = [_build(*p, shape) for p in _plans()]
    live = [(r, s) for r, s in built if s is not None]
    times: list[list[float]] = [[] for _ in live]
    for i in range(2 + args["steps"]):  # 2 warm-up rounds, then measured ones
        for j, (_, step) in enumerate(live):  # round-robin: drifts hit every plan alike
            t = timed(step)
            if i >= 2:
                times[j].append(t)
    for (r, _), ts in zip(live, times):
        med = statistics.median(ts)
        r.update(measured_ms=med * 1e3, spread=(max(ts) - min(ts)) / med)
    for r, step in live:  # one more step each, profiled, and one counting bytes (not timed)
        r["collectives"], r["a2a_measured"] = _collectives(step)
        r["sent"] = _sent(step)
        r["loss"] = float(r["loss"])
    finish(rank, [r for r, _ in built], out)


def _mb(b: float) -> str:
    return f"{b / 2**20:.2f}"


def table(rows: list[dict]) -> list[str]:
    """The markdown table, one row per plan."""
    lines = ["| plan | layout | expert weights | collectives the code calls | predicted ms | "
             "measured ms | spread | collectives per step | all-to-alls measured / planned | "
             "MiB sent per rank | analytic MiB: all-to-all + grad all-reduce | "
             "vs DP, measured / predicted |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['plan']} | {r['error']} |" + " - |" * 10)
            continue
        vs = r.get("vs_dp")
        lines.append(
            f"| {r['plan']} | {r['layout']} | {r['experts']} | {r['calls']} | "
            f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {100 * r['spread']:.0f}% | "
            f"{r['collectives']} | {r['a2a_measured']} / {r['a2a_planned']} | {_mb(r['sent'])} | "
            f"{_mb(r['a2a_bytes'])} + {_mb(r['ar_bytes'])} | "
            f"{'-' if vs is None else f'{vs[0]:.2f} / {vs[1]:.2f}'} |")
    return lines


def _ratios(rows: list[dict]) -> None:
    dp = next((r for r in rows if r["plan"] == "dp" and "error" not in r), None)
    for r in rows:
        if dp is not None and "error" not in r:
            r["vs_dp"] = (r["measured_ms"] / dp["measured_ms"],
                          r["predicted_ms"] / dp["predicted_ms"])


def section(rows: list[dict], a: argparse.Namespace, load: tuple[float, float],
            command: str = "") -> str:
    """The markdown section for docs/benchmarks.md, with a paragraph read off the rows
    (``command``: its last line, ``plan_time.regenerate``'s)."""
    import moe
    from plan_time import machine, regenerate

    model, _ = moe.build(**MODEL, seq=a.seq, batch=a.batch)
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("w_in", "w_out")))
    ok = [r for r in rows if "error" not in r]
    by = {r["plan"]: r for r in ok}
    pm = [r["predicted_ms"] / r["measured_ms"] for r in ok]
    loss_gap = max((abs(r["loss"] - by["dp"]["loss"]) for r in ok), default=float("nan")) \
        if "dp" in by else float("nan")
    words = []
    if "ep" in by and "vs_dp" in by["ep"]:
        ep = by["ep"]
        words.append(f"EP measured {ep['vs_dp'][0]:.2f}x DP's step, predicted "
                     f"{ep['vs_dp'][1]:.2f}x; it issued {ep['a2a_measured']} all-to-alls in "
                     f"the profiled step against the {ep['a2a_planned']} the plan implies "
                     f"(2 forward + 2 backward per MoE layer).")
        if "dp" in by:
            words.append(f"Rank 0 sent {_mb(ep['sent'])} MiB per EP step against "
                         f"{_mb(by['dp']['sent'])} MiB for DP (analytic "
                         f"{_mb(ep['a2a_bytes'] + ep['ar_bytes'])} and "
                         f"{_mb(by['dp']['a2a_bytes'] + by['dp']['ar_bytes'])}).")
    if "planner" in by:
        p = by["planner"]
        words.append(f"Left alone the planner picks {p['layout']} (expert weights "
                     f"{p['experts']}), measured {p.get('vs_dp', (float('nan'),))[0]:.2f}x "
                     "DP's step.")
    if "expert-tp" in by and "vs_dp" in by["expert-tp"]:
        t = by["expert-tp"]
        words.append(f"The Megatron-style expert split measured {t['vs_dp'][0]:.2f}x DP's "
                     f"step (predicted {t['vs_dp'][1]:.2f}x).")
    failed = " ".join(f"Failed: {r['plan']}: {r['error']}." for r in rows if "error" in r)
    lines = [SECTION, "",
             f"`examples/moe.py` (GShard top-2, {MODEL['layers']} layers, dim {MODEL['dim']}, "
             f"heads {MODEL['heads']}, {MODEL['experts']} experts of hidden {MODEL['hidden']}, "
             f"capacity factor 1.0, vocab {MODEL['vocab']}, seq {a.seq}, batch {a.batch}, fp32; "
             f"{expert / 1e6:.2f}M of the {total / 1e6:.2f}M weights are the experts') on "
             f"{WORLD} gloo ranks of this machine (one thread each), mesh ({WORLD},) of the "
             "`cpu-gloo` preset, every plan built with `auto_parallel` in one process group and "
             f"stepped round-robin: median of {a.steps} AdamW steps (`train_step` + "
             "`opt.step()`, foreach), slowest rank; spread = (max - min) / median. Plans: `ep` = "
             "`moe.ep_pins(2, 1)`; `planner` = no pins; `dp` = every weight `R`, batch `S(0)`; "
             "`expert-tp` = `w_in` `S(2)`, `w_out` `S(1)`, tokens `R`, the rest the planner's. "
             "\"collectives the code calls\" counts the `autopar.runtime.collectives` calls in "
             "the generated forward (gradient buckets are not among them); \"collectives per "
             "step\" and the all-to-alls are gloo events of one profiled step on rank 0; "
             "\"planned\" all-to-alls are twice those `plan.redistributions()` lists (each runs its "
             "dual in backward). MiB sent: rank 0's `/proc/self/io` `wchar` over one step; "
             "analytic: (p-1)/p of the rank's shard per all-to-all, plus 2(p-1)/p of the "
             "gradients of the weights replicated on the mesh (other collectives not counted).",
             "",
             f"Measured {_dt.date.today().isoformat()} on: {machine()}; load average "
             f"{load[0]:.2f} before, {load[1]:.2f} after (other jobs were running on the "
             "machine meanwhile).", "", *table(rows), ""]
    if ok:
        lines += [" ".join(words) + f" Predicted / measured ranges {min(pm):.2f}-{max(pm):.2f}: "
                  f"{WORLD} ranks share {os.cpu_count()} cores with other work, so absolute "
                  "times run well above the `cpu-gloo` preset's and the ratios are what to "
                  f"compare. At step {a.steps + 4} (after {a.steps + 3} AdamW updates) every "
                  f"plan's loss is within {loss_gap:.1e} of DP's. {failed}".rstrip(), ""]
    lines += [command or regenerate("expert_parallel.py", []), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every plan in one group, print the section and (with --write) write it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="DP and EP need it divisible by 4")
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    a = ap.parse_args(argv)
    from _ranks import run_section
    from plan_time import regenerate

    return run_section(_worker, WORLD, a, _ratios, section, regenerate("expert_parallel.py", argv))


if __name__ == "__main__":
    main()
