"""How well the predicted step time ranks and matches measured steps, preset vs calibrated.

    python benchmarks/cost_fidelity.py [--steps 3] [--rounds 5] [--warmup 1] [--world 4]
                                       [--resident 5] [--write] [--save DIR]
    python benchmarks/cost_fidelity.py --reprice DIR [--write]
    python benchmarks/cost_fidelity.py --compile --presets "cpu-gloo preset" --cases gpt:dp,...

On ``--world`` gloo ranks of this machine (one thread each), each case plans and builds
an autopar module (``auto_parallel``) for one model under one set of decisions and
trains it with AdamW (foreach); then ``--rounds`` rounds each time ``--steps`` steps of
every case of its group in turn (zero_grad, forward, backward, optimizer step; slowest
rank; after ``--warmup`` untimed ones: a case's first step after another's runs cold;
the median over all of a case's timed steps, spread = interquartile range / median),
so load that comes and goes touches the group's cases alike.  The cases are built and
measured ``--resident`` at a time and freed after (a training process holds one model;
with all 30 resident, steps ran 4-13% slower). ``plan.decisions.step_seconds`` is the
prediction. Every case runs twice: planned on the shipped ``cpu-gloo`` preset and on
the link measured on the running group (``cost_models.calibrate``, the MeshSpec
``autopar calibrate`` writes). Models: ``examples/gpt.py`` (4 layers, dim 192) and a
tiny Hugging Face Llama (``examples/hf_llama.py``, GQA, called as ``model(**batch)``).
Reported per preset: Spearman rank correlation of predicted against measured, the
median relative error ``|predicted - measured| / measured``, and the rank correlation of
the even rounds' medians with the odd rounds' (how well the measurement agrees with
itself: plans a few percent apart swap between halves too).  It prints its section of
``docs/benchmarks.md``, with the machine's load; ``--write`` also rewrites the
section's table there.

``--compile`` builds every module with ``compile=True``, planned compiled (its pointwise
chains priced fused, :mod:`autopar.search.fusion`), and also reports the same runs
against the eager price of the same plan (the price before plans knew they run
compiled); its table is printed, not written.

``--save DIR`` keeps the run: the measured rows (``rows.json``), the calibrated mesh
(``calibrated-mesh.json``) and the calibration's table.  ``--reprice DIR`` measures
nothing: it plans every stored case again (``autopar.plan``, no process group) on the
stored meshes with the cost model as it is now, and reports the new predictions
against the stored measurements, so a change to the cost model can be judged on runs
taken idle and busy without taking them again (the measured side is the same numbers;
only the predictions move).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTION = "## Cost-model fidelity (benchmarks/cost_fidelity.py)"
REGENERATE = "Regenerate with `python benchmarks/cost_fidelity.py --write`."
DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}
MEGATRON = {"*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
            "*out_proj.weight": "S(1)", "*fc1.weight": "S(0)", "*fc2.weight": "S(1)"}
BLOCKS = tuple(f"blocks.{i}" for i in range(4))
# (model, case name, auto_parallel options); mesh (world,) unless the options say
CASES = [
    ("gpt", "auto", {}),
    ("gpt", "dp", {"pins": DP}),
    ("gpt", "zero1", {"pins": DP, "zero_stage": 1}),
    ("gpt", "zero2", {"pins": DP, "zero_stage": 2}),
    ("gpt", "zero3", {"pins": DP, "zero_stage": 3}),
    ("gpt", "megatron-tp", {"pins": MEGATRON}),
    ("gpt", "pp2-1f1b", {"pipeline_stages": 2, "micro_batches": 2, "schedule": "1f1b"}),
    ("gpt", "recompute-all", {"recompute": BLOCKS}),
    ("gpt", "2-micro-batches", {"micro_batches": 2}),
    ("gpt", "dp-2x2", {"pins": {"*": "RR", "input:0": "S(0)S(0)", "input:1": "S(0)S(0)"},
                       "mesh": (2, 2)}),
    ("gpt", "auto-2x2", {"mesh": (2, 2)}),
    ("llama", "auto", {}),
    ("llama", "dp", {"pins": DP}),  # input:0, input:1 are input_ids, labels (flat order)
    ("llama", "zero3", {"zero_stage": 3}),
    ("llama", "2-micro-batches", {"micro_batches": 2}),
]


def _model(name: str, world: int):
    """(module, example kwargs or args, called with keywords)."""
    torch.manual_seed(0)
    if name == "gpt":
        import gpt
        model, (x, y) = gpt.build(layers=4, dim=192, heads=4, vocab=256, seq=64, batch=8 * world)
        return model, (x, y), False
    import hf_llama
    model, _, batch = hf_llama.build(hidden=128, layers=2, heads=4, kv_heads=2, vocab=256,
                                     batch=4 * world, seq=64)
    return model, batch, True


def _case_mesh(mesh_spec, shape: tuple[int, ...]):
    """``mesh_spec`` reshaped to the case's mesh, its first link on every axis (the
    ranks share one machine)."""
    import dataclasses
    return dataclasses.replace(mesh_spec, shape=tuple(shape), axis_names=(),
                               links=mesh_spec.links[:1] * len(shape))


def signature(plan) -> str:
    """What the runtime builds from ``plan``, as text: the plan-level decisions, the
    gradient buckets and every parameter's placements.  ``--reprice`` compares a stored
    row's with the plan the current cost model makes: a case planned differently now
    was not measured, and its prediction is not compared."""
    d = plan.decisions
    params = sorted((n.param or name, "/".join(n.out_placements))
                    for name, n in plan.nodes.items() if n.kind == "param")
    return json.dumps([d.pipeline_stages, d.pipeline_axis, d.schedule, d.virtual_stages,
                       d.micro_batches, d.stages, d.zero_stage, d.zero_axis, d.recompute,
                       d.precision, d.grad_buckets, params])


def case_call(model_name: str, case: str, mesh_spec, world: int) -> tuple:
    """``(module, inputs, called with keywords, arguments)``: a fresh module of the
    case's model with its inputs, and the keyword arguments that plan it on the case's
    mesh and options, the same for ``autopar.plan`` (``--reprice``) and
    ``autopar.auto_parallel`` (a measured run)."""
    model, inputs, kw = _model(model_name, world)
    opts = dict({(m, c): o for m, c, o in CASES}[(model_name, case)])
    mesh = _case_mesh(mesh_spec, opts.pop("mesh", (world,)))
    call = {"example_inputs": () if kw else inputs, "mesh": mesh, **opts}
    if kw:
        call["example_kwargs"] = inputs
    return model, inputs, kw, call


def _build(model_name: str, case: str, world: int, mesh_spec, compile: bool = False) -> dict:
    """Plan and build one case (compiled: planned and run so); a dict with its ``step``
    (AdamW step of the whole batch) and plan, or its ``error`` (raised alike on every
    rank: a table entry)."""
    import autopar

    model, inputs, kw, call = case_call(model_name, case, mesh_spec, world)
    try:
        pm = autopar.auto_parallel(model, **call, compile=compile)
    except Exception as e:  # noqa: BLE001 - raised alike on every rank: a table entry
        return {"model": model_name, "case": case, "error": f"{type(e).__name__}: {str(e)[:100]}"}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)

    def step():
        # train_step: forward and backward of the whole batch, whatever the schedule
        # (a pipeline or micro-batches interleave them)
        opt.zero_grad()
        if kw:
            pm.train_step(**inputs)
        else:
            pm.train_step(*inputs)
        opt.step()

    for _ in range(2):  # warm-up (compiled: the compile)
        step()
    out = {"model": model_name, "case": case, "step": step, "plan": pm.plan, "module": pm, "times": [],
           "fell_back": getattr(pm._compiled, "failure", None)}  # a compile that failed runs eagerly
    if compile and torch.distributed.get_rank() == 0:
        out["eager"] = _eager_price(model_name, case, mesh_spec, world, pm.plan)
    return out


def _eager_price(model_name: str, case: str, mesh_spec, world: int, plan) -> dict:
    """The eager price of a compiled case: the same case planned ``compile=False``
    (``autopar.plan``, no process group), and whether it is the same plan."""
    import autopar

    model, _, _, call = case_call(model_name, case, mesh_spec, world)
    eager = autopar.plan(model, **call, compile=False)
    return {"eager_predicted_ms": eager.decisions.step_seconds * 1e3,
            "eager_same_plan": signature(eager) == signature(plan)}


def _measure(built: list[dict], rounds: int, steps: int, warmup: int = 1) -> list[dict]:
    """``rounds`` rounds over every case, ``warmup`` untimed then ``steps`` timed steps
    of each per round: the cases interleaved, so load that comes and goes touches all
    of them alike (each module runs on its own mesh, runtime.mesh.activate).  Median
    and spread over all its timed steps."""
    from _ranks import timed
    from autopar.cost_models.measure import iqr
    for _ in range(rounds):
        for b in built:
            if "step" in b:
                # untimed: the first step after another case's finds this one's weights,
                # state and allocations out of the caches, which a training loop that
                # steps one module does not (data parallel measured 195.7 ms a step
                # alone, 217.7 in rounds over 30 resident cases, first steps included)
                for _ in range(warmup):
                    b["step"]()
                b["times"] += [timed(b["step"]) for _ in range(steps)]
    def half(times: list[float], parity: int) -> float:
        # the rounds of one parity: two independent measurements of the same case
        return statistics.median(t for i, t in enumerate(times) if (i // steps) % 2 == parity)

    rows = []
    for b in built:
        if "step" not in b:
            rows.append(b)
            continue
        d, times = b["plan"].decisions, b["times"]
        med = statistics.median(times)
        rows.append({"model": b["model"], "case": b["case"], "predicted_ms": d.step_seconds * 1e3,
                     "breakdown_ms": {k: round(v * 1e3, 1) for k, v in d.breakdown.items()},
                     "measured_ms": med * 1e3, "spread": iqr(times) / med, "plan": signature(b["plan"]),
                     "halves_ms": [half(times, 0) * 1e3, half(times, 1) * 1e3] if rounds > 1 else None,
                     "compiled": d.compile, "fell_back": b.get("fell_back")} | b.get("eager", {}))
    return rows


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    from _ranks import finish, join

    from autopar import MeshSpec
    join(rank, world, port)
    from autopar.cost_models import measure_cluster
    # --quick: what auto_parallel measures by default (cost_models/live.py), else the
    # full calibration of `autopar calibrate`
    record = measure_cluster(quick=True) if args.get("quick") else measure_cluster()
    if rank == 0:
        print(record.table(), flush=True)
        Path(out + ".calibration").write_text(record.table())
        Path(out + ".mesh.json").write_text(record.to_json())
    meshes = {"cpu-gloo preset": MeshSpec.preset("cpu-gloo", shape=(world,)),
              "calibrated": record.spec}
    todo = [(preset, spec, model_name, case) for preset, spec in meshes.items()
            if not args["presets"] or preset in args["presets"]
            for model_name, case, _ in CASES
            if not args["cases"] or f"{model_name}:{case}" in args["cases"]]
    size = args.get("resident") or max(1, len(todo))
    rows = []
    for i in range(0, len(todo), size):
        # a few cases built and resident at a time, measured in rounds, then freed: a
        # training process holds one model, and with all 30 resident the steps ran
        # 4-13% slower than with 4-5, more the more micro-batches a case runs (idle and
        # with one more busy process; docs/benchmarks.md, Cost-model fidelity)
        built = [{**_build(m, c, world, spec, args.get("compile", False)), "preset": p}
                 for p, spec, m, c in todo[i:i + size]]
        rows += [{**r, "preset": b["preset"]}
                 for b, r in zip(built, _measure(built, args["rounds"], args["steps"], args["warmup"]))]
        del built
        gc.collect()
    if rank == 0 and args["verbose"]:
        for r in rows:
            print(json.dumps(r), flush=True)
    finish(rank, rows, out)


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per preset: Spearman and median relative error over the cases that ran."""
    from autopar.verify import spearman
    out = {}
    for preset in dict.fromkeys(r["preset"] for r in rows):
        # a compile that fell back ran eagerly: not the compiled run its price is for
        ok = [r for r in rows if r["preset"] == preset and "error" not in r and not r.get("fell_back")]
        p = [r["predicted_ms"] for r in ok]
        m = [r["measured_ms"] for r in ok]
        rho = spearman(p, m)  # autopar.verify's: None when undefined (one side constant)
        # the measurement's own repeatability: the rank correlation of the even rounds'
        # medians with the odd rounds' (a ceiling no prediction can be expected to beat)
        halves = [r.get("halves_ms") for r in ok]
        self_rho = spearman([h[0] for h in halves], [h[1] for h in halves]) \
            if halves and all(halves) else None
        out[preset] = {"cases": len(ok), "spearman": math.nan if rho is None else rho,
                       "median_error": statistics.median(abs(x - y) / y for x, y in zip(p, m)),
                       "halves_spearman": math.nan if self_rho is None else self_rho}
    return out


def _range(rows: list[dict], model: str) -> float:
    """Largest over smallest measured step among ``model``'s rows (1.0 if none)."""
    m = [r["measured_ms"] for r in rows if r["model"] == model]
    return max(m) / min(m) if m else 1.0


def _pct(rows: list[dict], pick) -> int:
    """``pick`` (min or max) of the rows' measured spreads, in percent."""
    return round(100 * pick(r["spread"] for r in rows))


def section(rows: list[dict], world: int, steps: int, load: tuple[float, float],
            calibration: str = "", repriced: str = "", when: str = "", warmup: int = 1,
            resident: int = 0, command: str = REGENERATE, quick: bool = False) -> str:
    """The markdown section for docs/benchmarks.md (``resident``: the cases built and
    measured together, 0 for all of them; ``command``: its last line,
    ``plan_time.regenerate``'s)."""
    from plan_time import machine

    lines = [SECTION, "",
             f"Predicted (`plan.decisions.step_seconds`) against measured step time (median of "
             f"{steps} AdamW steps taken in rounds over "
             + (f"groups of {resident} cases, each group built, measured and freed in turn, "
                if resident else "every case, ")
             + (f"each case's first {warmup} step(s) of a round untimed, " if warmup else "")
             + f"slowest of {world} gloo ranks, "
             "one thread each; spread = interquartile range / median) for "
             f"`examples/gpt.py` (4 layers, dim 192) and a tiny HF Llama (2 layers, hidden 128, "
             "GQA), each case planned on the shipped `cpu-gloo` preset and on the link "
             + ("`auto_parallel` measures by default (`measure_cluster(quick=True)`, "
                "`--quick`) " if quick else "`autopar calibrate` (`cost_models.measure_cluster`) ")
             + "measured on the running group: collectives per kind after a barrier, compute, the optimizer step, overlap "
             "and idle reuse with every rank busy, the slowest rank's pace and the drift a "
             "blocking collective waits out.", "",
             f"Measured {when or _dt.date.today().isoformat()} on: {machine()}; load average "
             f"{load[0]:.2f} before, {load[1]:.2f} after."
             + (f" Predictions re-priced with the current cost model from the stored run "
                f"`{repriced}` (`--reprice`): its measurements, its calibration." if repriced else ""),
             "",
             "| preset | cases | Spearman | median relative error | measured even vs odd rounds: Spearman |",
             "|---|---:|---:|---:|---:|"]
    for preset, s in summary(rows).items():
        lines.append(f"| {preset} | {s['cases']} | {s['spearman']:.2f} | {100 * s['median_error']:.0f}% | "
                     f"{s['halves_spearman']:.2f} |")
    lines += ["", "| preset | model | case | predicted ms | measured ms | measured spread |",
              "|---|---|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['model']} | {r['case']} | {r['error']} | - | - |")
        else:
            lines.append(f"| {r['preset']} | {r['model']} | {r['case']} | {r['predicted_ms']:.1f} | "
                         f"{r['measured_ms']:.1f} | {100 * r['spread']:.0f}% |")
    ok = [r for r in rows if "error" not in r]
    if ok:
        ratio = [r["predicted_ms"] / r["measured_ms"] for r in ok]
        cal = summary(rows).get("calibrated")
        met = cal is not None and cal["spearman"] >= 0.9 and cal["median_error"] <= 0.2
        lines += ["", f"Predicted / measured ranges {min(ratio):.2f}-{max(ratio):.2f} over all "
                  f"cases. Issue 12's targets (calibrated Spearman >= 0.9, median error <= 20%) "
                  f"are {'met' if met else 'not met'} in this run. What limits them here: the "
                  f"GPT's plans lie within {_range(ok, 'gpt'):.1f}x of each other (measured) "
                  f"while one step's spread is {_pct(ok, min)}-{_pct(ok, max)}% ({world} ranks "
                  "share the cores), so neighbours swap places between runs; and the models' "
                  "runtime overhead beyond their kernels (the tiny Llama's hundreds of small "
                  "ops per step) is priced only through the calibrated rates."]
    if calibration:
        lines += ["", "The calibration this run planned with (`autopar calibrate` prints the same):",
                  "", "```text", calibration, "```"]
    lines += ["", command, ""]
    return "\n".join(lines)


def reprice(keep: Path, presets: list[str] | None = None) -> tuple[list[dict], str, tuple[float, float]]:
    """The rows ``--save`` kept in ``keep``, each predicted again: its case planned
    (``autopar.plan``) on its stored mesh (the preset, or the calibrated mesh) with the
    cost model as it is now; the measured side unchanged (only ``presets``' rows, if
    given).  A case the current model plans differently (:func:`signature`) becomes an
    error row: what it would run was not measured.  Also the stored calibration table and load."""
    import autopar
    from autopar import MeshSpec

    stored = json.loads((keep / "rows.json").read_text())
    world = stored["world"]
    meshes = {"cpu-gloo preset": MeshSpec.preset("cpu-gloo", shape=(world,)),
              "calibrated": MeshSpec.from_json((keep / "calibrated-mesh.json").read_text())}
    rows = []
    for r in stored["rows"]:
        if presets and r["preset"] not in presets:
            continue
        if "error" in r:
            rows.append(r)
            continue
        model, _, _, call = case_call(r["model"], r["case"], meshes[r["preset"]], world)
        plan = autopar.plan(model, **call, compile=bool(r.get("compiled")))
        d = plan.decisions
        if r.get("compiled"):  # --compile's run: the eager price of the same case beside
            r = {**r, **_eager_price(r["model"], r["case"], meshes[r["preset"]], world, plan)}
        if r.get("plan") != signature(plan):
            rows.append({k: v for k, v in r.items() if k != "predicted_ms"}
                        | {"error": "planned differently now: not the plan measured"})
            continue
        rows.append({**r, "predicted_ms": d.step_seconds * 1e3,
                     "breakdown_ms": {k: round(v * 1e3, 1) for k, v in d.breakdown.items()}})
    return rows, (keep / "calibration.txt").read_text(), tuple(stored["load"])


def write_table(text: str, doc: Path | None = None) -> None:
    """Put :func:`section`'s ``text`` in ``doc`` (default docs/benchmarks.md) in place of
    the section's generated part, from its heading to the line that says how to
    regenerate it, and keep what follows (``plan_time.write_section``)."""
    from plan_time import DOC, write_section
    write_section(text, doc or DOC)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case per round")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds over every case (interleaved; at 3 one step's spread reached 22%%)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps of a case before its timed ones in every round")
    ap.add_argument("--resident", type=int, default=5,
                    help="cases built and measured together (interleaved), then freed; 0: all")
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    ap.add_argument("--cases", default="", help="comma-separated model:case names (default all)")
    ap.add_argument("--presets", default="", help="'cpu-gloo preset' and/or 'calibrated' (comma-separated)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each row as it is measured")
    ap.add_argument("--quick", action="store_true",
                    help="calibrate as auto_parallel does by default (measure_cluster(quick=True), "
                         "about 10 s), not the full `autopar calibrate` (about 30 s)")
    ap.add_argument("--compile", action="store_true",
                    help="build each module with compile=True (planned compiled); also report the "
                         "eager price of the same cases; print only")
    ap.add_argument("--save", metavar="DIR", help="keep the rows, the calibrated mesh and its table in DIR")
    ap.add_argument("--reprice", metavar="DIR",
                    help="measure nothing: price DIR's stored cases again with the current cost model")
    a = ap.parse_args(argv)
    from plan_time import regenerate
    command = regenerate("cost_fidelity.py", argv)
    if a.reprice:
        stored = json.loads((Path(a.reprice) / "rows.json").read_text())
        rows, calibration, load = reprice(Path(a.reprice), [p for p in a.presets.split(",") if p])
        text = section(rows, stored["world"], stored["steps"], load, calibration,
                       repriced=Path(a.reprice).name, when=stored["when"],
                       warmup=stored.get("warmup", 0), resident=stored.get("resident", 0),
                       command=command)
        print(text)
        if any(r.get("compiled") for r in rows):
            print(eager_price(rows))
        elif a.write:
            write_table(text)
        return rows

    from tests.dist.harness import free_port
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        load0 = os.getloadavg()[0]
        mp.spawn(_worker, args=(a.world, free_port(), {"steps": a.steps, "rounds": a.rounds, "warmup": a.warmup,
                                                  "resident": a.resident, "cases": [c for c in a.cases.split(",") if c],
                                                  "presets": [p for p in a.presets.split(",") if p],
                                                  "verbose": a.verbose, "quick": a.quick,
                                                  "compile": a.compile}, out),
                 nprocs=a.world, join=True)
        rows = json.loads(Path(out).read_text())
        calibration = Path(out + ".calibration").read_text()
        load = (load0, os.getloadavg()[0])
        if a.save:
            keep = Path(a.save)
            keep.mkdir(parents=True, exist_ok=True)
            (keep / "rows.json").write_text(json.dumps({"rows": rows, "load": load, "world": a.world,
                                                        "steps": a.steps * a.rounds, "warmup": a.warmup,
                                                        "resident": a.resident,
                                                        "when": _dt.date.today().isoformat()}))
            (keep / "calibration.txt").write_text(calibration)
            (keep / "calibrated-mesh.json").write_text(Path(out + ".mesh.json").read_text())
    text = section(rows, a.world, a.steps * a.rounds, load, calibration, warmup=a.warmup,
                   resident=a.resident, command=command, quick=a.quick)
    print(text)
    if a.compile:
        print(eager_price(rows))
    elif a.write:
        write_table(text)
    return rows


def eager_price(rows: list[dict]) -> str:
    """Compiled runs against the eager price of the same case (what plans predicted before
    they knew they run compiled): per preset, Spearman and median relative error, and
    each case's two predictions."""
    rows = [r for r in rows if "eager_predicted_ms" in r and "error" not in r]
    eager = [{**r, "predicted_ms": r["eager_predicted_ms"]} for r in rows]
    lines = ["Compiled runs against the eager price (same case planned compile=False):", "",
             "| preset | cases | Spearman | median relative error |", "|---|---:|---:|---:|"]
    lines += [f"| {p} | {s['cases']} | {s['spearman']:.2f} | {100 * s['median_error']:.0f}% |"
              for p, s in summary(eager).items()] if eager else []
    lines += ["", "| case | compiled price ms | eager price ms | same plan | measured ms |", "|---|---:|---:|---|---:|"]
    lines += [f"| {r['model']}:{r['case']} | {r['predicted_ms']:.1f} | {r['eager_predicted_ms']:.1f} | "
              f"{r['eager_same_plan']} | {r['measured_ms']:.1f} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
