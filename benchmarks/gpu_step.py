"""One GPU, a ~1B Hugging Face Llama: autopar's module against the plain model, eager and
compiled, with the plan's predicted step and peak memory beside the measured ones.

Rows (each an AdamW step, ``fused=True`` on CUDA; bf16 autocast for the plain model,
``precision="bf16-mixed"`` for autopar):

- ``plain``: the model under ``torch.autocast``;
- ``plain-compiled``: ``torch.compile`` of it;
- ``autopar``: ``auto_parallel(model, example_kwargs=batch, precision="bf16-mixed")`` as
  returned, the mesh named by ``--mesh`` (default: none, a user's default): compiled on
  a GPU, eager on a CPU (``compile=``'s default);
- ``autopar-eager`` on a GPU (``autopar-compiled`` on a CPU): the same with the other
  ``compile=``;
- ``autopar-user-compiled`` (``--user-compile``): ``torch.compile`` of the ``autopar``
  module, as a user might write it;
- ``autopar-unfolded`` (``--unfolded``): autopar with the attention mask kept as the
  tensor export builds (:mod:`autopar.capture.causal_mask` switched off), the module as
  it was before that pass.

Steps are timed interleaved (one step of each row per round, CUDA-synchronised wall
time), medians after warm-up.  ``recompiles`` counts the graphs dynamo made during the
timed steps (a fixed shape should make none).  Peak memory is ``torch.cuda.max_memory_allocated`` over a
row's warm-up, counting the row's own parameters, gradients and optimizer state and not
the other rows' (autopar's is measured before anything else is on the device).  Prints a
table and one ``RESULT {json}`` line.  Run where a GPU is lent:
``torchrun --nproc-per-node 1 benchmarks/gpu_step.py`` (under 5 minutes on one H100/H200).
``--device cpu --layers 2 --hidden 256 --seq 128 --batch 2`` checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _llama(args: argparse.Namespace):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256),
                         max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    return model, {"input_ids": ids, "labels": ids}


def _dynamo_graphs() -> int:
    """Graphs ``torch.compile`` has made in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _resident(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of a model's parameters and its optimizer's state (local shards)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    seen = {id(p): local(p) for p in model.parameters()}
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                seen[id(v)] = local(v)
    return sum(t.numel() * t.element_size() for t in seen.values())


class Row:
    """One way of running the step: a callable, its optimizer and its measurements."""

    def __init__(self, name: str, model, call, opt, dev: torch.device) -> None:
        self.name, self.model, self.call, self.opt, self.dev = name, model, call, opt, dev
        self.times: list[float] = []
        self.peak = float("nan")
        self.loss = float("nan")

    def step(self) -> None:
        """One optimizer step."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.call()
        loss.backward()
        self.opt.step()
        self.loss = float(loss.detach())

    def warm(self, steps: int, owned: torch.nn.Module | None) -> None:
        """Warm-up steps, measuring the peak of memory this row owns."""
        if self.dev.type != "cuda":
            for _ in range(steps):
                self.step()
            return
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        mine = _resident(owned, self.opt) if owned is not None else 0
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            self.step()
        self.opt.zero_grad(set_to_none=True)  # the others' peaks exclude our gradients
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - before + mine

    def timed(self) -> None:
        """One synchronised, timed step."""
        sync = torch.cuda.synchronize if self.dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self.step()
        sync()
        self.times.append(time.perf_counter() - t0)


def _profile(row: Row, out: Path | None, top: int = 12) -> None:
    """The top kernels of one step of ``row`` by device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if row.dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        row.step()
        if row.dev.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if row.dev.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    print(f"--- profile: {row.name}\n{table}", flush=True)
    if out is not None:
        (out / f"profile_{row.name}.txt").write_text(table)


def main(argv: list[str] | None = None) -> None:
    """Build the rows, warm them, time them interleaved, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mesh", default=None, help="autopar's mesh= (default: none named)")
    ap.add_argument("--predict-preset", default="",
                    help="also plan (only) on this preset, shape (world,), for its prediction")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--unfolded", action="store_true")
    ap.add_argument("--user-compile", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)

    import torch.distributed as dist
    from autopar.cost_models import PRESET_NAMES

    import autopar
    import autopar.capture.trace as trace

    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    out = Path(args.out) if args.out else None
    cpu_model, batch = _llama(args)
    params = sum(p.numel() for p in cpu_model.parameters())
    fused = {"fused": True} if dev.type == "cuda" else {}
    dbatch = {k: v.to(dev) for k, v in batch.items()}
    rows: list[Row] = []

    def planned(name: str, fold: bool = True, compiled: bool | None = None) -> Row:
        saved = trace.fold_causal_masks
        if not fold:
            trace.fold_causal_masks = lambda gm: 0
        try:
            t0 = time.perf_counter()
            mesh = (autopar.MeshSpec.preset(args.mesh, shape=(dist.get_world_size(),))
                    if args.mesh in PRESET_NAMES else args.mesh)
            pm = autopar.auto_parallel(copy.deepcopy(cpu_model), example_kwargs=batch,
                                       mesh=mesh, precision="bf16-mixed", compile=compiled)
            plan_s = time.perf_counter() - t0
        finally:
            trace.fold_causal_masks = saved
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, **fused)
        row = Row(name, pm, lambda: pm(**dbatch).loss, opt, dev)
        row.plan_s = plan_s
        t0 = time.perf_counter()
        row.warm(args.warmup, pm)  # before the other rows are on the device
        if pm.compiled:
            row.compile_s = time.perf_counter() - t0
        print(f"{name}: planned in {plan_s:.1f} s, warm-up {time.perf_counter() - t0:.1f} s, "
              f"peak {row.peak / 2**30:.2f} GiB", flush=True)
        return row

    ap_row = planned("autopar")  # the user's default
    rows.append(ap_row)
    if not args.no_compile:
        other = not ap_row.model.compiled
        rows.append(planned("autopar-compiled" if other else "autopar-eager", compiled=other))
    if args.unfolded:
        rows.append(planned("autopar-unfolded", fold=False, compiled=False))
    plain = copy.deepcopy(cpu_model).to(dev)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4, **fused)

    def eager_call(m):
        def call():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                return m(**dbatch).loss
        return call

    pl = Row("plain", plain, eager_call(plain), popt, dev)
    pl.warm(args.warmup, plain)
    rows.append(pl)
    if not args.no_compile:
        cplain = torch.compile(plain)
        later = [Row("plain-compiled", plain, eager_call(cplain), popt, dev)]
        if args.user_compile:
            cpm = torch.compile(ap_row.model)
            later.append(Row("autopar-user-compiled", ap_row.model,
                             lambda: cpm(**dbatch).loss, ap_row.opt, dev))
        rows += later
        for r in later:
            t0 = time.perf_counter()
            try:
                r.warm(args.warmup, r.model)  # shares its eager row's parameters and state
            except Exception as e:  # noqa: BLE001 - a row that cannot compile is reported
                print(f"{r.name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                rows.remove(r)
            r.compile_s = time.perf_counter() - t0
            print(f"{r.name}: warm-up with compilation {r.compile_s:.1f} s", flush=True)
    graphs = _dynamo_graphs()
    for _ in range(args.steps):
        for r in rows:
            r.timed()
    recompiles = _dynamo_graphs() - graphs
    if args.profile:
        for r in rows:
            if r.name in ("plain", "autopar"):
                _profile(r, out)

    plan = ap_row.model.plan
    pred_s = plan.decisions.step_seconds
    pred_mem = plan.memory["total"]
    base = statistics.median(pl.times)
    print(f"Llama {params / 1e9:.2f}B, {args.layers} layers, hidden {args.hidden}, "
          f"{args.batch} x {args.seq} tokens, {dev}, torch {torch.__version__}")
    print(f"{'row':18} {'median ms':>10} {'/ plain':>8} {'peak GiB':>9} {'loss':>8}")
    result = {"params": params, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": {}}
    for r in rows:
        med = statistics.median(r.times)
        print(f"{r.name:18} {med * 1e3:10.1f} {med / base:8.3f} {r.peak / 2**30:9.2f} {r.loss:8.4f}")
        result["rows"][r.name] = {"median_ms": med * 1e3, "times_ms": [t * 1e3 for t in r.times],
                                  "peak_gib": r.peak / 2**30, "loss": r.loss,
                                  "plan_s": getattr(r, "plan_s", None),
                                  "compile_warmup_s": getattr(r, "compile_s", None)}
    am = statistics.median(ap_row.times)
    print(f"recompiles during the timed steps: {recompiles}")
    print(f"autopar predicted step {pred_s * 1e3:.1f} ms (measured {am * 1e3:.1f}, "
          f"ratio {pred_s / am:.3f}); predicted peak {pred_mem / 2**30:.2f} GiB "
          f"(measured {ap_row.peak / 2**30:.2f}); plan memory {plan.memory}")
    result.update(recompiles=recompiles, autopar_compiled=ap_row.model.compiled,
                  predicted_ms=pred_s * 1e3, predicted_peak_gib=pred_mem / 2**30,
                  plan_memory=plan.memory, layout=plan.summary().splitlines()[0])
    if args.predict_preset:
        mesh = autopar.MeshSpec.preset(args.predict_preset, shape=(dist.get_world_size(),))
        other = autopar.plan(copy.deepcopy(cpu_model), (), mesh, example_kwargs=batch,
                             precision="bf16-mixed")
        po, mo = other.decisions.step_seconds, other.memory["total"]
        print(f"on preset {args.predict_preset}: predicted step {po * 1e3:.1f} ms (ratio "
              f"{po / am:.3f}), peak {mo / 2**30:.2f} GiB (ratio {mo / ap_row.peak:.3f}); "
              f"{other.summary().splitlines()[0]}")
        result["preset"] = {"name": args.predict_preset, "predicted_ms": po * 1e3,
                            "predicted_peak_gib": mo / 2**30, "memory": other.memory}
    print("RESULT " + json.dumps(result), flush=True)
    if out is not None:
        (out / "gpu_step.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
