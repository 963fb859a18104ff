"""The mesh shape searched from a device count (``MeshSpec.preset(name, devices=N)``).

Every factorisation of the count into one or two axes whose node boundaries fall
between groups of an axis (:func:`shape_options`) is a joint search of its own
(:class:`~autopar.search.joint.JointSearch`), all of them sharing one capture of the
model and one shallow copy.  A third level comes from the pipeline split, which the
joint search carves out of either axis.

What a pipeline carved from two axes cannot give is a stage with three axes of its own
(Mist's GPT-22B on 4 nodes of 8: PP2 x DP2 across nodes x FSDP4 x TP2 inside one).  So
three-axis shapes are searched too, for those splits alone (:func:`three_axis_splits`):
``(nodes, b, c)`` with the outer axis the node count and ``b x c`` a node, ``b >= c > 1``,
searched only for pipelines carved from the outer axis that leave more than one node to a
stage (``1 < stages < nodes``).  Nothing else of such a shape can beat the two-axis shapes:

* ``nodes`` stages leave each a ``b x c`` node: exactly the split of the same count from
  the outer axis of the two-axis shape ``(nodes x b, c)``, searched anyway;
* ``(nodes, c, b)`` is ``(nodes, b, c)`` with its two inner axes swapped: both have the
  node's link, so each plan of one is a plan of the other, priced alike but for the order
  of collectives over both axes (GPT-22B's layer: 4x2x4's best PP2 split 7e-6 slower
  than 4x4x2's);
* the plain plan (one stage) and stages carved inside a node are measured, not proven,
  not to win: with them left out the searched plan is still no slower than any named
  shape's full fixed search on the published suites and the Llama cells, the three-axis
  named shapes (2x2x4, 4x2x4, 4x4x2) included (``benchmarks/shape_search_check.py``,
  docs/benchmarks.md).  They are what makes a three-axis shape dear: for Mist's GPT-22B
  they took 33 of the 56 CPU seconds of 4x4x2's full search, its winning split 18.

They are searched after the others (a third round, as round 2 below), and only when the
best plan of the others is a pipeline across nodes (stages from the outer axis): a
three-axis shape refines such a pipeline's stages.  Measured, not proven: with this rule
the searched plan stays no slower than every named shape's own search on the suites and
the Llama cells (docs/benchmarks.md), and skipping them where the others' best has no
pipeline keeps a cheap search cheap (Llama-3 8B on 64 devices: 8.9 CPU seconds, 24.7 with
8x4x2 searched).

Three-axis shapes are left out when the user forces ``pipeline_stages`` or
``pipeline_axis`` (the forced split is the one a fixed shape of the user's would take).

The shapes are searched in two rounds, so the time goes where it can change the answer:

1. **first candidates**: every shape's plain candidate (one stage, one micro-batch; a
   three-axis shape's first split, its most promising micro-batch count), estimated from
   the shallow copy like a fixed shape's.  Each shape starts with the best
   step found so far as its bound, so a split that cannot beat another shape's plan is
   priced no further.
2. **the rest of each shape's search** (pipelines, micro-batches, ZeRO and
   recomputation where memory presses or ``explore`` asks), shapes with the fastest first
   candidate first, the best step found so far carried from shape to shape as the bound.
   A shape is widened when its bound can beat that step: the least
   :meth:`~autopar.search.space.PlanSpace.split_floor` of the splits its widening would
   search (compute and kernel launches alone, in each split's pipeline), the bound its
   own search skips a split by.  So a shape whose plain candidate is slow but whose
   pipeline may win (8x8 for GPT-39B on 64 V100s: 611 s plain, 128 s pipelined) is
   searched, and a shape skipped here could not have won in its own search either.  Each
   widened shape gets an equal share of what is left of the explore budget among the
   shapes still able to beat the best step.  ``explain("mesh")`` gives a skipped shape's
   bound.

The best shape's best split is then planned at full depth, as a fixed shape's search
does.  The budget: the explore rounds get :data:`EXPLORE_SHARE` times ``time_limit``
(a fixed search's explore gets 0.75 of it), the full-depth plan the confirm share a
fixed search gets.  The plan records every shape's best (``plan.decisions.mesh_shapes``)
and ``plan.explain("mesh")`` lists them.
"""

from __future__ import annotations

import dataclasses
import math
import time

from torch import nn

from autopar.capture.trace import Captured
from autopar.cost_models import MeshSpec, format_bytes
from autopar.errors import ConfigError, NoFitError, PlanError
from autopar.log import report, show
from autopar.plans.data import Plan, Request
from autopar.plans.decisions import Decisions, PlanOptions
from autopar.plans.roles import layout
from autopar.search.budget import SHARES, Phase
from autopar.search.joint import JointSearch

__all__ = ["EXPLORE_SHARE", "ShapeSearch", "shape_options", "three_axis_splits"]

EXPLORE_SHARE = 1.5
"""The explore rounds' budget over all shapes, in units of ``time_limit``: twice a fixed
shape's explore share (0.75).  With the one capture shared, the whole search then takes
at most about twice a fixed shape's."""


def _respects_nodes(shape: tuple[int, ...], per_node: int | None) -> bool:
    """Every group of trailing axes lies inside one node or covers whole nodes: the
    product of the axes from each one to the last divides the node or is a multiple of it
    (on 8-device nodes 4x16 does, 16 spanning two nodes; 4x3 does not, a node cutting
    through a group of 3)."""
    if per_node is None:
        return True
    inner = 1
    for size in reversed(shape):
        inner *= size
        if per_node % inner and inner % per_node:
            return False
    return True


def shape_options(mesh: MeshSpec) -> list[tuple[int, ...]]:
    """The shapes of ``mesh.size`` devices the search considers: the count as one axis
    and every ``(n // k, k)``, outer axis across nodes first when it covers whole nodes,
    that respects the nodes (:func:`_respects_nodes`), then the three-axis shapes whose
    stages can keep three axes (module docstring); ConfigError when none does."""
    n, g = mesh.size, mesh.gpus_per_node
    shapes = [(n,)] + [(n // k, k) for k in range(2, n) if n % k == 0]
    if g is not None and n % g == 0:
        shapes += [(n // g, g // c, c) for c in range(g - 1, 1, -1)
                   if g % c == 0 and g // c >= c and three_axis_splits((n // g, g // c, c))]
    ok = [s for s in shapes if _respects_nodes(s, mesh.gpus_per_node)]
    if not ok:
        raise ConfigError(f"{n} devices on nodes of {mesh.gpus_per_node} ({mesh.name}) form no mesh "
                          "whose axes lie inside nodes or cover whole ones: use a multiple of a "
                          "node's devices, or a divisor of it")
    return ok


def three_axis_splits(shape: tuple[int, ...]) -> frozenset[tuple[int, int]]:
    """The (stages, axis) splits searched on a three-axis shape: stages carved from its
    outer axis, more than one and fewer than its size (module docstring)."""
    return frozenset((p, 0) for p in range(2, shape[0]) if shape[0] % p == 0)


@dataclasses.dataclass(frozen=True)
class ShapeResult:
    """One mesh shape's best plan as the search priced it (``estimated``: from the shallow
    copy, as every split but the chosen one is)."""

    shape: tuple[int, ...]
    step_seconds: float  # math.inf: no plan fits, or none can beat the best shape's
    memory: float  # bytes per device of that plan (the leanest need when none fits)
    layout: str
    estimated: bool
    note: str = ""

    def to_dict(self) -> dict:
        """JSON form (``plan.decisions.mesh_shapes``); an infinite step is ``None``."""
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["step_seconds"] = self.step_seconds if math.isfinite(self.step_seconds) else None
        return d


class ShapeSearch:
    """The shape search of one model and call on ``mesh.size`` devices (module docstring);
    ``run()`` returns (capture, plan) as :meth:`JointSearch.run` does."""

    def __init__(self, model: nn.Module, example_inputs: tuple, mesh: MeshSpec, opts: PlanOptions,
                 example_kwargs: dict | None = None, base: JointSearch | None = None,
                 explore_share: float = EXPLORE_SHARE) -> None:
        """``base``: a search of the same model whose captures to share (another device
        count's, for a scaling curve); ``explore_share``: rounds 1 and 2's budget in
        units of ``time_limit``."""
        self.explore_share = explore_share
        self.model, self.inputs, self.opts, self.kwargs = model, example_inputs, opts, example_kwargs
        self.base = base
        self.mesh = mesh
        forced = opts.pipeline_stages is not None or opts.pipeline_axis is not None
        self.shapes = [s for s in shape_options(mesh) if len(s) < 3 or not forced]
        self.searches: dict[tuple[int, ...], JointSearch] = {}
        self.errors: dict[tuple[int, ...], Exception] = {}
        self.firsts: dict[tuple[int, ...], tuple[int, int, int]] = {}
        self.first_steps: dict[tuple[int, ...], float] = {}  # each shape's first candidate
        # shapes not widened: (the least floor of their other splits, the best step then)
        self.unwidened: dict[tuple[int, ...], tuple[float, float]] = {}

    def _bound(self) -> float:
        return min((self._step(s) for s in self.searches), default=math.inf)

    def _step(self, shape: tuple[int, ...]) -> float:
        best = self.searches[shape].best()
        return best[1].step_seconds if best is not None else math.inf

    def _start(self, shape: tuple[int, ...]) -> None:
        """Round 1 for one shape: its search, sharing the first one's captures."""
        try:
            js = JointSearch(self.model, self.inputs, self.mesh.with_shape(shape), self.opts, self.kwargs)
            if len(shape) == 3:
                js.space.only = three_axis_splits(shape)
            if self.searches or self.base is not None:
                js.share(next(iter(self.searches.values())) if self.searches else self.base)
            js.incumbent = self._bound()
            self.firsts[shape] = js.begin()
        except (PlanError, ConfigError) as e:  # e.g. a forced split this shape cannot hold
            self.errors[shape] = e
            report(f"mesh {_words(shape)}: skipped ({e})", done=True)
            return
        self.searches[shape] = js
        report(f"mesh {_words(shape)}: first candidate {_ms(self._step(shape))}", done=True)

    def run(self) -> tuple[Captured, Plan]:
        """Search every shape (module docstring) and return the best one's plan."""
        with show(bool(self.opts.progress), (self.explore_share + SHARES[Phase.CONFIRM]) * self.opts.time_limit):
            return self._run()

    def _run(self) -> tuple[Captured, Plan]:
        t0 = time.perf_counter()
        self._explore(t0)
        cap, plan, shape = self._finish(t0)
        self._record(plan, shape, time.perf_counter() - t0)
        return cap, plan

    def explore(self) -> list[ShapeResult]:
        """Rounds 1 and 2 only: every shape's best, fastest first, as estimated (nothing
        planned at full depth: what a scaling curve reads)."""
        self._explore(time.perf_counter())
        return sorted((self.result(s) for s in self.shapes),
                      key=lambda r: (r.step_seconds, self.shapes.index(r.shape)))

    def _explore(self, t0: float) -> None:
        for shape in self.shapes:
            if len(shape) < 3:
                self._start(shape)
        if not self.searches:
            raise next(iter(self.errors.values()))
        # round 2's captures are charged: a split whose shallow estimate fails is captured
        # at full depth (13 s for Llama-3 70B), and uncharged they tripled this round's time
        total = self.explore_share * self.opts.time_limit
        first_captures = self._captured()
        self._widen(list(self.searches), t0, total - first_captures)
        # round 3: the three-axis shapes refine a pipeline across nodes (module docstring)
        best = min((js.best() for js in self.searches.values() if js.best() is not None),
                   key=lambda b: b[1].step_seconds, default=None)
        across = best is not None and best[0].stages > 1 and best[0].axis == 0
        three = [s for s in self.shapes if len(s) == 3]
        for shape in three:
            if across:
                self._start(shape)
            else:
                self.errors[shape] = PlanError("the best plan of the other shapes has no pipeline across nodes")
        self._widen([s for s in three if s in self.searches], t0, total - first_captures)

    def _widen(self, shapes: list[tuple[int, ...]], t0: float, total: float) -> None:
        """Round 2 over ``shapes``: the fastest first candidates first, so the bound falls
        early; ``total``: the explore rounds' budget from ``t0``."""
        self.first_steps.update({s: self._step(s) for s in shapes})
        floors = {s: self.searches[s].rest_floor(self.firsts[s]) for s in shapes}
        order = sorted(shapes, key=lambda s: (self.first_steps[s], self.shapes.index(s)))
        for k, shape in enumerate(order):
            bar = self._bound()
            # the best step only falls: a shape whose floor is over it now stays over it
            live = [s for s in order[k:] if floors[s] <= bar * (1.0 + 1e-9)]
            if shape not in live:
                if math.isfinite(floors[shape]):  # (infinite: nothing to widen, as alone)
                    self.unwidened[shape] = (floors[shape], bar)
                continue
            js = self.searches[shape]
            js.incumbent = bar
            js.widen(self.firsts[shape], max(0.0, total - (time.perf_counter() - t0)) / len(live))

    def _captured(self) -> float:
        return sum(js.uncharged() for js in self.searches.values())

    def _finish(self, t0: float) -> tuple[Captured, Plan, tuple[int, ...]]:
        """The best shape's best split at full depth; when that comes out slower than
        another shape's estimate, that one too, until the best stands.  When no shape has
        a plan that fits, each shape's memory-lean placements, leanest need first."""
        confirm = SHARES[Phase.CONFIRM] * self.opts.time_limit
        done: dict[tuple[int, ...], tuple[Captured, Plan] | PlanError] = {}
        while True:
            left = [s for s in self.searches if s not in done]
            fits = [s for s in left if math.isfinite(self._step(s))]
            pool = fits or left
            if not pool:
                break
            shape = min(pool, key=lambda s: (self._step(s), self._need(s), self.shapes.index(s)))
            best_done = min((r[1].decisions.step_seconds for r in done.values() if not isinstance(r, Exception)),
                            default=math.inf)
            if fits and best_done <= self._step(shape) * (1 + 1e-9):
                break  # no estimate left beats a plan in hand
            if not fits and best_done < math.inf:
                break  # the lean re-plans: the first shape that fits
            try:
                done[shape] = self.searches[shape].finish(t0, confirm)
            except PlanError as e:
                done[shape] = e
        plans = {s: r for s, r in done.items() if not isinstance(r, Exception)}
        if not plans:
            need = min((self._need(s) for s in self.searches), default=math.inf)
            raise NoFitError(f"no plan fits the memory budget of {format_bytes(self.opts.budget_for(self.mesh))} "
                            f"per device on any mesh shape of {self.mesh.size} devices "
                            f"({', '.join(_words(s) for s in self.shapes)}): the leanest plan found "
                            f"(ZeRO-3, recomputation, pipelining and micro-batches considered) needs "
                            f"{format_bytes(need)} per device")
        shape = min(plans, key=lambda s: (plans[s][1].decisions.step_seconds, self.shapes.index(s)))
        return plans[shape][0], plans[shape][1], shape

    def _need(self, shape: tuple[int, ...]) -> float:
        return min((p.min_memory for _, p in self.searches[shape].priced), default=math.inf)

    def result(self, shape: tuple[int, ...]) -> ShapeResult:
        """``shape``'s best plan as searched so far (estimated where its split was), or
        why it has none."""
        if shape in self.errors:
            return ShapeResult(shape, math.inf, 0.0, "", False, f"not searched: {self.errors[shape]}")
        js = self.searches[shape]
        best = js.best()
        if best is None:
            bounded = any(p.bound is not None for _, p in js.priced)
            note = "no split can beat the best shape" if bounded and not any(
                math.isfinite(p.min_memory) for _, p in js.priced) else \
                f"no plan fits: the leanest needs {format_bytes(self._need(shape))}"
            note = self._unwidened_note(shape) or note
            need = self._need(shape)  # infinite when every split was bounded before pricing
            return ShapeResult(shape, math.inf, need if math.isfinite(need) else 0.0, "", False, note)
        cand, pr = best
        cfg = pr.config
        sketch = dataclasses.replace(
            cand.plan, request=Request(mesh_shape=list(shape)),
            decisions=Decisions(pipeline_stages=cfg.stages, pipeline_axis=cand.axis if cfg.stages > 1 else 0,
                                schedule=cfg.schedule, micro_batches=cfg.micro_batches,
                                virtual_stages=cfg.virtual, zero_stage=cfg.zero_stage,
                                zero_axis=list(cfg.zero_axis) if isinstance(cfg.zero_axis, tuple)
                                else cfg.zero_axis))
        recompute = sum(len(sp.recompute) for sp in pr.stages)
        words = layout(sketch) + (f", {recompute} layer(s) recomputed" if recompute else "")
        if cfg.micro_batches > 1 and cfg.stages == 1:
            words += f", {cfg.micro_batches} micro-batches"
        bounded = sum(1 for _, p in js.priced if p.bound is not None)
        note = self._unwidened_note(shape) or (
            f"{bounded} more config(s) bounded above the best step" if bounded else "")
        return ShapeResult(shape, pr.step_seconds, max(sp.total_memory for sp in pr.stages), words,
                           cand.estimate, note)

    def _unwidened_note(self, shape: tuple[int, ...]) -> str:
        """Why ``shape`` kept its first candidate, or "" when it was widened."""
        if shape not in self.unwidened:
            return ""
        floor, bar = self.unwidened[shape]
        return (f"first candidate only: its other splits take at least {_ms(floor)} "
                f"(compute and kernel launches), over the best step then, {_ms(bar)}")

    def _record(self, plan: Plan, shape: tuple[int, ...], seconds: float) -> None:
        """Every shape's best on the plan, and the reason in ``why["mesh"]``."""
        results = [self.result(s) for s in self.shapes]
        for i, r in enumerate(results):
            if r.shape == shape:  # the chosen shape: as planned at full depth
                results[i] = dataclasses.replace(
                    r, step_seconds=plan.decisions.step_seconds, memory=plan.memory.get("total", r.memory),
                    estimated=False, note="chosen")
        results.sort(key=lambda r: (r.step_seconds, self.shapes.index(r.shape)))
        plan.decisions.mesh_shapes = [r.to_dict() for r in results]
        runner = next((r for r in results if r.shape != shape and math.isfinite(r.step_seconds)), None)
        why = f"mesh {_words(shape)} of the {len(self.shapes)} shapes of {self.mesh.size} devices searched"
        if runner is not None:
            why += (f": the next best, {_words(runner.shape)}, is predicted "
                    f"{runner.step_seconds / plan.decisions.step_seconds:.3f}x its step")
        plan.decisions.why["mesh"] = why + "\n" + shape_table(plan.decisions.mesh_shapes)
        plan.timings["mesh_search"] = seconds
        plan.timings["capture"] = self._captured()


def shape_table(rows: list[dict]) -> str:
    """``plan.decisions.mesh_shapes`` as aligned lines: shape, predicted step (``est.``:
    estimated from the shallow copy), memory per device, layout or why none."""
    lines = []
    for r in rows:
        step = r["step_seconds"]
        what = r["layout"] + (f" ({r['note']})" if r["note"] else "") if r["layout"] else r["note"]
        est = " est." if r["estimated"] else ""
        lines.append(f"  {_words(tuple(r['shape'])):>9}  {_ms(step if step is not None else math.inf):>10}{est:5}"
                     f"  {format_bytes(r['memory']) if r['memory'] else '-':>10}  {what}")
    return "\n".join(lines)


def _words(shape: tuple[int, ...]) -> str:
    return "x".join(str(n) for n in shape)


def _ms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.3f} ms"
