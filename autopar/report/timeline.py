"""Pictures of the predicted step: a timeline PNG and a Chrome/Perfetto trace.

:func:`predicted_events` lays one training step out per pipeline stage (a device
group: the ranks of one stage's sub-mesh) from the plan's own prices
(``plan.decisions.stage_seconds`` and ``stage_parts``):

* each micro-batch's forward and backward on the stage's *compute* lane, in the
  schedule's order (:mod:`autopar.plans.schedules`: no pipeline: back to back, i.e. gradient
  accumulation; GPipe: all forwards then all backwards; 1F1B: ``p - s - 1`` warm-up
  forwards, then one forward / one backward; interleaved: ``v`` chunks per stage, each
  a ``v``-th of its time), started when the stage is free and its inputs have arrived
  (the previous stage's forward, the next stage's backward);
* the communication inside them (the ops' collectives, ZeRO-3 gathers, pipeline
  sends: the cost model runs them in line with compute, so they are drawn as the end
  of each box, on the *comm* lane);
* after the stage's last backward, the gradient reduction left exposed and ZeRO-1/2's
  parameter all-gather (in chunks: the forward's waits for them, and the rest beside
  the first forward); the reduction hidden under backward is drawn on the comm lane
  overlapping the last backward;
* idle time on the compute lane as *bubble* events.

The forward share of a stage's time is the cost model's: a third of its compute and
half its communication (backward costs twice the forward; recomputation is in the
backward).  The optimizer step and the runtime's copies come after the last backward.
Without a pipeline, or with stages of equal time, the last event ends at
``plan.decisions.step_seconds``.  With unequal stages the search's formula (all stages'
time plus ``m - 1`` times the slowest) and this dependency-driven layout differ a little
either way (1F1B's layout is usually shorter; GPipe's can be longer, as the slowest
forward and the slowest backward need not be on one stage), and the picture states both.

:func:`draw_timeline` writes the PNG (matplotlib), :func:`write_trace` the same
events as Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing;
``pm.trace`` records the real step in the same format, see :mod:`autopar.runtime.trace`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.plans.kinds import Schedule
from autopar.plans.roles import layout
from autopar.plans.schedules import Action, list_schedule
from autopar.plans.splits import plan_ranks

if TYPE_CHECKING:
    from autopar.plans.data import Plan


class Kind(StrEnum):
    """What an event is."""

    FORWARD = "forward"
    BACKWARD = "backward"
    COMM = "comm"
    GRAD_SYNC = "grad sync"
    GRAD_SYNC_HIDDEN = "grad sync (hidden)"
    PARAM_GATHER = "param all-gather"
    PARAM_GATHER_HIDDEN = "param all-gather (hidden)"
    OPTIMIZER = "optimizer step"
    COPY = "copies"
    BUBBLE = "bubble"


class Lane(StrEnum):
    """The two rows of a stage: compute and communication."""

    COMPUTE = "compute"
    COMM = "comm"


@dataclass(frozen=True)
class Event:
    """One box of the timeline: ``start`` and ``duration`` in seconds from the step's
    start; ``micro`` is the micro-batch (-1 for per-step events)."""

    stage: int
    lane: Lane
    kind: Kind
    start: float
    duration: float
    micro: int = -1
    label: str = ""

    @property
    def end(self) -> float:
        """``start + duration``."""
        return self.start + self.duration


def _stage_times(plan: Plan) -> list[tuple[float, float, float, float, dict]]:
    """Per stage: forward, backward, forward comm, backward comm (seconds per
    micro-batch) and its parts."""
    d = plan.decisions
    secs = d.stage_seconds or [plan.objective]
    parts = d.stage_parts or [{"compute": plan.compute_seconds,
                               "comm": max(0.0, plan.objective - plan.compute_seconds)}] * len(secs)
    out = []
    for t, p in zip(secs, parts):
        comm = p.get("comm", 0.0)
        fwd = p.get("compute", 0.0) / 3.0 + comm / 2.0
        out.append((fwd, max(0.0, t - fwd), comm / 2.0, comm / 2.0, p))
    return out


def predicted_events(plan: Plan) -> list[Event]:
    """The predicted step as events (see the module docstring), sorted by stage, lane
    and start."""
    d = plan.decisions
    times = _stage_times(plan)
    p, m = len(times), max(1, d.micro_batches)
    v = max(1, d.virtual_stages)
    events: list[Event] = []

    # zero-bubble splits each backward into B and W, half each (search/stages/pipeline_step.py)
    halves = 2.0 if d.schedule == Schedule.ZERO_BUBBLE.value else 1.0

    def duration(s: int, a: Action) -> float:
        # a rank's v chunks share its per-micro-batch time equally
        fwd, bwd, _, _, _ = times[s]
        return (fwd if a.op == "F" else bwd / halves) / v

    schedule = d.schedule if p > 1 else Schedule.NONE.value
    free = [0.0] * p
    for t in list_schedule(schedule, p, m, v, duration):
        a, s = t.action, t.stage
        _, _, cf, cb, _ = times[s]
        comm = (cf if a.op == "F" else cb / halves) / v
        kind = Kind.FORWARD if a.op == "F" else Kind.BACKWARD
        # multi-copy: the micro-batches are copies run interleaved (decision copies)
        label = (f"{a.op} copy {a.micro}" if d.copies > 1 else f"{a.op}{a.micro}") + \
            (f".{a.chunk}" if v > 1 else "")
        events.append(Event(s, Lane.COMPUTE, kind, t.start, t.end - t.start - comm, a.micro, label))
        if comm > 0:
            events.append(Event(s, Lane.COMM, Kind.COMM, t.end - comm, comm, a.micro,
                                f"{label} comm"))
        free[s] = t.end
    # compressed buckets say how they cross (decision grad_compression)
    how = {"bf16": " (bf16)", "powersgd": f" (PowerSGD r{d.compression_rank})"}.get(d.grad_compression, "")
    for s, (_, bwd, _, cb, parts) in enumerate(times):
        end = free[s]
        hidden = max(0.0, parts.get("sync", 0.0) - parts.get("sync_exposed", 0.0))
        if hidden > 0:  # under the last backward's compute (its own comm comes after)
            span = min(hidden, bwd - cb)
            events.append(Event(s, Lane.COMM, Kind.GRAD_SYNC_HIDDEN, max(0.0, end - cb - span),
                                span, label=f"grad reduce{how} (overlapped)"))
        exposed = parts.get("sync_exposed", 0.0)
        if exposed > 0:
            events.append(Event(s, Lane.COMM, Kind.GRAD_SYNC, end, exposed, label=f"grad reduce{how}"))
            end += exposed
        opt = parts.get("optimizer_step", 0.0)
        host = parts.get("host_optimizer_step", 0.0)
        if opt > 0 and host > 0:  # offload: gradients down, the host's step, parameters up
            moved = max(0.0, opt - host)
            events.append(Event(s, Lane.COMPUTE, Kind.OPTIMIZER, end, host, label="optimizer step (host)"))
            if moved > 0:
                events.append(Event(s, Lane.COMM, Kind.COPY, end + host, moved,
                                    label="host copies (gradients down, parameters up)"))
            end += host + moved
        elif opt > 0:  # updates the reduced gradients' shards; ZeRO-1/2 then gathers them
            events.append(Event(s, Lane.COMPUTE, Kind.OPTIMIZER, end, opt, label="optimizer step"))
            end += opt
        gather = parts.get("gather_step", 0.0)
        chunked = bool(d.gather_chunks)  # the next forward's waits for its chunks
        if gather > 0:
            events.append(Event(s, Lane.COMM, Kind.PARAM_GATHER, end, gather,
                                label="ZeRO param all-gather" + (" (chunks: the forward's waits)" if chunked else "")))
            end += gather
        hidden_gather = parts.get("gather_hidden", 0.0)
        if chunked and hidden_gather > 0:  # the chunks that arrive while the forward computes
            events.append(Event(s, Lane.COMM, Kind.PARAM_GATHER_HIDDEN, 0.0, min(hidden_gather, times[s][0]),
                                label="ZeRO param chunks (overlapped with the forward)"))
        copies = parts.get("copy_step", 0.0)
        if copies > 0:  # gradients into their buckets, ZeRO-1/2's flat layouts
            events.append(Event(s, Lane.COMPUTE, Kind.COPY, end, copies, label="runtime copies"))
    last = max(e.end for e in events)
    for s in range(p):
        busy = sorted((e.start, e.end) for e in events if e.stage == s and
                      (e.lane == Lane.COMPUTE or e.kind in (Kind.COMM, Kind.GRAD_SYNC)))
        t = 0.0
        for a, b in busy:
            if a - t > 1e-12 * max(last, 1e-30):
                events.append(Event(s, Lane.COMPUTE, Kind.BUBBLE, t, a - t, label="idle"))
            t = max(t, b)
    return sorted(events, key=lambda e: (e.stage, e.lane != Lane.COMPUTE, e.start))


def step_end(events: list[Event]) -> float:
    """When the last event ends (seconds)."""
    return max((e.end for e in events), default=0.0)


def _stage_label(plan: Plan, s: int) -> str:
    mine = sorted(int(r) for r in plan_ranks(plan)[s].flatten())
    if len(mine) == 1:
        ranks = f"rank {mine[0]}"
    elif mine == list(range(mine[0], mine[-1] + 1)):
        ranks = f"ranks {mine[0]}-{mine[-1]}"
    else:  # stages carved inside a node: a stride through every node
        ranks = "ranks " + ", ".join(map(str, mine))
    return f"stage {s} ({ranks})" if plan.decisions.pipeline_stages > 1 else ranks


def chrome_trace(plan: Plan) -> dict:
    """The predicted step as Chrome trace-event JSON: a process per stage, a thread
    per lane, complete ("X") events in microseconds."""
    events = predicted_events(plan)
    out: list[dict] = []
    for s in sorted({e.stage for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": s, "tid": 0,
                    "args": {"name": _stage_label(plan, s) + " (predicted)"}})
        for tid, lane in enumerate(Lane):
            out.append({"ph": "M", "name": "thread_name", "pid": s, "tid": tid,
                        "args": {"name": lane.value}})
    lanes = {lane: i for i, lane in enumerate(Lane)}
    for e in events:
        out.append({"ph": "X", "name": e.label or e.kind.value, "cat": e.kind.value, "pid": e.stage,
                    "tid": lanes[e.lane], "ts": e.start * 1e6, "dur": e.duration * 1e6,
                    "args": {k: v for k, v in asdict(e).items() if k in ("micro", "kind")}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"source": "autopar predicted step",
                          "step_seconds": plan.decisions.step_seconds or plan.objective}}


def write_trace(plan: Plan, path: str | Path) -> Path:
    """Write :func:`chrome_trace` to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(plan)))
    return path


_COLOURS = {Kind.FORWARD: "#4c72b0", Kind.BACKWARD: "#dd8452", Kind.COMM: "#c44e52",
            Kind.GRAD_SYNC: "#8172b3", Kind.GRAD_SYNC_HIDDEN: "#b8acd9",
            Kind.PARAM_GATHER: "#937860", Kind.PARAM_GATHER_HIDDEN: "#c9b8a6", Kind.OPTIMIZER: "#da8bc3", Kind.COPY: "#8c8c8c",
            Kind.BUBBLE: "#eeeeee"}


def draw_timeline(plan: Plan, path: str | Path, title: str | None = None) -> Path:
    """Draw :func:`predicted_events` as a PNG (one compute and one comm row per stage,
    bubbles hatched, micro-batch numbers on the boxes wide enough to hold them)."""
    try:
        import matplotlib  # start-up: matplotlib costs ~1.2 s to import
    except ImportError as e:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("draw_timeline needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # start-up: matplotlib costs ~1.2 s to import
    from matplotlib.patches import Patch  # start-up: matplotlib costs ~1.2 s to import

    events = predicted_events(plan)
    stages = sorted({e.stage for e in events})
    end = step_end(events)
    fig, ax = plt.subplots(figsize=(12, max(3.0, 1.6 + 0.9 * len(stages))), dpi=120)
    rows: dict[tuple[int, Lane], float] = {}
    ticks, names = [], []
    for s in stages:
        base = (len(stages) - 1 - s) * 2.2
        rows[(s, Lane.COMPUTE)], rows[(s, Lane.COMM)] = base + 1.0, base
        ticks += [base + 1.4, base + 0.4]
        names += [f"{_stage_label(plan, s)}  compute", "comm"]
    ms = 1e3
    for e in events:
        y = rows[(e.stage, e.lane)]
        ax.broken_barh([(e.start * ms, e.duration * ms)], (y, 0.8), facecolors=_COLOURS[e.kind],
                       edgecolor="white" if e.kind != Kind.BUBBLE else "#999999", linewidth=0.5,
                       hatch="//" if e.kind == Kind.BUBBLE else None)
        if e.micro >= 0 and e.lane == Lane.COMPUTE and e.duration > end * 0.025:
            ax.text((e.start + e.duration / 2) * ms, y + 0.4, str(e.micro), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(ticks, names, fontsize=8)
    ax.set_xlabel("ms (predicted)")
    ax.set_xlim(0, end * ms * 1.01)
    step = plan.decisions.step_seconds or plan.objective
    ax.set_title(title or f"{layout(plan)}\npredicted step {step * ms:.3g} ms (search's formula); "
                 f"this layout ends at {end * ms:.3g} ms", fontsize=9)
    used = [k for k in Kind if any(e.kind == k for e in events)]
    fig.legend(handles=[Patch(facecolor=_COLOURS[k], hatch="//" if k == Kind.BUBBLE else None,
                              edgecolor="#999999", label=k.value) for k in used],
               loc="lower center", ncol=len(used), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # the bottom strip holds the legend
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["Event", "Kind", "Lane", "chrome_trace", "draw_timeline", "predicted_events",
           "step_end", "write_trace"]
