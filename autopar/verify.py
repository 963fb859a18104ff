"""Self-check on the live job: measure the best few candidate plans, keep the fastest.

The cost model ranks plans; a few real steps say whether it ranked them right.
:func:`verify` (every rank calls it, under torchrun) takes the ``k`` candidates the
model predicts fastest, trains each for a few steps on a deep copy of the model, and
reports predicted against measured step time (a table and the Spearman rank
correlation).  By default it then picks the *measured* fastest among them, a
profile-guided final choice as Aceso and Galvatron make, but only over the few plans
the cost model already ranks best, so it costs ``k`` short runs, not a search::

    report = autopar.verify(model, (tokens, labels), mesh, k=4, steps=3,
                            store="measurements.jsonl")
    print(report.table())
    pm = autopar.auto_parallel(model, example_inputs=(tokens, labels), plan=report.plan)

Candidates (:func:`shortlist`): the search's own plan and plan-level variants of it
(ZeRO 0-3, two micro-batches, two pipeline stages under 1F1B when the model has
repeated layers, the mesh folded to 2-D or flattened to 1-D), each planned by
:func:`autopar.plan` with that decision forced, deduplicated (the same decisions and
parameter placements are one candidate), sorted by predicted ``step_seconds``; the
first ``k`` are measured.  ``candidates=`` replaces them with the caller's own plans.

Rank 0 plans for every rank and shares the plans (:mod:`autopar.runtime.agree`, as
``auto_parallel`` does): every rank measures the identical plans in the same order, an
error on rank 0 is raised on every rank, and each step's time is the slowest rank's,
so the report and its choice are identical on every rank.  ``store=`` appends one JSON
line per candidate (decisions, mesh, predicted and measured seconds, time, host) that a
later calibration can learn from.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.api import auto_parallel
from autopar.api import plan as make_plan
from autopar.cost_models import MeshSpec
from autopar.errors import AutoparError, ConfigError
from autopar.plans.data import Plan, register_reader, versions
from autopar.plans.decisions import decision_key
from autopar.report.summary import summary_numbers
from autopar.runtime import agree
from autopar.runtime.mesh import local_device
from autopar.validate import mesh as to_mesh

PICKS = ("measured", "predicted")
"""What :func:`verify` picks: the measured fastest candidate, or the predicted fastest."""

_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}


@dataclass
class Candidate:
    """A plan to measure and where it came from (``"search"``, a forced decision such
    as ``"zero_stage=3"``, ``"given"`` or ``"verified plan"``)."""

    plan: Plan
    origin: str

    @property
    def label(self) -> str:
        """The plan in a few words (:func:`label`)."""
        return label(self.plan)


@dataclass
class Shortlist:
    """The candidates to measure, in predicted order, and the variants left out."""

    candidates: list[Candidate]
    skipped: dict[str, str] = field(default_factory=dict)
    """Variant -> why it could not be planned (e.g. the batch does not split)."""
    duplicates: int = 0
    """Variants that came out equal to an earlier candidate."""


def label(plan: Plan) -> str:
    """A plan in words: the mesh axes' roles (``dp2``, ``dp2 x tp2``), the pipeline
    (``pp2 x 1f1b x 2 mb``), ZeRO (``zero3``), accumulation (``8 mb``), recomputation."""
    d = plan.decisions
    # "R": every rank of the axis computes the same (the model is too small to split)
    axes = [f"{'rep' if a['role'] == 'R' else a['role'].lower()}{a['size']}"
            for a in summary_numbers(plan)["axes"]
            if a["role"] != "PP" and a["size"] > 1]
    parts = []
    if d.pipeline_stages > 1:
        chunks = f"({d.virtual_stages})" if d.virtual_stages > 1 else ""
        inner = f"@a{d.pipeline_axis}" if d.pipeline_axis else ""  # stages inside a node
        parts.append(f"pp{d.pipeline_stages}{inner} x {d.schedule}{chunks} x {d.micro_batches} mb")
    if axes:
        parts.append(" x ".join(axes))
    if d.zero_stage:
        parts.append(f"zero{d.zero_stage}")
    if d.micro_batches > 1 and d.pipeline_stages == 1:
        parts.append(f"{d.micro_batches} mb")
    if d.recompute:
        parts.append(f"recompute {len(d.recompute)} layer" + ("s" if len(d.recompute) > 1 else ""))
    return ", ".join(parts) or "one device"


def candidate_key(plan: Plan) -> tuple:
    """What makes two plans the same candidate: mesh shape, every field a plan-level
    decision records (:func:`~autopar.plans.decisions.decision_key`, from the registry)
    and every parameter's placement (two plans that agree on these lower to the same
    code up to activation layouts, which follow from them)."""
    return (tuple(plan.mesh.shape), decision_key(plan.decisions),
            tuple(sorted(plan.params().items())))


def requested_mesh(plan: Plan) -> MeshSpec:
    """The mesh ``plan`` was asked for: its own mesh, or with pipeline stages the
    whole mesh they were carved from (``plan.mesh`` is then one stage's sub-mesh)."""
    shape = tuple(plan.request.mesh_shape)
    return plan.mesh.with_shape(shape) if shape and shape != tuple(plan.mesh.shape) else plan.mesh


def _variants(base: Plan, mesh: MeshSpec) -> list[tuple[str, MeshSpec | tuple[int, ...], dict]]:
    """(origin, mesh or the shape to refold it to, forced decisions) of the plan-level
    variants worth pricing."""
    out: list[tuple[str, MeshSpec | tuple[int, ...], dict]] = []
    if mesh.size > 1:  # ZeRO shards over data-parallel ranks: none on one device
        out += [(f"zero_stage={z}", mesh, {"zero_stage": z}) for z in range(4)]
    out.append(("micro_batches=2", mesh, {"micro_batches": 2}))
    repeated = {n.layer for n in base.nodes.values()} - {"", "pre", "post"}
    if len(repeated) >= 2 and any(s % 2 == 0 for s in mesh.shape):  # from an axis 2 divides
        out.append(("pipeline_stages=2", mesh,
                    {"pipeline_stages": 2, "micro_batches": 2, "schedule": "1f1b"}))
    n = mesh.size
    if mesh.ndim == 1:
        a = next((f for f in range(2, n) if n % f == 0), None)
        if a is not None:
            out.append((f"mesh {a}x{n // a}", (a, n // a), {}))
    elif n > 1:
        out.append((f"mesh {n}", (n,), {}))
    return out


def shortlist(model: nn.Module, example_inputs: tuple = (), mesh: MeshSpec | str | tuple | None = None,
              *, example_kwargs: dict | None = None, k: int = 5, include: Sequence[Plan] = (),
              candidates: Sequence[Plan] | None = None, **plan_options) -> Shortlist:
    """The ``k`` candidates :func:`verify` measures, best predicted first; needs no
    process group.

    Without ``candidates``: the search's plan for ``mesh`` and its variants
    (:func:`_variants`), each planned by :func:`autopar.plan` with ``plan_options``
    (``pins``, ``memory_budget``, ``optimizer``, ``time_limit``, forced decisions) and
    the variant's decision on top.  A variant that cannot be planned (the batch does not
    split, the mesh does not fit the pins) is left out and said why in ``skipped``; the
    search's own plan failing is an error.  ``candidates`` replaces the generated plans.
    ``include`` plans are always kept (they count towards ``k``)."""

    _positive("k", k)
    pool: list[Candidate] = [Candidate(p, "verified plan") for p in include]
    skipped: dict[str, str] = {}
    if candidates is not None:
        pool += [Candidate(p, "given") for p in candidates]
    else:
        m = to_mesh(mesh)
        base = make_plan(model, example_inputs, m, example_kwargs=example_kwargs, **plan_options)
        pool.append(Candidate(base, "search"))
        for origin, vmesh, forced in _variants(base, m):
            if not isinstance(vmesh, MeshSpec):
                try:
                    vmesh = m.with_shape(vmesh)
                except ValueError as e:  # a custom mesh whose links cannot be re-derived
                    skipped[origin] = str(e)
                    continue
            try:
                p = make_plan(model, example_inputs, vmesh, example_kwargs=example_kwargs,
                              **{**plan_options, **forced})
            except (AutoparError, ValueError) as e:  # this variant only: say why, go on
                skipped[origin] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            pool.append(Candidate(p, origin))
    seen: dict[tuple, Candidate] = {}
    for c in pool:  # the first of equal plans stays: included, then the search's own
        seen.setdefault(candidate_key(c.plan), c)
    unique = list(seen.values())
    kept = [c for c in unique if c.origin == "verified plan"]
    rest = sorted((c for c in unique if c.origin != "verified plan"),
                  key=lambda c: c.plan.decisions.step_seconds)  # stable: ties keep origin order
    kept += rest[:max(0, k - len(kept))]
    kept.sort(key=lambda c: c.plan.decisions.step_seconds)
    return Shortlist(kept, skipped, len(pool) - len(unique))


@dataclass
class Row:
    """One measured candidate."""

    label: str
    origin: str
    predicted_seconds: float
    measured_seconds: float
    """Median over the timed steps of the slowest rank's step time."""
    times: list[float]
    """Every timed step (slowest rank's), in order."""
    plan: Plan

    @property
    def spread(self) -> float:
        """(max - min) / median of the timed steps: how noisy the measurement was."""
        return (max(self.times) - min(self.times)) / self.measured_seconds if self.measured_seconds else 0.0


@dataclass
class VerifyReport:
    """Predicted against measured step time of each candidate and the one picked.

    ``rows`` are in predicted order (best first); ``chosen`` indexes them; ``plan`` is
    the chosen plan, identical on every rank."""

    rows: list[Row]
    chosen: int
    pick: str
    steps: int
    warmup: int
    world_size: int
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def plan(self) -> Plan:
        """The chosen plan: pass it to ``auto_parallel(..., plan=report.plan)``."""
        return self.rows[self.chosen].plan

    @property
    def spearman(self) -> float | None:
        """Spearman rank correlation of predicted against measured step time (1: the
        cost model ranked the candidates as measured); None under two candidates or
        when every predicted or every measured time is the same."""
        return spearman([r.predicted_seconds for r in self.rows],
                        [r.measured_seconds for r in self.rows])

    @property
    def measured_best(self) -> int:
        """Index of the measured fastest row (the first of equal ones)."""
        return min(range(len(self.rows)), key=lambda i: self.rows[i].measured_seconds)

    def table(self) -> str:
        """The rows as text, the Spearman correlation and what was picked and why."""
        w = max([len("plan"), *(len(r.label) for r in self.rows)])
        order = sorted(range(len(self.rows)), key=lambda i: self.rows[i].measured_seconds)
        rank = {i: n + 1 for n, i in enumerate(order)}
        lines = [f"{'#':>2}  {'plan':<{w}}  {'predicted ms':>12}  {'measured ms':>11}  "
                 f"{'spread':>6}  {'measured rank':>13}"]
        for i, r in enumerate(self.rows):
            mark = "  <- chosen" if i == self.chosen else ""
            lines.append(f"{i + 1:>2}  {r.label:<{w}}  {r.predicted_seconds * 1e3:>12.3f}  "
                         f"{r.measured_seconds * 1e3:>11.3f}  {100 * r.spread:>5.0f}%  "
                         f"{rank[i]:>13}{mark}")
        rho = self.spearman
        lines.append(f"Spearman (predicted vs measured): {'n/a' if rho is None else f'{rho:.2f}'} "
                     f"over {len(self.rows)} candidates; median of {self.steps} steps after "
                     f"{self.warmup} warm-up, slowest of {self.world_size} ranks")
        why = "measured fastest" if self.pick == "measured" else "predicted fastest"
        lines.append(f"chosen: #{self.chosen + 1} {self.rows[self.chosen].label} ({why})")
        lines += [f"not measured: {k}: {v}" for k, v in self.skipped.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable): rows without their plans, the chosen plan whole."""
        rows = [{"label": r.label, "origin": r.origin, "predicted_seconds": r.predicted_seconds,
                 "measured_seconds": r.measured_seconds, "spread": r.spread, "times": r.times}
                for r in self.rows]
        return {"rows": rows, "chosen": self.chosen, "pick": self.pick, "spearman": self.spearman,
                "steps": self.steps, "warmup": self.warmup, "world_size": self.world_size,
                "skipped": dict(self.skipped), "plan": self.plan.to_dict()}


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (ties share their mean rank); None when undefined
    (fewer than two values, or one side constant)."""
    def ranks(x: Sequence[float]) -> list[float]:
        at: dict[float, list[int]] = {}
        for i, v in enumerate(sorted(x)):
            at.setdefault(v, []).append(i)
        return [statistics.fmean(at[v]) for v in x]
    if len(a) != len(b) or len(a) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var


def _positive(name: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")


def join(timeout: float = 600.0) -> None:
    """Join the job's process group from torchrun's environment (gloo on CPU, NCCL with
    GPUs, as :func:`autopar.runtime.mesh.init_mesh` chooses), unless one exists."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise ConfigError("verify measures candidate plans on the live job: call it on every "
                          "rank under torchrun (or after init_process_group)")

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_device(backend))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def _shared(make: Callable[[], Shortlist], store: str | Path | None, timeout: float) -> Shortlist:
    """Rank 0 makes the shortlist and every rank gets it through JSON (rank 0's too, so
    all hold equal plans and the caller's objects are never touched); an error on rank 0
    (planning, an unwritable ``store``) is raised on every rank."""
    multi = dist.is_initialized() and dist.get_world_size() > 1
    if not multi or dist.get_rank() == 0:
        try:
            sl = make()
            if store is not None:  # fail now, on every rank, not after all the runs
                Path(store).parent.mkdir(parents=True, exist_ok=True)
                with open(store, "a"):
                    pass
            payload = {"plans": [c.plan.to_json() for c in sl.candidates],
                       "origins": [c.origin for c in sl.candidates],
                       "skipped": sl.skipped, "duplicates": sl.duplicates}
        except Exception as e:
            if multi:
                agree.publish(agree.error_payload(e), timeout)
            raise
        if multi:
            agree.publish(payload, timeout)
    else:
        payload = agree.wait(timeout)
        if "error" in payload:
            raise agree.rebuild(payload)
    if multi:
        agree.all_arrived(timeout)
    cands = [Candidate(Plan.from_json(t), o) for t, o in zip(payload["plans"], payload["origins"])]
    return Shortlist(cands, payload["skipped"], payload["duplicates"])


def _timed(step: Callable[[], None]) -> float:
    """Seconds of one ``step`` on the slowest rank (every rank starts together)."""
    multi = dist.is_initialized() and dist.get_world_size() > 1
    if multi:
        dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0])
    if multi:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _measure(c: Candidate, model: nn.Module, example_inputs: tuple, example_kwargs: dict | None,
             steps: int, warmup: int, optimizer: str, timeout: float) -> list[float]:
    """Build ``c``'s module on a deep copy of ``model`` and time ``steps`` training
    steps (zero_grad, forward and backward of the whole batch, optimizer step)."""
    # candidates on different meshes (pipelines carve a stage axis) each get theirs from
    # init_mesh, and every module runs on its own (runtime.mesh.activate).  Copies:
    # training must not touch the caller's model, and building writes the rank's own
    # lowering time into the plan (the report's plans stay equal on all ranks)
    pm = auto_parallel(copy.deepcopy(model), example_inputs=example_inputs,
                       example_kwargs=example_kwargs, plan=copy.deepcopy(c.plan), timeout=timeout)
    opt = _OPTIMIZERS[optimizer](pm.parameters())
    kwargs = example_kwargs or {}

    def step() -> None:
        opt.zero_grad()
        pm.train_step(*example_inputs, **kwargs)  # every micro-batch and stage
        opt.step()

    for _ in range(warmup):
        step()
    return [_timed(step) for _ in range(steps)]


def _write(store: str | Path, report: VerifyReport, model: nn.Module) -> None:
    """Append one JSON line per row: what a calibration needs to learn from it."""

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(store, "a") as f:
        for i, r in enumerate(report.rows):
            d = r.plan.decisions
            s = summary_numbers(r.plan)
            line = {"source": "autopar.verify", "timestamp": now, "host": socket.gethostname(),
                    "model": type(model).__name__, "label": r.label, "origin": r.origin,
                    "chosen": i == report.chosen, "world_size": report.world_size,
                    "decisions": {"pipeline_stages": d.pipeline_stages,
                                  "pipeline_axis": d.pipeline_axis, "schedule": d.schedule,
                                  "virtual_stages": d.virtual_stages,
                                  "micro_batches": d.micro_batches, "zero_stage": d.zero_stage,
                                  "recompute": d.recompute, "zero_kept": d.zero_kept,
                                  "zero_reduce_once": d.zero_reduce_once,
                                  "precision": d.precision,
                                  "layout": s["layout"]},
                    "mesh": r.plan.mesh.to_dict(), "mesh_shape_requested": s["mesh_shape_requested"],
                    "predicted_seconds": r.predicted_seconds, "predicted_breakdown": d.breakdown,
                    "model_flops_per_step": s["model_flops_per_step"],
                    "measured_seconds": r.measured_seconds, "times": r.times,
                    "steps": report.steps, "warmup": report.warmup, **versions()}
            f.write(json.dumps(line) + "\n")


def verify(model: nn.Module, example_inputs: tuple = (), mesh: MeshSpec | str | tuple | None = None,
           *, example_kwargs: dict | None = None, k: int = 5, steps: int = 3, warmup: int = 1,
           optimizer: str = "adamw", candidates: Sequence[Plan] | None = None,
           pick: str = "measured", store: str | Path | None = None, timeout: float = 600.0,
           include: Sequence[Plan] = (), **plan_options) -> VerifyReport:
    """Measure the ``k`` best candidate plans on the live job and pick one; every rank
    calls it (under torchrun, or after ``init_process_group``).

    Each candidate (:func:`shortlist`, or ``candidates``: only rank 0's are used) is
    built by ``auto_parallel`` on a deep copy of ``model`` (``model`` itself is not
    trained) and trained for ``warmup`` + ``steps`` steps with ``optimizer`` (``adamw``,
    ``adam``, ``sgd``, ``sgd_momentum``; also what the plans are priced for); a step's
    time is the slowest rank's, a candidate's the median.  ``pick="measured"`` chooses
    the measured fastest, ``"predicted"`` the predicted fastest (the report still says
    how they measured).  ``store`` appends one JSON line per candidate (rank 0).
    ``plan_options`` go to :func:`autopar.plan` (``pins``, ``memory_budget``,
    ``time_limit``, forced decisions).  Raises :class:`~autopar.errors.ConfigError`
    (a ``ValueError``) for a bad argument, on every rank."""
    for name, value, least in (("k", k, 1), ("steps", steps, 1), ("warmup", warmup, 0)):
        _positive(name, value, least)
    if pick not in PICKS:
        raise ConfigError(f"pick must be one of {', '.join(PICKS)}, got {pick!r}")
    if optimizer not in _OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(_OPTIMIZERS)}, got {optimizer!r}")
    if plan_options.get("batch", "global") != "global":
        raise ConfigError("verify times the global example batch on every rank: plan with "
                          "batch='global' (a local-batch plan runs the same code)")
    example_inputs = tuple(example_inputs)
    join(timeout)
    world = dist.get_world_size()
    sl = _shared(lambda: shortlist(model, example_inputs, mesh, example_kwargs=example_kwargs, k=k,
                                   include=include, candidates=candidates, optimizer=optimizer,
                                   **plan_options), store, timeout)
    if not sl.candidates:
        raise ConfigError("verify has no candidate to measure (candidates=[] was given)")
    for c in sl.candidates:  # the same shared plans on every rank: the same error
        if c.plan.world_size != world or c.plan.decisions.batch != "global":
            raise ConfigError(f"candidate {c.label} ({c.origin}) is for {c.plan.world_size} ranks "
                              f"and batch={c.plan.decisions.batch!r}; this job has {world} "
                              "ranks and verify times the global batch")
    rows = []
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is untouched
        for c in sl.candidates:
            times = _measure(c, model, example_inputs, example_kwargs, steps, warmup,
                             optimizer, timeout)
            rows.append(Row(c.label, c.origin, c.plan.decisions.step_seconds,
                            statistics.median(times), times, c.plan))
    report = VerifyReport(rows, 0, pick, steps, warmup, world, sl.skipped)
    # rows are in predicted order: row 0 is the predicted best; the measured times are
    # every rank's maximum, so the measured choice is the same on every rank too
    report.chosen = report.measured_best if pick == "measured" else 0
    if store is not None and dist.get_rank() == 0:
        _write(store, report, model)
    return report


def verify_plan(plan: Plan, model: nn.Module, example_inputs: tuple = (), **options) -> VerifyReport:
    """:meth:`Plan.verify`: ``plan`` measured beside its best variants on the mesh it
    was asked for, with its pins, memory budget and precision unless ``options`` say
    otherwise."""
    if options.get("candidates") is None:
        options.setdefault("pins", dict(plan.pins) or None)
        options.setdefault("memory_budget", plan.request.memory_budget_bytes or None)
        if plan.decisions.precision != "native":
            options.setdefault("precision", plan.decisions.precision)
    return verify(model, example_inputs, options.pop("mesh", None) or requested_mesh(plan),
                  include=(plan,), **options)


register_reader("verify", verify_plan)


__all__ = ["PICKS", "Candidate", "Row", "Shortlist", "VerifyReport", "candidate_key", "join",
           "label", "requested_mesh", "shortlist", "spearman", "verify", "verify_plan"]
