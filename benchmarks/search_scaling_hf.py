"""Search time, proven gap and layer classes of the intra-op ILP on Hugging Face Llama shapes.

``LlamaForCausalLM`` itself (GQA, rotary tables and mask shared by every layer) built from
the Llama-3 8B and 70B configs on the meta device, captured once per mesh with one
2,048-token sequence per device, planned by :func:`autopar.search.make_plan` (ILP) with
the device's memory as the budget on meshes of 8, 64, 256 and 1,024 devices, beside the
flat ILP (no clustering, no shared pricing) on the same captured graph where it finishes
within the cell limit::

    python benchmarks/search_scaling.py --hf            # runs this file, updates the docs
    python benchmarks/search_scaling_hf.py --models 8B --devices 8 64 --no-write

Each (model, mesh) cell runs in its own subprocess with a wall-clock limit. Intra-op only:
the joint search (pipeline stages, micro-batches, ZeRO) is not in these numbers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import machine, write_section  # noqa: E402  (same folder, shared helpers)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Search scaling on Hugging Face Llama (benchmarks/search_scaling_hf.py)"
# Llama-3 configs (Meta's model cards): layers, hidden, heads, kv heads, ffn, vocab
LLAMAS = {"8B": (32, 4096, 32, 8, 14336, 128256), "70B": (80, 8192, 64, 8, 28672, 128256)}
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
    from autopar.annotate import annotate
    from autopar.capture import capture
    from autopar.search import PlanOptions, _solve, build_problem, cost_model, make_plan
    from autopar.strategies import enumerate_strategies

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
        p = make_plan(cap.gm, mesh, cap.aliases, opts)
        s = p.solver
        rec.update(seconds=time.perf_counter() - t0, objective_ms=p.objective * 1e3,
                   status=s.status, gap=s.gap, backend=s.backend, message=s.message,
                   memory_gib=p.memory.get("total", 0.0) / 2**30)
        if flat:
            t0 = time.perf_counter()
            st = enumerate_strategies(cap.gm, shape)
            pb = build_problem(cap.gm, mesh, st, cost_model(cap.gm, mesh, opts), mesh.mem_capacity)
            try:
                sol = _solve(pb.problem, time_limit)
                rec["flat"] = {"seconds": time.perf_counter() - t0, "status": str(sol.status),
                               "objective_ms": sol.objective * 1e3, "gap": sol.gap}
            except Exception as e:  # noqa: BLE001 - a failure is a table entry
                rec["flat"] = {"seconds": time.perf_counter() - t0,
                               "error": f"{type(e).__name__}: {str(e)[:120]}"}
    return rec


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


def row(r: dict) -> str:
    """One markdown row."""
    shape = "x".join(map(str, MESHES[r["devices"]][1]))
    if "error" in r:
        return f"| {r['model']} | - | {r['devices']} ({shape}) | - | {r['error']} | - | - |"
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
            f"{r['memory_gib']:.1f} GiB | {_classes(r['message'])} | {flat} |")


HEADER = ("| model | params | devices (mesh) | capture + annotate s | clustered ILP: time, "
          "predicted step, status, proven gap, memory/device | layer classes | flat ILP |")
RULE = "|---|---:|---|---:|---|---|---|"


def section(recs: list[dict], time_limit: float) -> str:
    """The markdown section for ``docs/benchmarks.md``."""
    return "\n".join([
        SECTION, "",
        "`transformers.LlamaForCausalLM` with the Llama-3 8B (32 layers) and 70B (80 layers) "
        "configs (GQA 8 key/value heads, vocab 128,256), built on the meta device and captured "
        f"with one {SEQ}-token sequence per device (batch = devices) in `precision=\"{PRECISION}\"` "
        f"with `batch=\"{BATCH}\"` (each rank gets its own rows of the logits, as with DDP); preset "
        "`multinode-h100-ib` (80 GiB per device as the memory budget), meshes (8,), (8, 8), "
        "(32, 8), (128, 8). A cell is `make_plan` (ILP: enumerate, price, clustered solve, "
        "assemble) wall seconds; the flat ILP prices and solves the same problem without "
        f"clustering or shared pricing. Cell limit {time_limit:g} s. Intra-op placement "
        "only: the joint search (pipeline, micro-batches, ZeRO) is not timed here.", "",
        f"Measured {_dt.date.today().isoformat()} on: {machine()}.", "",
        HEADER, RULE, *(row(r) for r in recs), "",
        "In bf16-mixed with each rank's own rows of the logits returned, the 8B fits well "
        "inside 80 GiB on every mesh, so the clustered and the flat ILP both prove their "
        "optimum (the same plan); the predicted step grows only from 417 to 459 ms between 64 "
        "and 1,024 devices. In the previous run of this benchmark (fp32 as captured, logits "
        "returned to every rank) the budget bound, the clustered Lagrangian gap was 6% at 256 and "
        "23% at 1,024 devices, the flat ILP stopped with no bound, and the predicted steps "
        "were 851 ms, 3.1 s and 43 s, all but the first the logits' gather. The 70B does not "
        "fit by placement alone: parameters, gradients and AdamW state stay fp32 (16 B per "
        "parameter) and this benchmark runs no ZeRO, pipeline or recomputation; the ILP "
        "proves the least memory any placement needs.", "",
        "Regenerate with `python benchmarks/search_scaling.py --hf`.", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(LLAMAS), choices=list(LLAMAS))
    ap.add_argument("--devices", type=int, nargs="+", default=list(MESHES))
    ap.add_argument("--cell-limit", type=float, default=120.0)
    ap.add_argument("--no-flat", action="store_true", help="skip the flat-ILP comparison")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--_cell", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._cell:
        name, n, limit, flat, out = args._cell
        rec = measure(name, int(n), float(limit), flat == "1")
        Path(out).write_text(json.dumps(rec))
        sys.stdout.flush()
        import os
        os._exit(0)
    recs = []
    for name in args.models:
        for n in args.devices:
            print(f"Llama {name} on {n} devices ...", file=sys.stderr, flush=True)
            r = run_cell(name, n, args.cell_limit, not args.no_flat, 120 + 3 * args.cell_limit)
            recs.append(r)
            print(row(r), file=sys.stderr, flush=True)
    print("\n".join([HEADER, RULE, *(row(r) for r in recs)]))
    if not args.no_write:
        write_section(section(recs, args.cell_limit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
