"""Our plans against Alpa's and Mist's published GPT plans, both priced by our cost model.

The runs (primary sources, read 2026-11-24):

* **Alpa** (L. Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism
  for Distributed Deep Learning", OSDI'22, section 8): GPT-3 1.3B-39B on 4-64 V100 16 GB
  in AWS p3.16xlarge nodes (NVLink inside, 25 Gb/s between), sequence 1,024, vocabulary
  51,200, global batch 1,024.  The plans Alpa found are the authors' artifact
  (github alpa-projects/alpa, branch ``osdi22_artifact``,
  ``suite_artifact_e2e_gpt.py``; 39B: ``main`` ``benchmark/alpa/suite_auto_gpt.py``
  ``perf_test_suite[64]``), with remat on every layer and the weight update sharded
  over data-parallel copies.  The 39B plan of an earlier record
  (``paper_auto_gpt_suite.py`` at 750a3a4a: TP8 x PP8, 256 micro-batches) is priced too.
* **Mist** (Z. Zhu et al., "Mist: Efficient Distributed Training of Large Language
  Models via Memory-Parallelism Co-Optimization", EuroSys'25): GPT 7B/13B/22B on 8-32
  A100-SXM4 40 GB, sequence 4,096, vocabulary 50,304, global batch 128/256/512, with
  FlashAttention.  The plans Mist found are the authors' tuned configs (github
  Dazz993/Mist, ``benchmark/mist/tuned_configs/a100-40gb/gpt/*-f_True.yaml``): one
  sequence per data-parallel rank per micro-batch, no offloading.

Each run is planned twice with ``precision="bf16-mixed"`` (V100 has no bf16: its fp16
tensor-core rate and 2-byte activations stand in, as Alpa trained in fp16):

* **published**: the published (PP, DP, TP) forced on its own mesh (stages carved out of
  axis 0, tensor parallelism on the last axis with Megatron's column/row pins standing in
  for the operator sharding Alpa's ILP chose, the batch on the data-parallel axes), the
  published micro-batch count and 1F1B.  Left to our search, which can only flatter the
  published plan under our model: ZeRO stage and axis (Alpa shards the weight update;
  Mist chose ZeRO per stage, ours is one for all stages), the layers to recompute
  (Alpa recomputes all; Mist a published count per stage), stage boundaries and the
  activations' placements.
* **ours**: the joint search with nothing forced (``explore=True``) on the published
  mesh and on (nodes, 8) (one node: (GPUs,)); the fastest wins.

Run as ``python benchmarks/reference_plans.py --suites alpa mist`` or
``python benchmarks/published_suites.py``: both print the table; ``--write`` also
rewrites the table of this benchmark's section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_plans import (  # noqa: E402
    GIB,
    PRECISION,
    Outcome,
    best,
    longest_first,
    plan_outcome,
    run_jobs,
    tp_pins,
)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Published plans of Alpa and Mist (benchmarks/published_suites.py)"
GPUS_PER_NODE = 8

ALPA = ("L. Zheng et al., OSDI'22; plans from github alpa-projects/alpa (osdi22_artifact "
        "suite_artifact_e2e_gpt.py; 39B: main benchmark/alpa/suite_auto_gpt.py perf_test_suite)")
MIST = ("Z. Zhu et al., EuroSys'25; plans from github Dazz993/Mist "
        "benchmark/mist/tuned_configs/a100-40gb/gpt/*-f_True.yaml")


@dataclass(frozen=True)
class Run:
    """One published run: model shape, cluster, and the plan its authors' system found.
    ``shape`` is the published plan's mesh: (PP, data-parallel..., TP), size-1 axes
    left out; ``unsupported`` says why the plan cannot be expressed here (then only our
    plan is priced)."""

    suite: str
    name: str
    heads: int
    dim: int
    layers: int
    gpus: int
    batch: int
    seq: int
    vocab: int
    preset: str
    pp: int
    dp: int
    tp: int
    micro: int
    shape: tuple[int, ...]
    note: str = ""
    unsupported: str = ""

    @property
    def key(self) -> str:
        """Unique row name: suite and model."""
        return f"{self.suite} {self.name}"

    def __post_init__(self) -> None:
        if not self.unsupported and (self.pp * self.dp * self.tp != self.gpus
                                     or math.prod(self.shape) != self.gpus):
            raise ValueError(f"{self.key}: PP {self.pp} x DP {self.dp} x TP {self.tp} and mesh "
                             f"{self.shape} do not make {self.gpus} GPUs")
        if self.batch % self.micro:
            raise ValueError(f"{self.key}: {self.micro} micro-batches do not divide {self.batch}")

    def our_shapes(self) -> list[tuple[int, ...]]:
        """Meshes our free search runs on: the published one and (nodes, 8) or (GPUs,)."""
        plain = ((self.gpus // GPUS_PER_NODE, GPUS_PER_NODE) if self.gpus > GPUS_PER_NODE
                 else (self.gpus,))
        return list(dict.fromkeys(([] if self.unsupported else [self.shape]) + [plain]))

    def pins(self) -> dict[str, str]:
        """Pins forcing the published layout on a stage's sub-mesh: TP on its last axis
        (Megatron's column/row layout), the batch on the others, weights replicated."""
        return tp_pins(self.tp, len(self.shape) - (1 if self.pp > 1 else 0))


_ALPA = dict(suite="Alpa", gpus=0, batch=1024, seq=1024, vocab=51200, preset="p3.16xlarge")
_MIST = dict(suite="Mist", seq=4096, vocab=50304, preset="multinode-a100-40gb")
RUNS: tuple[Run, ...] = (
    Run(**{**_ALPA, "gpus": 4}, name="1.3B", heads=32, dim=2048, layers=24, pp=2, dp=2, tp=1,
        micro=128, shape=(2, 2)),
    Run(**{**_ALPA, "gpus": 8}, name="2.6B", heads=32, dim=2560, layers=32, pp=3, dp=2, tp=1,
        micro=128, shape=(8,),
        unsupported="3 stages on 2, 2 and 4 GPUs: our stages are equal sub-meshes of one axis"),
    Run(**{**_ALPA, "gpus": 16}, name="6.7B", heads=32, dim=4096, layers=32, pp=2, dp=2, tp=4,
        micro=64, shape=(2, 2, 4)),
    Run(**{**_ALPA, "gpus": 32}, name="15B", heads=40, dim=5120, layers=48, pp=4, dp=2, tp=4,
        micro=128, shape=(4, 2, 4)),
    Run(**{**_ALPA, "gpus": 64}, name="39B", heads=64, dim=8192, layers=48, pp=16, dp=1, tp=4,
        micro=1024, shape=(16, 4)),
    Run(**{**_ALPA, "gpus": 64}, name="39B (Jan. 2022 record)", heads=64, dim=8192, layers=48,
        pp=8, dp=1, tp=8, micro=256, shape=(8, 8)),
    Run(**_MIST, name="7B", heads=32, dim=4096, layers=32, gpus=8, batch=128, pp=2, dp=4, tp=1,
        micro=32, shape=(2, 4), note="ZeRO-3 on stage 0, ZeRO-1 on stage 1"),
    Run(**_MIST, name="13B", heads=40, dim=5120, layers=40, gpus=16, batch=256, pp=2, dp=8, tp=1,
        micro=32, shape=(2, 8), note="ZeRO-3; 7 layers of stage 0 recomputed"),
    Run(**_MIST, name="22B", heads=64, dim=6144, layers=48, gpus=32, batch=512, pp=4, dp=4, tp=2,
        micro=128, shape=(4, 4, 2), note="ZeRO-1; 5 and 4 layers of stages 0 and 1 recomputed"),
)
BY_KEY = {r.key: r for r in RUNS}


def build_model(run: Run, batch: int, blocks: int = 2):
    """``examples/gpt.py`` with ``run``'s shape on the meta device, and meta inputs."""
    import torch

    sys.path.insert(0, str(ROOT))
    from examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=run.vocab, seq=run.seq, dim=run.dim, heads=run.heads,
                              layers=blocks))
    tokens = torch.zeros(batch, run.seq, dtype=torch.long, device="meta")
    return model, (tokens, tokens.clone())


def run_job(key: str, kind: str, shape: tuple[int, ...], time_limit: float) -> Outcome:
    """Plan one run's ``kind`` ("published" or "ours") on ``shape`` (in a worker)."""
    import torch

    from autopar import MeshSpec

    torch.set_num_threads(1)
    run = BY_KEY[key]
    out = Outcome(key, kind, tuple(shape), layers=run.layers + 2)
    mesh = MeshSpec.preset(run.preset, shape=tuple(shape))
    model, ex = build_model(run, run.batch)
    if kind == "published":
        # the published stages, carved out of the outermost axis as the pins assume
        kw = dict(pins=run.pins(), pipeline_stages=run.pp, micro_batches=run.micro,
                  schedule="1f1b" if run.pp > 1 else None, pipeline_axis=0 if run.pp > 1 else None)
    else:
        kw = dict(explore=True)
    return plan_outcome(out, model, ex, mesh, run.layers, time_limit, kw)


def jobs_for(run: Run) -> list[tuple[str, str, tuple[int, ...]]]:
    """(run, kind, mesh shape) of every planning call for ``run``."""
    jobs = [] if run.unsupported else [(run.key, "published", run.shape)]
    return jobs + [(run.key, "ours", s) for s in run.our_shapes()]


def summarise(results: list[Outcome], runs: list[Run] | None = None) -> list[dict]:
    """One row per run: the published plan against our fastest mesh."""
    from autopar import MeshSpec

    rows = []
    for run in runs or RUNS:
        mine = [o for o in results if o.model == run.key]
        pub = next((o for o in mine if o.kind == "published"), None)
        # in mesh order, not the order the workers finished in: a tie then names the
        # same mesh every run (Alpa 1.3B plans 38.105 s on both 2x2 and 4)
        by_mesh = sorted((o for o in mine if o.kind == "ours"), key=lambda o: o.shape)
        ours = best(by_mesh)
        budget = MeshSpec.preset(run.preset, shape=run.our_shapes()[-1]).usable_memory / GIB
        ok = pub is not None and not pub.error and math.isfinite(pub.step_seconds)
        row = {"run": run, "published": pub, "ours": ours, "budget_gib": budget,
               "ours_by_mesh": by_mesh,
               "errors": [f"{o.kind} {_shape(o.shape)}: {o.error}" for o in mine if o.error],
               "seconds": sum(o.seconds for o in mine)}
        row["speedup"] = pub.step_seconds / ours.step_seconds if ok and ours else None
        row["worse"] = bool(ok and ours and ours.step_seconds > pub.step_seconds * (1 + 1e-9))
        row["fits"] = bool(ours and ours.memory_gib <= budget * (1 + 1e-9))
        rows.append(row)
    return rows


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def _plan(o: Outcome) -> str:
    s = f"TP{o.tp} x PP{o.stages} x DP{o.dp}" + (f" ({o.other})" if o.other else "")
    z = f", ZeRO-{o.zero_stage}" if o.zero_stage else ""
    return f"{s}{z}, {o.micro_batches} micro-batches, recompute {o.recompute}/{o.layers}"


HEADER = ("| suite | model | GPUs | batch | published plan | published, priced by us: step s, GiB | "
          "our mesh | our plan | our step s | our GiB | budget GiB | published / ours | planning s |")
RULE = "|---|---|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|"


def markdown_row(row: dict) -> str:
    """One markdown table row for a run."""
    r: Run = row["run"]
    pub, o = row["published"], row["ours"]
    published = f"TP{r.tp} x PP{r.pp} x DP{r.dp}, {r.micro} micro-batches" + (
        f" ({r.note})" if r.note else "")
    if r.unsupported:
        priced = f"not expressible: {r.unsupported}"
    elif pub is None or pub.error:
        priced = "failed: " + (pub.error[:150] if pub else "not run")
    else:
        rc = f"recompute {pub.recompute}/{pub.layers}" + (f", ZeRO-{pub.zero_stage}" if pub.zero_stage else "")
        priced = f"{pub.step_seconds:.3f} s, {pub.memory_gib:.1f} GiB ({rc})"
    head = f"| {r.suite} | {r.name} | {r.gpus} | {r.batch} | {published} | {priced} | "
    if o is None:
        return head + "failed: " + "; ".join(row["errors"])[:200] + " |" * 7
    sp = f"{row['speedup']:.3f}x" + (" **worse**" if row["worse"] else "") if row["speedup"] else "-"
    return head + (f"{_shape(o.shape)} | {_plan(o)} | {o.step_seconds:.3f} | {o.memory_gib:.1f}"
                   f"{'' if row['fits'] else ' **over**'} | {row['budget_gib']:.1f} | {sp} | "
                   f"{row['seconds']:.0f} |")


def section(rows: list[dict], wall: float, workers: int, machine: str, command: str = "",
            pooled: bool = False) -> str:
    """The markdown section for ``docs/benchmarks.md`` (``command``: its last line,
    ``plan_time.regenerate``'s)."""
    import datetime as _dt

    from plan_time import regenerate

    worse = [r["run"].key for r in rows if r["worse"]]
    over = [r["run"].key for r in rows if not r["fits"]]
    lines = [
        SECTION, "",
        "Predicted step time (our cost model) of GPT models with the shapes of Alpa's and "
        "Mist's published runs, under the plan each system published and under our joint "
        f"search (`explore=True`), in `precision=\"{PRECISION}\"` with the presets' memory "
        "reserve. Sources: " + ALPA + "; " + MIST + ". Alpa: preset `p3.16xlarge` (8 V100 "
        "16 GB per node, NVLink ~130 GB/s, 25 Gb/s Ethernet per node shared by its 8 GPUs; "
        "V100 has no bf16, so the fp16 tensor-core rate and 2-byte activations stand in, "
        "as Alpa trained in fp16), sequence 1,024, vocabulary 51,200. Mist: preset "
        "`multinode-a100-40gb` (NVLink inside a node; between nodes ~10.7 GB/s per node, "
        "from Mist's own profile), sequence 4,096, vocabulary 50,304, FlashAttention "
        "(our GPT runs SDPA, priced as fused attention).", "",
        "**Published** forces the published pipeline stages (carved out of mesh axis 0, forced), "
        "tensor parallelism on the last axis (Megatron's column/row pins standing in for the "
        "operator sharding Alpa's ILP chose), the batch on the data-parallel axes, the "
        "published micro-batch count and 1F1B. Our search still chooses the ZeRO stage and "
        "axis, the layers to recompute, the stage boundaries and the activations' "
        "placements: that can only make the published plan faster under our model. "
        "**Ours** searches the published mesh and (nodes, 8) with nothing forced.", "",
        f"Measured {_dt.date.today().isoformat()} on: {machine}; {workers} worker processes, "
        f"{wall:.0f} s wall" + (" in one pool with the Megatron suite above." if pooled else "."), "",
        HEADER, RULE, *(markdown_row(r) for r in rows), "",
        "Plan columns as in the Megatron table above; GiB = predicted peak per GPU of the "
        "fullest stage; budget = the device less the preset's reserve (1.5 GiB + 5%). "
        + ("Our plan is never predicted slower than a published one it can express, "
           if not worse else f"**Ours is predicted slower for {', '.join(worse)}: a search "
           "bug,** ")
        + ("and every plan of ours fits its budget." if not over else
           f"**and {', '.join(over)} does not fit its budget.**"),
        "",
        "Caveats: predictions of our cost model, not measurements. A stage sends each "
        "tensor-parallel rank's part of its boundary activations: sequence-parallel slices "
        "here, and a replicated value, where that is faster, as one slice per rank "
        "all-gathered inside the receiving node (runtime/stage_wire.py, as Alpa's "
        "cross-mesh resharding). Our "
        "residual stream stays fp32 under bf16-mixed, twice the bytes of Alpa's fp16 (for "
        "the 39B record plan, 16.7 MB per micro-batch and rank at 0.39 GB/s: ~43 ms per "
        "send, 31 s of exposed communication a step). Alpa measured ~57 TFLOP/s per "
        "V100 on 39B (artifact results_e2e_ref.tsv), about 91 s per step: compare with the "
        "published row's predicted step. Mist's per-stage ZeRO levels are one level for all "
        "stages here. Alpa's 2.6B plan (3 stages on 2, 2 and 4 GPUs) is not expressible: our "
        "stages are equal sub-meshes.", "",
        command or regenerate("published_suites.py", []), "",
    ]
    return "\n".join(lines)


def _progress(o: Outcome) -> None:
    print(f"  {o.model:>28} {o.kind:>9} {_shape(o.shape):>8}: "
          f"{o.error or f'{o.step_seconds:.3f} s/step, {o.memory_gib:.1f} GiB'} "
          f"({o.seconds:.1f} s)", file=sys.stderr, flush=True)


def main_suites(suites: list[str], workers: int, time_limit: float, write: bool = False,
                command: str = "") -> list[str]:
    """Plan Alpa's and/or Mist's runs (:mod:`published_suites`), print their rows and,
    with ``write``, write their section (``command``: the line saying how to regenerate
    it); the runs where ours is worse, failed or does not fit."""
    runs, jobs = suite_jobs(suites)
    t0 = time.perf_counter()
    results = run_jobs(run_job, jobs, workers, time_limit, _progress)
    return suite_report(runs, results, time.perf_counter() - t0, workers, write, command)


def suite_jobs(suites: list[str]) -> tuple[list[Run], list[tuple]]:
    """The runs of ``suites`` and their planning jobs, the longest first."""
    runs = [r for r in RUNS if r.suite.lower() in suites]
    return runs, sorted((j for r in runs for j in jobs_for(r)), key=longest_first)


def suite_report(runs: list[Run], results: list[Outcome], wall: float, workers: int,
                 write: bool = False, command: str = "", pooled: bool = False) -> list[str]:
    """Print the rows of ``runs`` from their jobs' ``results`` (``wall``: the seconds
    they took; ``pooled``: beside the Megatron suite's) and, with ``write``, write their
    section; the runs where ours is worse, failed or does not fit."""
    from plan_time import machine, write_section

    rows = summarise(results, runs)
    print("\n".join([HEADER, RULE, *(markdown_row(r) for r in rows)]))
    if write:
        write_section(section(rows, wall, workers, machine(), command, pooled))
    return [r["run"].key for r in rows
            if r["worse"] or r["ours"] is None or not r["fits"]
            or (not r["run"].unsupported and (r["published"] is None or r["published"].error))]


def main(argv: list[str] | None = None) -> int:
    """Plan the suites and print their rows (``--write``: update the docs too); 1 when
    ours is worse, failed or does not fit."""
    from plan_time import regenerate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", nargs="+", default=["alpa", "mist"], choices=["alpa", "mist"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=1800.0,
                    help="limit of each joint search (s); the plan says when it ran out")
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's table in docs/benchmarks.md")
    a = ap.parse_args(argv)
    bad = main_suites(a.suites, a.workers, a.time_limit, a.write,
                      regenerate("published_suites.py", argv))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
