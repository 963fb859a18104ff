"""The plan a user gets within the default ``time_limit`` against one found without a limit.

``autopar.plan`` stops its joint search at ``time_limit`` (30 s by default) and returns the
best plan found so far.  For every free search (``explore=True``) of the reference
benchmarks, the Megatron-LM models of :mod:`reference_plans` and the Alpa and Mist models of
:mod:`published_suites`, this plans twice, once within the default limit and once with
``--unlimited`` seconds (far more than any of them takes), and prints each job's predicted
step under both, their ratio and the planning seconds.  It exits with status 1 when a
default-limit plan is more than 1% slower than the unlimited one::

    python benchmarks/time_limit.py                  # prints the table
    python benchmarks/time_limit.py --write          # also rewrites its docs section
    python benchmarks/time_limit.py --models 1.7B --suites megatron
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published_suites as P  # noqa: E402  (same folder)
import reference_plans as R  # noqa: E402
from plan_time import machine, regenerate, write_section  # noqa: E402

SECTION = "## Default time limit against none (benchmarks/time_limit.py)"
DEFAULT_LIMIT = 30.0  # autopar.plan's default time_limit
TOLERANCE = 0.01  # the default-limit plan may be predicted at most 1% slower
HEADER = ("| suite | model | mesh | step s, limit 30 s | planning s | step s, no limit | "
          "planning s | limited / unlimited |")
RULE = "|---|---|---|---:|---:|---:|---:|---:|"


def _jobs(suites: list[str], models: list[str] | None) -> list[tuple]:
    """(suite, job function, job arguments) of every free search."""
    out: list[tuple] = []
    if "megatron" in suites:
        for ref in R.REFERENCES:
            if models is None or ref.name in models:
                out += [("Megatron", R.run_job, (n, k, s, m)) for n, k, s, m in R.jobs_for(ref, False)
                        if k == "ours"]
    for run in P.RUNS:
        if run.suite.lower() in suites and (models is None or run.key in models):
            out += [(run.suite, P.run_job, (key, k, s)) for key, k, s in P.jobs_for(run) if k == "ours"]
    return out


def _run(job: tuple, limit: float):
    _, fn, args = job
    return fn(*args, limit)


def measure(jobs: list[tuple], unlimited: float, workers: int) -> list[dict]:
    """Plan every job at both limits, ``workers`` at a time; one row per job."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    runs = [(j, lim) for j in jobs for lim in (DEFAULT_LIMIT, unlimited)]
    # the longest first (unlimited, large meshes), so the pool ends together
    runs.sort(key=lambda r: (r[1] == DEFAULT_LIMIT, -math.prod(r[0][2][2])))
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futs = {(id(j), lim): pool.submit(_run, j, lim) for j, lim in runs}
        rows = []
        for j in jobs:
            lim, unl = futs[(id(j), DEFAULT_LIMIT)].result(), futs[(id(j), unlimited)].result()
            rows.append({"suite": j[0], "limited": lim, "unlimited": unl,
                         "ratio": lim.step_seconds / unl.step_seconds
                         if math.isfinite(lim.step_seconds) and math.isfinite(unl.step_seconds)
                         and not lim.error and not unl.error else math.nan})
            print(f"  {j[0]:>8} {lim.model:>22} {R._shape(lim.shape):>7}: "
                  f"{lim.step_seconds:.3f} s ({lim.seconds:.0f} s) vs {unl.step_seconds:.3f} s "
                  f"({unl.seconds:.0f} s){' ' + (lim.error or unl.error) if lim.error or unl.error else ''}",
                  file=sys.stderr, flush=True)
    return rows


def markdown_row(r: dict) -> str:
    """One job's row."""
    a, b = r["limited"], r["unlimited"]

    def step(o) -> str:
        return o.error[:60] if o.error else f"{o.step_seconds:.3f}" + (" (cut)" if o.stopped else "")

    ratio = "-" if math.isnan(r["ratio"]) else f"{r['ratio']:.4f}"
    return (f"| {r['suite']} | {a.model} | {R._shape(a.shape)} | {step(a)} | {a.seconds:.0f} | "
            f"{step(b)} | {b.seconds:.0f} | {ratio} |")


def section(rows: list[dict], wall: float, workers: int, unlimited: float, command: str,
            suites: tuple[str, ...] = ("megatron", "alpa", "mist")) -> str:
    """The docs section: what was run, the table, the command."""
    worst = max((r["ratio"] for r in rows if not math.isnan(r["ratio"])), default=math.nan)
    return "\n".join([
        SECTION, "",
        "Every free search (`explore=True`) of the suites " + ", ".join(suites) + " (the models, "
        "presets and meshes of the reference and published-suite sections above), planned within "
        f"`autopar.plan`'s default `time_limit` ({DEFAULT_LIMIT:g} s) and with "
        f"{unlimited:g} s (no search here comes near it). \"(cut)\" marks a search its limit "
        "stopped; the ratio is the predicted step of the limited plan over the unlimited one's.",
        "",
        f"Measured on: {machine()}; {workers} worker processes, {wall:.0f} s wall in all.",
        "", HEADER, RULE, *(markdown_row(r) for r in rows), "",
        f"Worst ratio: {worst:.4f} (the limit may cost at most {TOLERANCE:.0%}).", "",
        command, ""])


def main(argv: list[str] | None = None) -> int:
    """Plan, print the table (``--write``: update the docs); 1 when a limited plan is
    more than 1% slower."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", nargs="+", default=["megatron", "alpa", "mist"],
                    choices=["megatron", "alpa", "mist"])
    ap.add_argument("--models", nargs="+", help="reference names or suite run keys")
    ap.add_argument("--unlimited", type=float, default=3600.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--write", action="store_true",
                    help="also rewrite this benchmark's section of docs/benchmarks.md")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = measure(_jobs(args.suites, args.models), args.unlimited, args.workers)
    wall = time.perf_counter() - t0
    print("\n".join([HEADER, RULE, *(markdown_row(r) for r in rows)]))
    print(f"{wall:.0f} s wall, {args.workers} workers", file=sys.stderr)
    if args.write:
        write_section(section(rows, wall, args.workers, args.unlimited,
                              regenerate("time_limit.py", argv), tuple(args.suites)))
    bad = [r for r in rows if math.isnan(r["ratio"]) or r["ratio"] > 1 + TOLERANCE]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
