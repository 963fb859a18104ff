"""Our plans against Megatron-LM's published ones, both priced by our cost model.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, arXiv:2104.04473), Table 1, trained GPT models with hand-chosen
tensor-, pipeline- and data-parallel sizes on A100 80GB DGX nodes (8 GPUs on NVLink per
node, InfiniBand between nodes; vocabulary 51,200, sequence 2,048).  For five of those
runs this builds the model shape of ``examples/gpt.py`` on the meta device (no weights)
and plans it twice on the preset ``multinode-a100-ib``:

* **Megatron**: the published (TP, PP, DP) forced.  The mesh is factorised so that one
  axis of size TP lies inside a node (its last axis); the block weights get Megatron's
  column/row pins on that axis (q, k, v and fc1 column-sharded, out_proj and fc2
  row-sharded), the token embedding and the output head are vocab-sharded on it
  (Megatron's vocab-parallel embedding and head), everything else is replicated, the
  batch (``input:0``, ``input:1``) is sharded on the other (data-parallel) axes, and
  ``pipeline_stages=PP`` (stages carved out of the inter-node axis).  Fixed as Megatron
  ran it: no ZeRO (``zero_stage=0``) and the 1F1B schedule when PP > 1.  Left to our
  search: the number of micro-batches (each count dividing the batch whose micro-batch
  still splits over the DP ranks is planned and the fastest kept), the stage boundaries, the
  placements of activations, and which layers to recompute (Megatron recomputed every
  layer; ours recomputes only what the budget (80 GiB less the reserve) needs, which can only make the
  Megatron plan faster under our model).
* **Ours**: the joint search with nothing forced (``explore=True``: every pipeline
  depth and micro-batch count, ZeRO stage and axis, schedule, recomputation), on
  several factorisations of the same GPU count, always including Megatron's own; the
  fastest plan wins, so ours can never be predicted slower than Megatron's unless the
  search misses a plan it could have found.  The script exits with status 1 when that
  happens.

Two blocks are captured and the joint search extrapolates to the full depth
(``blocks=``).  Every planning call runs as one job in a pool of worker processes;
the table lists each model's total planning seconds.  It prints the table; ``--write``
also rewrites the table of the section "## Reference plans
(benchmarks/reference_plans.py)" of ``docs/benchmarks.md``::

    python benchmarks/reference_plans.py --models 1.7B   # prints the table
    python benchmarks/reference_plans.py --write         # all five models, updates the docs
    python benchmarks/reference_plans.py --all-meshes    # (nodes, 2, 4), (nodes, 4, 2) everywhere
    python benchmarks/reference_plans.py --suites alpa mist   # benchmarks/published_suites.py

Alpa's (OSDI'22) and Mist's (EuroSys'25) published GPT plans are planned the same way
by :mod:`published_suites` (its own docs section, also written only with ``--write``);
``--suites`` picks the suites.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import machine, regenerate, write_section  # noqa: E402  (same folder, shared helpers)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Reference plans (benchmarks/reference_plans.py)"
PRESET = "multinode-a100-ib"
# the published runs trained in mixed precision: bf16 matmuls and activations where
# autocast has them, fp32 master weights, gradients and AdamW state
PRECISION = "bf16-mixed"
GPUS_PER_NODE = 8
VOCAB, SEQ = 51200, 2048
GIB = 2.0**30
SOURCE = ("D. Narayanan et al., \"Efficient Large-Scale Language Model Training on GPU "
          "Clusters Using Megatron-LM\", SC'21, arXiv:2104.04473, Table 1")

# Megatron's tensor-parallel layout for examples/gpt.py (tests/dist/test_equivalence.py
# MEGATRON["gpt"]), plus its vocab-parallel embedding and output head.
MEGATRON_TP: dict[str, str] = {
    "*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
    "*q_proj.bias": "S(0)", "*k_proj.bias": "S(0)", "*v_proj.bias": "S(0)",
    "*out_proj.weight": "S(1)", "*out_proj.bias": "R",
    "*fc1.weight": "S(0)", "*fc1.bias": "S(0)", "*fc2.weight": "S(1)", "*fc2.bias": "R",
    "tok.weight": "S(0)", "head.weight": "S(0)",
}


@dataclass(frozen=True)
class Reference:
    """One published Megatron-LM run: the model shape and its (TP, PP) on ``gpus`` GPUs."""

    name: str
    heads: int
    dim: int
    layers: int
    gpus: int
    tp: int
    pp: int
    batch: int

    def __post_init__(self) -> None:
        if self.gpus % (self.tp * self.pp) or self.gpus % GPUS_PER_NODE:
            raise ValueError(f"{self.name}: {self.gpus} GPUs do not split into TP {self.tp} x "
                             f"PP {self.pp} x DP on {GPUS_PER_NODE}-GPU nodes")
        if GPUS_PER_NODE % self.tp:
            raise ValueError(f"{self.name}: TP {self.tp} must fit inside a node")

    @property
    def dp(self) -> int:
        """Data-parallel size: GPUs / (TP x PP)."""
        return self.gpus // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        """Number of 8-GPU nodes."""
        return self.gpus // GPUS_PER_NODE

    def megatron_shape(self) -> tuple[int, ...]:
        """Mesh with TP on the last axis inside a node, the rest data parallel."""
        if self.tp in (1, GPUS_PER_NODE):
            return (self.nodes, GPUS_PER_NODE)
        return (self.nodes, GPUS_PER_NODE // self.tp, self.tp)

    def shapes(self, all_meshes: bool) -> list[tuple[int, ...]]:
        """Factorisations our search runs on: (nodes, 8) and Megatron's own, or with
        ``all_meshes`` also (nodes, 2, 4) and (nodes, 4, 2)."""
        out = [(self.nodes, GPUS_PER_NODE), self.megatron_shape()]
        if all_meshes:
            out += [(self.nodes, 2, 4), (self.nodes, 4, 2)]
        return list(dict.fromkeys(out))

    def megatron_micro_batches(self) -> list[int]:
        """The joint search's own micro-batch counts (every count dividing the batch, at
        least one per stage) whose micro-batch splits over the DP ranks."""
        from autopar.plans.splits import micro_counts

        return [m for m in micro_counts(self.batch, self.pp) if (self.batch // m) % self.dp == 0]


REFERENCES: tuple[Reference, ...] = (
    Reference("1.7B", heads=24, dim=2304, layers=24, gpus=32, tp=1, pp=1, batch=512),
    Reference("7.5B", heads=32, dim=4096, layers=36, gpus=128, tp=4, pp=1, batch=512),
    Reference("18.4B", heads=48, dim=6144, layers=40, gpus=256, tp=8, pp=1, batch=1024),
    Reference("39.1B", heads=64, dim=8192, layers=48, gpus=512, tp=8, pp=2, batch=1536),
    Reference("145.6B", heads=96, dim=12288, layers=80, gpus=1536, tp=8, pp=8, batch=2304),
)
BY_NAME = {r.name: r for r in REFERENCES}


def megatron_pins(ref: Reference, ndim: int) -> dict[str, str]:
    """Pins forcing Megatron's layout on a stage sub-mesh of ``ndim`` axes
    (:func:`tp_pins` with ``ref``'s TP size)."""
    return tp_pins(ref.tp, ndim)


def tp_pins(tp: int, ndim: int) -> dict[str, str]:
    """Pins forcing Megatron's layout on a stage sub-mesh of ``ndim`` axes: TP on the
    last axis (when ``tp`` > 1), every other parameter replicated, the batch sharded on
    the data-parallel axes.  Pattern pins apply in order, so ``"*"`` comes first."""
    pins = {"*": "R" * ndim}
    if tp > 1:
        pins.update({k: "R" * (ndim - 1) + v for k, v in MEGATRON_TP.items()})
        batch = "S(0)" * (ndim - 1) + "R"
    else:
        batch = "S(0)" * ndim
    pins["input:0"] = pins["input:1"] = batch
    return pins


# ---------------------------------------------------------------- one planning job
@dataclass
class Outcome:
    """One planned configuration, summarised."""

    model: str
    kind: str  # "megatron" or "ours"
    shape: tuple[int, ...]
    step_seconds: float = math.inf
    memory_gib: float = math.nan
    stages: int = 1
    micro_batches: int = 1
    schedule: str = "none"
    zero_stage: int = 0
    zero_axis: int | None = None
    recompute: int = 0
    layers: int = 0
    tp: int = 1
    dp: int = 1
    other: str = ""
    stopped: bool = False
    seconds: float = 0.0
    error: str = ""
    roles: list[str] = field(default_factory=list)


def build_model(ref: Reference, batch: int, blocks: int = 2):
    """``examples/gpt.py`` with ``ref``'s width on the meta device, and meta inputs."""
    import torch

    sys.path.insert(0, str(ROOT))
    from examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=VOCAB, seq=SEQ, dim=ref.dim, heads=ref.heads, layers=blocks))
    tokens = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    return model, (tokens, tokens.clone())


def parameter_count(ref: Reference) -> int:
    """Parameters of the full-depth model (built on the meta device)."""
    model, _ = build_model(ref, 1, blocks=ref.layers)
    return sum(p.numel() for p in model.parameters())


def axis_roles(plan) -> tuple[list[str], int, int, str]:
    """What each stage sub-mesh axis does, read from the placements: ``tp`` when most
    block-weight bytes are sharded on it and the activations entering the first block
    are not, ``dp`` when those activations are sharded on the batch dim and the weights
    are not, ``dp+w`` (both: weights sharded as in FSDP), ``sp`` (activations sharded on
    the sequence dim) or ``rep`` (neither).  Returns (roles, TP size, DP size, the other
    axes as text)."""
    from autopar.plans.placement import is_shard, parse_placements

    shape = tuple(plan.mesh.shape)
    first = next(n for n in plan.nodes.values()
                 if n.kind == "op" and n.layer.startswith("blocks.") and n.in_placements)
    act = parse_placements(first.in_placements[0])
    total = 0.0
    sharded = [0.0] * len(shape)
    for n in plan.nodes.values():
        if n.kind != "param" or not (n.param or "").startswith("blocks.") or len(n.shape[0]) < 2:
            continue
        size = float(math.prod(n.shape[0]))
        total += size
        for a, pl in enumerate(parse_placements(n.out_placements[0])):
            if is_shard(pl):
                sharded[a] += size
    roles, tp, dp, other = [], 1, 1, []
    for a, size in enumerate(shape):
        w = total > 0 and sharded[a] / total > 0.5
        dim = act[a].dim if is_shard(act[a]) else None
        if w:
            role = "dp+w" if dim == 0 else "tp"
        else:
            role = {0: "dp", 1: "sp"}.get(dim, "rep") if dim is not None else "rep"
        roles.append(role)
        if size == 1:
            continue
        if role == "tp":
            tp *= size
        elif role == "dp":
            dp *= size
        else:
            other.append(f"{role}{size}")
    return roles, tp, dp, " ".join(other)


def run_job(ref_name: str, kind: str, shape: tuple[int, ...], micro: int | None,
            time_limit: float) -> Outcome:
    """Plan one configuration (in a worker process) and summarise it."""

    import torch

    from autopar import MeshSpec

    torch.set_num_threads(1)
    ref = BY_NAME[ref_name]
    out = Outcome(ref.name, kind, tuple(shape), layers=ref.layers + 2)
    mesh = MeshSpec.preset(PRESET, shape=tuple(shape))
    model, ex = build_model(ref, ref.batch)
    if kind == "megatron":
        sub_ndim = len(shape) - (1 if ref.pp == shape[0] else 0)
        # Megatron carves its stages across nodes: the outermost axis
        kw = dict(pins=megatron_pins(ref, sub_ndim), pipeline_stages=ref.pp, micro_batches=micro,
                  zero_stage=0, schedule="1f1b" if ref.pp > 1 else None,
                  pipeline_axis=0 if ref.pp > 1 else None)
    else:
        kw = dict(explore=True)
    return plan_outcome(out, model, ex, mesh, ref.layers, time_limit, kw)


def plan_outcome(out: Outcome, model, ex: tuple, mesh, layers: int, time_limit: float,
                 kw: dict) -> Outcome:
    """Plan ``model`` (``layers`` deep, two captured) on ``mesh`` with options ``kw`` in
    bf16-mixed and fill ``out`` with the plan's summary, or with the error it raised."""
    import warnings

    from autopar.api import plan

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = plan(model, ex, mesh, search="ilp", blocks=layers, time_limit=time_limit,
                     precision=PRECISION, **kw)
    except Exception as e:  # reported in the table: a crash is a finding, not a skip
        out.error = f"{type(e).__name__}: {e}"[:300]
        out.seconds = time.perf_counter() - t0
        return out
    out.seconds = time.perf_counter() - t0
    d = p.decisions
    out.step_seconds = d.step_seconds
    out.memory_gib = max(d.stage_memory) / GIB
    out.stages, out.micro_batches, out.schedule = d.pipeline_stages, d.micro_batches, d.schedule
    out.zero_stage, out.zero_axis, out.recompute = d.zero_stage, d.zero_axis, len(d.recompute)
    out.roles, out.tp, out.dp, out.other = axis_roles(p)
    out.stopped = any("time limit" in w for w in p.warnings)
    return out


# ---------------------------------------------------------------- the whole benchmark
def jobs_for(ref: Reference, all_meshes: bool) -> list[tuple[str, str, tuple[int, ...], int | None]]:
    """(model, kind, mesh shape, micro-batches) of every planning call for ``ref``."""
    jobs: list[tuple[str, str, tuple[int, ...], int | None]] = [
        (ref.name, "megatron", ref.megatron_shape(), m) for m in ref.megatron_micro_batches()]
    jobs += [(ref.name, "ours", s, None) for s in ref.shapes(all_meshes)]
    return jobs


def longest_first(job: tuple) -> tuple:
    """Sort key of a ``(model, kind, mesh shape, ...)`` job of either suite: free
    searches before pinned ones, 3-axis meshes, then the most devices: the order their
    planning times fall in, so a pool of workers ends together."""
    _, kind, shape, *_ = job
    return (kind != "ours", -len(shape), -math.prod(shape))


def run_jobs(fn, jobs: list[tuple], workers: int, time_limit: float, done) -> list[Outcome]:
    """``fn(*job, time_limit)`` for every job: :func:`run_tasks` of one function."""
    return run_tasks([(fn, j) for j in jobs], workers, time_limit, done)


def run_tasks(tasks: list[tuple], workers: int, time_limit: float, done) -> list[Outcome]:
    """``fn(*job, time_limit)`` for every ``(fn, job)`` task, ``workers`` at a time in
    spawned worker processes (in this one when ``workers <= 1``), in the tasks' order;
    ``done(outcome)`` as each finishes.  The outcomes come back in the tasks' order."""
    if workers <= 1:
        results = []
        for fn, j in tasks:
            results.append(fn(*j, time_limit))
            done(results[-1])
        return results
    import multiprocessing as mp

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futs = {pool.submit(fn, *j, time_limit): i for i, (fn, j) in enumerate(tasks)}
        out: list[Outcome | None] = [None] * len(tasks)
        for f in as_completed(futs):
            out[futs[f]] = f.result()
            done(out[futs[f]])
    return out  # type: ignore[return-value]


def _progress(o: Outcome) -> str:
    # a published suite's plan (published_suites.py) is pinned too: its count is its own
    what = "free" if o.kind == "ours" else f"M={o.micro_batches}"
    res = o.error or f"{o.step_seconds:.3f} s/step, {o.memory_gib:.1f} GiB"
    return f"  {o.model:>6} {o.kind:>8} {_shape(o.shape):>8} {what:>6}: {res} ({o.seconds:.1f} s)"


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def best(outcomes: list[Outcome]) -> Outcome | None:
    """The fastest outcome that planned (ties: the first)."""
    ok = [o for o in outcomes if not o.error and math.isfinite(o.step_seconds)]
    return min(ok, key=lambda o: o.step_seconds) if ok else None


def summarise(refs: list[Reference], results: list[Outcome]) -> list[dict]:
    """One row per model: Megatron's best micro-batch count against our best mesh."""
    rows = []
    for ref in refs:
        mine = [o for o in results if o.model == ref.name]
        meg_all = [o for o in mine if o.kind == "megatron"]
        ours_all = sorted((o for o in mine if o.kind == "ours"), key=lambda o: o.shape)
        meg, ours = best(meg_all), best(ours_all)
        same = next((o for o in ours_all if o.shape == ref.megatron_shape()), None)
        row = {
            "ref": asdict(ref), "params": parameter_count(ref),
            "megatron": asdict(meg) if meg else None, "ours": asdict(ours) if ours else None,
            "ours_by_mesh": [asdict(o) for o in ours_all],
            "megatron_by_micro": [asdict(o) for o in meg_all],
            "errors": [f"{o.kind} {_shape(o.shape)}: {o.error}" for o in mine if o.error],
            "seconds": {"megatron": sum(o.seconds for o in meg_all),
                        "ours": sum(o.seconds for o in ours_all)},
        }
        row["speedup"] = (meg.step_seconds / ours.step_seconds) if meg and ours else None
        row["worse"] = bool(meg and ours and ours.step_seconds > meg.step_seconds * (1 + 1e-9))
        row["worse_on_megatron_mesh"] = bool(
            meg and same and not same.error and same.step_seconds > meg.step_seconds * (1 + 1e-9))
        rows.append(row)
    return rows


# ---------------------------------------------------------------- reporting
def describe_ours(o: dict) -> str:
    """``TP t x PP p x DP d`` (plus any axis that is neither) for one of our plans."""
    s = f"TP{o['tp']} x PP{o['stages']} x DP{o['dp']}"
    return s + (f" ({o['other']})" if o["other"] else "")


def _recompute(o: dict) -> str:
    return f"{o['recompute']}/{o['layers']}"


def _zero(o: dict) -> str:
    return f"ZeRO-{o['zero_stage']} (axis {o['zero_axis']})" if o["zero_stage"] else "-"


def _micro(o: dict) -> str:
    return str(o["micro_batches"]) + (f", {o['schedule']}" if o["stages"] > 1 else "")


HEADER = ("| model | params | GPUs | batch | Megatron TP/PP/DP | Megatron micro-batches | "
          "Megatron recompute | Megatron step s | Megatron GiB | our mesh | our plan | our ZeRO | "
          "our micro-batches | our recompute | our step s | our GiB | speed-up | planning s |")
RULE = "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"


def markdown_row(row: dict) -> str:
    """One markdown table row for a model."""
    r, m, o = row["ref"], row["megatron"], row["ours"]
    head = (f"| {r['name']} | {row['params'] / 1e9:.2f}B | {r['gpus']} | {r['batch']} | "
            f"TP{r['tp']} / PP{r['pp']} / DP{r['gpus'] // (r['tp'] * r['pp'])} | ")
    if m is None or o is None:
        return head + "failed: " + "; ".join(row["errors"])[:200] + " |" * 14
    secs = row["seconds"]["megatron"] + row["seconds"]["ours"]
    return head + (
        f"{_micro(m)} | {_recompute(m)} | {m['step_seconds']:.3f} | {m['memory_gib']:.1f} | "
        f"{_shape(o['shape'])} | {describe_ours(o)} | {_zero(o)} | {_micro(o)} | "
        f"{_recompute(o)} | {o['step_seconds']:.3f} | {o['memory_gib']:.1f} | "
        f"{row['speedup']:.3f}x{' **worse**' if row['worse'] else ''} | {secs:.0f} |")


MESH_HEADER = "| model | mesh | our plan | ZeRO | micro-batches | recompute | step s | GiB | search s |"
MESH_RULE = "|---|---|---|---|---:|---:|---:|---:|---:|"


def mesh_rows(row: dict) -> list[str]:
    """Our best plan on every factorisation tried for one model."""
    out = []
    for o in row["ours_by_mesh"]:
        name = row["ref"]["name"]
        tag = " (Megatron's)" if tuple(o["shape"]) == tuple(_megatron_shape(row)) else ""
        if o["error"]:
            out.append(f"| {name} | {_shape(o['shape'])}{tag} | failed: {o['error'][:120]} "
                       f"| | | | | | {o['seconds']:.1f} |")
            continue
        out.append(f"| {name} | {_shape(o['shape'])}{tag} | {describe_ours(o)} | {_zero(o)} | "
                   f"{_micro(o)} | {_recompute(o)} | {o['step_seconds']:.3f}"
                   f"{' (stopped at time limit)' if o['stopped'] else ''} | "
                   f"{o['memory_gib']:.1f} | {o['seconds']:.1f} |")
    return out


def _megatron_shape(row: dict) -> tuple[int, ...]:
    return Reference(**row["ref"]).megatron_shape()


def text_table(rows: list[dict]) -> str:
    """A plain-text table for the terminal."""
    cols = ("model", "GPUs", "Megatron", "M", "rc", "step s", "GiB", "| ours mesh", "plan",
            "ZeRO", "M", "rc", "step s", "GiB", "speed-up", "plan s")
    lines = []
    for row in rows:
        r, m, o = row["ref"], row["megatron"], row["ours"]
        if m is None or o is None:
            lines.append((r["name"], str(r["gpus"]), "failed", *[""] * 12, "; ".join(row["errors"])))
            continue
        lines.append((r["name"], str(r["gpus"]),
                      f"TP{r['tp']}/PP{r['pp']}/DP{r['gpus'] // (r['tp'] * r['pp'])}",
                      _micro(m), _recompute(m), f"{m['step_seconds']:.3f}", f"{m['memory_gib']:.1f}",
                      "| " + _shape(o["shape"]), describe_ours(o), _zero(o), _micro(o),
                      _recompute(o), f"{o['step_seconds']:.3f}", f"{o['memory_gib']:.1f}",
                      f"{row['speedup']:.3f}x" + (" WORSE" if row["worse"] else ""),
                      f"{row['seconds']['megatron'] + row['seconds']['ours']:.0f}"))
    width = [max(len(c), *(len(ln[i]) for ln in lines)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, width))]
    out += ["  ".join(v.rjust(w) for v, w in zip(ln, width)) for ln in lines]
    return "\n".join(out)



def section(rows: list[dict], wall: float, workers: int, command: str = "",
            pooled: bool = False) -> str:
    """The markdown section for ``docs/benchmarks.md`` (``command``: its last line,
    ``plan_time.regenerate``'s)."""
    today = _dt.date.today().isoformat()
    worse = [r["ref"]["name"] for r in rows if r["worse"]]
    gap = [r["ref"]["name"] for r in rows if r["worse_on_megatron_mesh"]]
    lines = [
        SECTION,
        "",
        f"Predicted step time (our cost model, preset `{PRESET}`: A100 80GB, 312 TFLOP/s bf16, "
        "NVLink 300 GB/s in a node, one 25 GB/s HDR NIC per GPU between nodes) of GPT models "
        f"with the shapes of Megatron-LM's published runs ({SOURCE}; vocabulary {VOCAB:,}, "
        f"sequence {SEQ:,}), under Megatron's published (TP, PP, DP) and under our joint "
        "search. Models are `examples/gpt.py` built on the meta device (two blocks captured, "
        "extrapolated to full depth with `blocks=`) and planned with "
        f"`precision=\"{PRECISION}\"` (bf16 matmuls and activations where autocast has them; "
        "fp32 master weights, gradients and AdamW state); 80 GiB per GPU, of which the "
        "preset reserves 5.5 GiB (1.5 GiB + 5%) for the runtime: the budget is 74.5 GiB.",
        "",
        "**Megatron** forces the published sizes: TP on a mesh axis inside a node with "
        "Megatron's column/row pins (q/k/v and fc1 column-, out_proj and fc2 row-sharded, "
        "embedding and head vocab-sharded), the batch sharded on the data-parallel axes, "
        "`pipeline_stages=PP` with 1F1B, no ZeRO (as published). Our search chooses its "
        "micro-batch count (the best of every count dividing the batch whose micro-batch splits "
        "over the DP ranks is shown), stage boundaries, activation "
        "placements and the layers to recompute (Megatron recomputed every layer; we recompute "
        "only as many as it takes to fit the budget, which flatters Megatron's plan). **Ours** is the joint "
        "search with nothing forced (`explore=True`) on (nodes, 8) and on Megatron's own "
        "factorisation (first table: the fastest; second: each mesh).",
        "",
        f"Measured {today} on: {machine()}; {workers} worker processes, {wall:.0f} s wall in "
        + ("all, with the Alpa and Mist suites below in the same pool " if pooled else "all ")
        + "(planning s = CPU seconds of all planning calls for that model).",
        "",
        HEADER,
        RULE,
        *(markdown_row(r) for r in rows),
        "",
        MESH_HEADER,
        MESH_RULE,
        *(ln for r in rows for ln in mesh_rows(r)),
        "",
        "Plan columns: TP = product of the stage mesh axes whose block weights are sharded "
        "(most bytes) and the batch is not; DP = axes sharding the batch with replicated "
        "weights; PP = pipeline stages (Megatron's carved out of the inter-node axis, ours out of any axis the search picks); micro-batches are "
        "per step (gradient accumulation without a pipeline); recompute = recomputed layers / "
        "layers (blocks + embedding + head); GiB = predicted peak per GPU of the fullest stage; "
        "speed-up = Megatron's predicted step time / ours. "
        + ("Our plan is never predicted slower than the published one." if not worse else
           f"**Our plan is predicted slower than the published one for {', '.join(worse)}: a "
           "search bug.**")
        + ("" if not gap else
           f" On Megatron's own mesh alone the free search is slower than the pinned plan for "
           f"{', '.join(gap)}: the intra-op search prices placements per micro-batch with no "
           "memory budget, before recomputation and ZeRO are chosen."),
        "",
        "Caveats: both columns are predictions of our cost model, not measurements, and are "
        "not compared here with the throughput the paper measured; Megatron's plan is priced "
        "with 1F1B as published (ours may choose interleaved 1F1B or zero-bubble); fused "
        "kernels and communication overlap inside tensor parallelism are not "
        "modelled; Megatron keeps bf16 weights with fp32 masters only in the optimizer, we keep "
        "fp32 weights and cast them per use as autocast does (4 bytes per replicated parameter "
        "more than Megatron's 2); our model keeps untied embedding and head weights "
        "(so slightly more parameters than published); only the factorisations listed were "
        "searched. `--all-meshes` adds (nodes, 2, 4) and (nodes, 4, 2) for every model "
        "(slower).",
        "",
        command or regenerate("reference_plans.py", []),
        "",
    ]
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> int:
    """Plan every reference and print the table (``--write``: update the docs too);
    1 when ours is worse."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=[r.name for r in REFERENCES],
                    choices=[r.name for r in REFERENCES])
    ap.add_argument("--all-meshes", action="store_true",
                    help="also search (nodes, 2, 4) and (nodes, 4, 2) for every model")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--time-limit", type=float, default=1800.0,
                    help="limit of each joint search (s); the plan says when it ran out")
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's tables in docs/benchmarks.md")
    ap.add_argument("--json", help="also write the raw rows here")
    ap.add_argument("--suites", nargs="+", default=["megatron", "alpa", "mist"],
                    choices=["megatron", "alpa", "mist"])
    args = ap.parse_args(argv)
    import published_suites as ps

    bad = []
    command = regenerate("reference_plans.py", argv)
    others = [s for s in args.suites if s != "megatron"]
    runs, pjobs = ps.suite_jobs(others)
    refs = [BY_NAME[n] for n in args.models] if "megatron" in args.suites else []
    # every suite's jobs in one pool, the longest first (run one suite after the other,
    # each suite's last long search ran beside an idle worker)
    tasks = sorted([(ps.run_job, j) for j in pjobs]
                   + [(run_job, j) for r in refs for j in jobs_for(r, args.all_meshes)],
                   key=lambda task: longest_first(task[1]))
    t0 = time.perf_counter()
    outcomes = run_tasks(tasks, args.workers, args.time_limit,
                         lambda o: print(_progress(o), file=sys.stderr, flush=True))
    wall = time.perf_counter() - t0
    print(f"{wall:.0f} s wall in all, {args.workers} workers", file=sys.stderr)
    if others:
        bad += ps.suite_report(runs, [o for (fn, _), o in zip(tasks, outcomes) if fn is ps.run_job],
                               wall, args.workers, args.write, command, pooled=bool(refs))
    if not refs:
        return 1 if bad else 0
    results = [o for (fn, _), o in zip(tasks, outcomes) if fn is run_job]
    rows = summarise(refs, results)
    print(text_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write:
        write_section(section(rows, wall, args.workers, command, pooled=bool(others)))
        print("updated docs/benchmarks.md", file=sys.stderr)
    bad += [r["ref"]["name"] for r in rows if r["worse"] or r["megatron"] is None or r["ours"] is None]
    if bad:
        print(f"SEARCH BUG: our plan is worse than (or failed against) the published one for {bad}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
