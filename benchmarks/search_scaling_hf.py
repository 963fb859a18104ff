"""Planning time, proven gap and layer classes on Hugging Face Llama and Mixtral shapes.

``LlamaForCausalLM`` itself (GQA, rotary tables and mask shared by every layer) built from
the Llama-3 8B and 70B configs on the meta device, captured once per mesh with one
2,048-token sequence per device, planned by :func:`autopar.search.op_placement.make_plan` (ILP) with
the device's memory as the budget on meshes of 8, 64, 256 and 1,024 devices, beside the
flat ILP (no clustering, no shared pricing) on the same captured graph where it finishes
within the cell limit::

    python benchmarks/search_scaling_hf.py --models 8B --devices 8 64   # prints the table
    python benchmarks/search_scaling.py --hf --write    # runs this file, updates the docs

Each (model, mesh) cell runs in its own subprocess with a wall-clock limit. Besides the
intra-op ILP on one captured graph, each cell times the whole ``autopar.plan`` a user
runs: capture, the joint search over pipeline stages, micro-batches, ZeRO and
recomputation under the device's memory, and the plan it returns.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import machine, regenerate, write_section  # noqa: E402  (same folder, shared helpers)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Search scaling on Hugging Face Llama (benchmarks/search_scaling_hf.py)"
# Llama-3 configs (Meta's model cards): layers, hidden, heads, kv heads, ffn, vocab
LLAMAS = {"8B": (32, 4096, 32, 8, 14336, 128256), "70B": (80, 8192, 64, 8, 28672, 128256)}
# Mixtral-8x7B (Mistral AI's config): 8 experts of 4096 -> 14336, top-2, 32 layers, GQA
MIXTRAL = "Mixtral-8x7B"
MODELS = [*LLAMAS, MIXTRAL]
DEVICES = {MIXTRAL: [64]}  # the Llamas: every mesh of MESHES
SEQ = 2048
# as real runs train: bf16 mixed precision, each data-parallel rank feeding (and getting
# back) its own rows
PRECISION = "bf16-mixed"
BATCH = "local"
MESHES = {8: ("multinode-h100-ib", (8,)), 64: ("multinode-h100-ib", (8, 8)),
          256: ("multinode-h100-ib", (32, 8)), 1024: ("multinode-h100-ib", (128, 8))}


def _model(name: str):
    import torch
    import transformers as tf

    if name == MIXTRAL:
        cfg = tf.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               num_local_experts=8, num_experts_per_tok=2,
                               max_position_embeddings=8192)
        with torch.device("meta"):
            return tf.MixtralForCausalLM(cfg)
    layers, hidden, heads, kv, ffn, vocab = LLAMAS[name]
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, max_position_embeddings=8192)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(cfg)


def measure(name: str, devices: int, time_limit: float, flat: bool) -> dict:
    """One cell: capture at one sequence per device, clustered ILP, then the flat ILP."""
    import torch

    from autopar import MeshSpec
    from autopar.capture.annotate import annotate
    from autopar.capture.trace import capture
    from autopar.errors import PlanError
    from autopar.plans.decisions import PlanOptions
    from autopar.search.op_placement import _solve, build_problem, cost_model, make_plan
    from autopar.sharding.strategies import enumerate_strategies

    model = _model(name)
    ids = torch.zeros(devices, SEQ, dtype=torch.long, device="meta")
    rec: dict = {"model": name, "devices": devices,
                 "params": sum(p.numel() for p in model.parameters())}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rotary/mask ops' replicated fallbacks
        cap = capture(model, (), {"input_ids": ids, "labels": ids}, precision=PRECISION)
        t0 = time.perf_counter()
        annotate(cap.gm)
        rec.update(capture=cap.seconds, annotate=time.perf_counter() - t0,
                   graph_nodes=len(cap.gm.graph.nodes))
        preset, shape = MESHES[devices]
        mesh = MeshSpec.preset(preset, shape=shape)
        t0 = time.perf_counter()
        opts = PlanOptions(time_limit=time_limit, search="ilp", precision=PRECISION, batch=BATCH)
        try:
            p = make_plan(cap.gm, mesh, cap.aliases, opts)
        except PlanError as e:  # placement alone does not fit: the joint search may
            rec.update(seconds=time.perf_counter() - t0, ilp_error=str(e).split(";")[0][:160])
            rec["joint"] = _joint(model, ids, mesh)
            return rec
        s = p.solver
        rec.update(seconds=time.perf_counter() - t0, objective_ms=p.objective * 1e3,
                   status=s.status, gap=s.gap, backend=s.backend, message=s.message,
                   memory_gib=p.memory.get("total", 0.0) / 2**30)
        if flat:
            t0 = time.perf_counter()
            st = enumerate_strategies(cap.gm, shape)
            pb = build_problem(cap.gm, mesh, st, cost_model(cap.gm, mesh, opts), mesh.usable_memory)
            try:
                sol = _solve(pb.problem, time_limit)
                rec["flat"] = {"seconds": time.perf_counter() - t0, "status": str(sol.status),
                               "objective_ms": sol.objective * 1e3, "gap": sol.gap}
            except Exception as e:  # noqa: BLE001 - a failure is a table entry
                rec["flat"] = {"seconds": time.perf_counter() - t0,
                               "error": f"{type(e).__name__}: {str(e)[:120]}"}
        rec["joint"] = _joint(model, ids, mesh)
    return rec


def _joint(model, ids, mesh) -> dict:
    """The whole ``autopar.plan`` (its own capture, the joint search, the plan)."""
    import autopar
    from autopar.report.summary import summary_numbers

    t0 = time.perf_counter()
    try:
        p = autopar.plan(model, (), example_kwargs={"input_ids": ids, "labels": ids}, mesh=mesh,
                         precision=PRECISION, batch=BATCH)
    except Exception as e:  # noqa: BLE001 - a failure is a table entry
        return {"seconds": time.perf_counter() - t0, "error": f"{type(e).__name__}: {str(e)[:160]}"}
    nums = summary_numbers(p)
    return {"seconds": time.perf_counter() - t0, "capture": p.timings.get("capture", 0.0),
            "layout": nums["layout"], "step_ms": p.decisions.step_seconds * 1e3,
            "mfu": nums.get("mfu"), "gap": p.solver.gap, "status": p.solver.status,
            "estimated": "estimated from" in p.solver.message,
            "stopped": any("budget (" in w and "time_limit=" in w for w in p.warnings),
            "memory_gib": p.memory.get("total", 0.0) / 2**30}


def run_cell(name: str, devices: int, time_limit: float, flat: bool, timeout: float) -> dict:
    """``measure`` in a subprocess (a solver thread left at its deadline dies with it)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cell.json"
        cmd = [sys.executable, __file__, "--_cell", name, str(devices), str(time_limit),
               "1" if flat else "0", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if out.exists():
                return json.loads(out.read_text())
            tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
            return {"model": name, "devices": devices, "error": tail[0][:160]}
        except subprocess.TimeoutExpired:
            return {"model": name, "devices": devices, "error": f"timed out after {timeout:g} s"}


def _gap(g: float | None) -> str:
    return "gap unknown" if g is None else f"gap {100 * g:.2f}%"


def _classes(message: str) -> str:
    """'32 layers -> 1 class' from the solver's message, or 'flat'."""
    if "clustered" not in message:
        return "not clustered"
    words = message.split("clustered ", 1)[1].split()
    return f"{words[0]} layers -> {words[4]} class{'es' if words[4] != '1' else ''}"


def _joint_cell(j: dict | None) -> str:
    if j is None:
        return "not run"
    if "error" in j:
        return f"{j['seconds']:.1f} s: {j['error']}"
    mfu = f", MFU {100 * j['mfu']:.0f}%" if j.get("mfu") else ""
    est = ", splits estimated from a 4-layer copy" if j.get("estimated") else ""
    return (f"{j['seconds']:.1f} s ({j['capture']:.1f} capture){est}: {j['layout']}, "
            f"{j['step_ms']:.0f} ms{mfu}, {j['memory_gib']:.1f} GiB, {_gap(j['gap'])}")


def row(r: dict) -> str:
    """One markdown row."""
    shape = "x".join(map(str, MESHES[r["devices"]][1]))
    if "error" in r:
        return f"| {r['model']} | - | {r['devices']} ({shape}) | - | {r['error']} | - | - | - |"
    if "ilp_error" in r:  # placement alone does not fit the budget
        return (f"| {r['model']} | {r['params'] / 1e9:.1f}B | {r['devices']} ({shape}) | "
                f"{r['capture']:.1f} + {r['annotate']:.1f} | {r['seconds']:.1f} s: {r['ilp_error']} "
                f"| - | not run | {_joint_cell(r.get('joint'))} |")
    f = r.get("flat")
    if f is None:
        flat = "not run"
    elif "error" in f:
        flat = f"{f['seconds']:.1f} s: {f['error']}"
    else:
        same = "same plan cost" if math.isclose(f["objective_ms"], r["objective_ms"], rel_tol=1e-6) \
            else f"cost {(f['objective_ms'] / r['objective_ms'] - 1):+.2%} vs clustered"
        flat = f"{f['seconds']:.1f} s, {f['status']}, {_gap(f['gap'])} ({same})"
    return (f"| {r['model']} | {r['params'] / 1e9:.1f}B | {r['devices']} ({shape}) | "
            f"{r['capture']:.1f} + {r['annotate']:.1f} | {r['seconds']:.1f} s, "
            f"{r['objective_ms']:.0f} ms, {r['status']}, {_gap(r['gap'])}, "
            f"{r['memory_gib']:.1f} GiB | {_classes(r['message'])} | {flat} | "
            f"{_joint_cell(r.get('joint'))} |")


HEADER = ("| model | params | devices (mesh) | capture + annotate s | clustered ILP: time, "
          "predicted step, status, proven gap, memory/device | layer classes | flat ILP | "
          "whole `autopar.plan` (joint search): seconds (capture), layout, predicted step, "
          "memory/device, gap |")
RULE = "|---|---:|---|---:|---|---|---|---|"


def findings(recs: list[dict]) -> list[str]:
    """What the table says, in sentences read off the records."""
    ok = [r for r in recs if "error" not in r and "error" not in r.get("joint", {"error": 1})]
    out = []
    flat = [r for r in ok if r.get("flat") and "error" not in r["flat"] and "seconds" in r]
    same = [r for r in flat if math.isclose(r["flat"]["objective_ms"], r["objective_ms"], rel_tol=1e-6)]
    if flat:
        out.append(f"The clustered ILP and the flat ILP prove the same optimum in {len(same)} of "
                   f"{len(flat)} cells where the flat one finishes; the clustered one takes "
                   f"{min(r['seconds'] for r in flat):.1f}-{max(r['seconds'] for r in flat):.1f} s.")
    joint = [r["joint"] for r in ok]
    if joint:
        est = [j for j in joint if j.get("estimated")]
        stopped = [j for j in est if j.get("stopped")]
        out.append(f"The whole `autopar.plan` takes {min(j['seconds'] for j in joint):.1f}-"
                   f"{max(j['seconds'] for j in joint):.1f} s ({min(j['capture'] for j in joint):.1f}-"
                   f"{max(j['capture'] for j in joint):.1f} s of it capture). Where the plain plan "
                   f"fits ({len(joint) - len(est)} of {len(joint)} cells) no pipeline split is "
                   f"explored; in the other {len(est)} the splits are estimated from a 4-layer copy "
                   "and the chosen one planned at full depth"
                   + (f" ({len(stopped)} of them stopped exploring at its budget, 22.5 s of the "
                      "30 s limit)" if stopped else "") + ".")
    return out


def section(recs: list[dict], time_limit: float, load: tuple[float, float] | None = None,
            command: str = "") -> str:
    """The markdown section for ``docs/benchmarks.md`` (``command``: its last line,
    ``plan_time.regenerate``'s)."""
    return "\n".join([
        SECTION, "",
        "`transformers.LlamaForCausalLM` with the Llama-3 8B (32 layers) and 70B (80 layers) "
        "configs (GQA 8 key/value heads, vocab 128,256) and `MixtralForCausalLM` with the "
        "Mixtral-8x7B config (8 experts, top-2, 32 layers), built on the meta device, with one "
        f"{SEQ}-token sequence per device (batch = devices), `precision=\"{PRECISION}\"`, "
        f"`batch=\"{BATCH}\"` (each rank gets its own rows of the logits, as with DDP); preset "
        "`multinode-h100-ib` (80 GiB per device less the preset's reserve as the memory budget), meshes (8,), (8, 8), "
        "(32, 8), (128, 8). Each cell runs in its own process: it captures the model once, "
        "times the intra-op ILP on that graph (`make_plan`: enumerate, price, clustered solve, "
        "assemble) and the flat ILP (no clustering or shared pricing) on the same problem "
        f"(limit {time_limit:g} s), then the whole `autopar.plan` a user calls: its own "
        "capture, the joint search over pipeline stages, micro-batches, ZeRO and recomputation "
        "under the memory budget (30 s limit, 75% for exploring and the rest for the full-depth "
        "plan, capture not counted), and the plan. That last "
        "capture runs in a process that has captured once already; a fresh process pays "
        "about 6 s more the first time (torch.export's and transformers' one-time set-up).",
        "", f"Measured {_dt.date.today().isoformat()} on: {machine()}"
        + (f"; load average {load[0]:.2f} before, {load[1]:.2f} after." if load else "."), "",
        HEADER, RULE, *(row(r) for r in recs), "", *(f"- {f}" for f in findings(recs)), "",
        command or regenerate("search_scaling_hf.py", []), ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--devices", type=int, nargs="+", default=list(MESHES))
    ap.add_argument("--cell-limit", type=float, default=120.0)
    ap.add_argument("--no-flat", action="store_true", help="skip the flat-ILP comparison")
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    ap.add_argument("--_cell", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._cell:
        name, n, limit, flat, out = args._cell
        rec = measure(name, int(n), float(limit), flat == "1")
        Path(out).write_text(json.dumps(rec))
        sys.stdout.flush()
        os._exit(0)
    recs = []
    load0 = os.getloadavg()[0]
    for name in args.models:
        for n in [d for d in args.devices if d in DEVICES.get(name, args.devices)]:
            print(f"{name} on {n} devices ...", file=sys.stderr, flush=True)
            r = run_cell(name, n, args.cell_limit, not args.no_flat, 120 + 3 * args.cell_limit)
            recs.append(r)
            print(row(r), file=sys.stderr, flush=True)
    print("\n".join([HEADER, RULE, *(row(r) for r in recs)]))
    if args.write:
        write_section(section(recs, args.cell_limit, (load0, os.getloadavg()[0]),
                              regenerate("search_scaling_hf.py", argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
