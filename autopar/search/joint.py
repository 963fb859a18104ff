"""The joint search: placements, pipeline stages, micro-batches (gradient
accumulation), ZeRO stage and recomputation chosen for one objective (step time)
under one memory model.

For each candidate (pipeline stages ``p`` carved from one mesh axis, micro-batches ``M``)
the model is captured at the micro-batch size and the intra-op search (ILP or D-Rec, :mod:`autopar.search.op_placement`)
places every op on the stage sub-mesh; :mod:`autopar.search.stages` then prices every
schedule x ZeRO stage x ZeRO axis on that plan, choosing stage boundaries and the
recomputed layers so each stage fits the budget.  The fastest feasible combination
wins.  The plain plan (one stage, one micro-batch) is searched first; pipelines and
micro-batches are explored when it needs ZeRO or recomputation to fit (or does not fit
at all), when asked (``explore``), or when forced.  If no placement fits even then, the intra-op search is re-run with the
budget binding (memory-lean placements) before giving up with the memory the best
plan needs.
"""

from __future__ import annotations

import dataclasses
import math
import time

from torch import nn

from autopar.capture.trace import Captured
from autopar.cost_models import MeshSpec, format_bytes
from autopar.errors import NoFitError, PlanError
from autopar.log import report, show
from autopar.plans.data import Plan, zero_words
from autopar.plans.decisions import PlanOptions
from autopar.plans.kinds import Schedule
from autopar.plans.splits import split_mesh, split_words
from autopar.search.budget import Phase, TimeBudget
from autopar.search.captures import Captures
from autopar.search.forced import check_forced
from autopar.search.fusion import fuse
from autopar.search.op_placement import make_weighted_plans
from autopar.search.plan_record import recorded
from autopar.search.shallow import (
    KEEP,
    deepen,
    extrapolate_blocks,
    steady,
)
from autopar.search.space import PlanSpace, _Candidate, tied_across_layers
from autopar.search.stages.layer_stats import layer_stats
from autopar.search.stages.pipeline_step import price, step_lower_bound
from autopar.search.stages.priced import Config, Priced
from autopar.search.stages.step_terms import stage_link


class JointSearch:
    """One joint search (see the module docstring); ``run()`` returns (capture, plan).
    It holds the model's captures (:class:`~autopar.search.captures.Captures`) and the
    plan space (:class:`~autopar.search.space.PlanSpace`), and passes each what it reads
    of the search."""

    def __init__(self, model: nn.Module, example_inputs: tuple, mesh: MeshSpec, opts: PlanOptions,
                 example_kwargs: dict | None = None) -> None:
        self.model, self.inputs, self.mesh, self.opts = model, tuple(example_inputs), mesh, opts
        self.kwargs = example_kwargs  # _call: one pytree (model(**batch) has no positional input)
        self._call = (self.inputs, dict(example_kwargs or {}))
        self.budget = opts.budget_for(mesh)
        self.timings: dict[str, float] = {}
        self.captures = Captures(model, self._call, opts, self.timings)
        self.space = PlanSpace(mesh, opts, self._call)
        self.priced: list[tuple[_Candidate, Priced]] = []
        # best()'s answer so far, per ``exact``: (the list it read, how much of it, best, its key)
        self._best_seen: dict[bool, tuple[list, int, tuple | None, tuple | None]] = {}
        self._mismatch = False  # a confirmed split priced otherwise than its estimate
        # the best step another search found (autopar/search/mesh_shapes.py: another mesh
        # shape's): a split or config bounded above it cannot win here either
        self.incumbent = math.inf
        # time_limit split among the search's phases (autopar/search/budget.py); one per pass of _run
        self._clock = TimeBudget(opts.time_limit, self.uncharged)
        self._stopped: set[Phase] = set()  # phases that ran out of their share
        check_forced(self.opts, self.mesh)  # forced decisions that cannot mean anything: errors

    # ------------------------------------------------------------ candidates
    def _intra(self, stages: int, micro: int, budget: float | None,
               estimate: bool = False, weights: tuple[float, ...] | None = None,
               axis: int = 0) -> list[_Candidate]:
        """The intra-op plans of one (stages, micro-batches) split: the ILP's, and those it
        finds with gradient sync charged at a fraction of its price where they differ
        (:func:`autopar.search.op_placement.make_weighted_plans`); the step model picks among them.
        ``estimate``: on the shallow copy, its layers extrapolated to full depth;
        ``weights``: only those sync weights' plans; ``axis``: the mesh axis the stages
        are carved from."""
        full, sub = split_mesh(self.mesh, stages, axis)
        estimate = estimate and self.captures.shallow is not None  # the copy may have been dropped
        if estimate:
            try:
                cap = self.captures.at(micro, shallow=True)
            except Exception as e:  # noqa: BLE001 - a copy that will not capture: go deep
                self._say(f"the {KEEP}-layer copy did not capture ({type(e).__name__}): "
                          "planning every split at full depth")
                self.captures.shallow, estimate = None, False
        if not estimate:
            cap = self.captures.at(micro)
        t0 = time.perf_counter()
        # an estimate's plan is never returned: its solver gets what its phase has left;
        # an exact one's may be (nothing estimated): it gets what the whole budget has
        left = self._clock.left() if estimate else self._clock.left_total()
        report(f"placing ops for {split_words(stages, axis)} x {micro} micro-batch(es) on sub-mesh "
               f"{'x'.join(map(str, sub.shape))}")
        intra_opts = dataclasses.replace(self.opts, memory_budget=budget, time_limit=max(1.0, left),
                                         choose_limit=self.opts.time_limit)
        # without per-node details: only the chosen plan is shown and lowered (plan_record.recorded)
        plans = make_weighted_plans(cap.gm, sub, cap.aliases, intra_opts, sync_variants=True,
                                    weights=weights, detail=False)
        fusion = fuse(cap.gm) if self.opts.compile else None  # the kernels compiled, as priced
        self.timings["intra_op"] = self.timings.get("intra_op", 0.0) + time.perf_counter() - t0
        out = []
        if estimate and plans and not steady(layer_stats(cap.gm, plans[0][1], fusion=fusion)):
            # this split's copy placed its middle layers differently: nothing to
            # extrapolate from, so this split is planned at full depth; the others keep
            # their estimates, each checked the same way (a full-depth capture of a large
            # model takes seconds, so only the split that needs one pays it)
            self._say(f"the {KEEP}-layer copy's layers differ for {split_words(stages, axis)} x "
                      f"{micro} micro-batch(es): planning this split at full depth")
            return self._intra(stages, micro, budget, False, weights, axis)
        for w, p in plans:
            stats = layer_stats(cap.gm, p, fusion=fusion)
            if self.opts.blocks is not None:
                stats = extrapolate_blocks(stats, self.opts.blocks)
            elif estimate:
                stats = deepen(stats, self.captures.shallow[2], self.captures.shallow[1])
            out.append(_Candidate(stages, micro, cap, p, stats, full, estimate, w, axis))
        return out

    def _price(self, cand: _Candidate) -> None:
        link = stage_link(cand.full, cand.stages)
        best = self.best()
        cut = min(best[1].step_seconds if best is not None else math.inf, self.incumbent)
        for cfg in self.space.configs(cand):
            if cand.stages > 1:
                # a pipeline's split search is O(stages x layers^2) per config (80 layers
                # on 48 stages: ~1 s): a config whose lower bound is already slower than
                # a plan in hand cannot win and is only bounded
                lb = step_lower_bound(cand.stats, cfg, cand.plan.mesh, link, self.opts.optimizer)
                if lb > cut * (1.0 + 1e-9):
                    self.priced.append((cand, Priced(cfg, [], math.inf, math.inf, bound=lb)))
                    continue
            # the split search drops partial splits that cannot beat the plan in hand and
            # reports the config bounded when no split can (a config within the cut is
            # priced as without it).  Not on one stage: the plain candidate's configs all
            # priced say whether it fits without ZeRO or recomputation (_fits_plainly)
            pr = price(cand.stats, cfg, cand.plan.mesh, link, self.budget, self.opts.optimizer,
                       cut if cand.stages > 1 else math.inf)
            self.priced.append((cand, pr))
            if pr.feasible:
                cut = min(cut, pr.step_seconds)

    def best(self, exact: bool = False) -> tuple[_Candidate, Priced] | None:
        """The fastest feasible config (``exact``: among those priced at full depth);
        on ties the first of the simplest (fewer stages, micro-batches, lower ZeRO).
        ``self.priced`` only grows between its reassignments, so the search asked so far
        is carried on from where it stopped (it is asked before every candidate, and a
        deep model's search prices thousands of configs)."""
        seen = self._best_seen.get(exact)
        start, best, best_key = 0, None, None
        if seen is not None and seen[0] is self.priced and seen[1] <= len(self.priced):
            _, start, best, best_key = seen
        for cp in self.priced[start:]:
            c, p = cp
            if not p.feasible or (exact and c.estimate):
                continue
            key = (round(p.step_seconds, 12), p.config.stages, p.config.pipeline_axis,
                   p.config.micro_batches, p.config.zero_stage)
            if best_key is None or key < best_key:  # strict: the first of equals stays
                best, best_key = cp, key
        self._best_seen[exact] = (self.priced, len(self.priced), best, best_key)
        return best

    # ------------------------------------------------------------ search
    def _say(self, msg: str) -> None:
        """One finished step for the progress display and the log (:mod:`autopar.log`)."""
        report(msg, done=True)

    def uncharged(self) -> float:
        """Seconds not charged to the time limit: capture and annotation (they depend on
        the model and the machine's load, not on the search)."""
        return self.timings.get("capture", 0.0) + self.timings.get("annotate", 0.0)

    def _out_of_time(self) -> bool:
        """The current phase has spent its share of ``time_limit`` (:mod:`autopar.search.budget`):
        its remaining candidates are skipped and the plan says so."""
        if not self._clock.over():
            return False
        if self._clock.phase not in self._stopped:
            self._stopped.add(self._clock.phase)
            self._say(f"{self._clock.phase} budget of {self._clock.allowance(self._clock.phase):.1f} s spent: "
                      "keeping the best plan found so far")
        return True

    def _try(self, stages: int, micro: int, budget: float | None, strict: bool = False,
             estimate: bool = False, force: bool = False,
             weights: tuple[float, ...] | None = None, axis: int = 0) -> None:
        """Plan and price one candidate. ``strict``: the candidate the user asked for
        (or the plain one), whose errors (bad pins, ...) are the user's and propagate;
        a candidate the search picked is skipped when, e.g., a pin cannot hold at its
        micro-batch size.  ``estimate``: from the shallow copy (cheap; not a plan).
        ``force``: even when the time limit is spent; ``weights``: only those sync weights'
        placements (:func:`autopar.search.op_placement.make_weighted_plans`); ``axis``: the mesh axis
        the stages are carved from."""
        if self._out_of_time() and not force:
            return
        if not force and self._bounded(stages, micro, estimate, axis):
            return
        where = split_words(stages, axis, "stages")
        t0 = time.perf_counter()
        lean = budget is not None and math.isfinite(budget)
        try:
            cands = self._intra(stages, micro, budget, estimate, weights, axis)
        except PlanError as e:
            if strict:
                raise
            self._say(f"{where}, micro-batches {micro}: skipped ({e})")
            return
        n = len(self.priced)
        for cand in cands:
            self._price(cand)
        ok = [p for _, p in self.priced[n:] if p.feasible]
        bounded = sum(1 for _, p in self.priced[n:] if p.bound is not None)
        best = min((p.step_seconds for p in ok), default=math.inf)
        self._say(f"{where}, micro-batches {micro}"
                  + (", memory-lean placements" if lean else "")
                  + (f", estimated from {KEEP} layers" if cands and cands[0].estimate else "")
                  + f": {len(self.priced) - n - bounded} configs priced"
                  + (f" ({bounded} more bounded slower than the best so far)" if bounded else "")
                  + f", {len(ok)} fit, best "
                  + (f"{best * 1e3:.3f} ms" if ok else "none") + f" ({time.perf_counter() - t0:.2f} s; {self._clock.status()})")

    def _bounded(self, stages: int, micro: int, estimate: bool, axis: int = 0) -> bool:
        """Skip a split before its intra-op search (a capture and an ILP: seconds each on
        a deep model) when even its compute cannot beat the best plan priced so far: each
        layer's compute floor (:attr:`LayerStat.floor`, the same for every split: FLOPs
        are linear in the batch) spread over a stage's devices, or more where its ops'
        launches and weight reads say so (:func:`~autopar.search.stages.layer_stats.kernel_floor`), in
        :func:`~autopar.search.stages.pipeline_step.split_lower_bound`'s pipeline (the slowest stage
        runs ``micro`` micro-batches, the others fill and drain at the least share any
        schedule of the split leaves).  The split is recorded with its bound."""
        best = self.best()
        bar = min(best[1].step_seconds if best is not None else math.inf, self.incumbent)
        lb = self.space.split_floor(self._with_stats(), stages, micro)
        if lb is None or lb <= bar * (1.0 + 1e-9):
            return False
        cand = _Candidate(stages, micro, None, None, [], self.mesh, estimate, axis=axis)  # type: ignore[arg-type]
        self.priced.append((cand, Priced(Config(stages=stages, micro_batches=micro, pipeline_axis=axis), [], math.inf,
                                         math.inf, bound=lb)))
        self._say(f"{split_words(stages, axis, 'stages')}, micro-batches {micro}: not searched, "
                  + (f"its compute and kernel launches alone take at least {lb * 1e3:.3f} ms per step, over the best "
                     f"{bar * 1e3:.3f} ms" if math.isfinite(lb) else
                     f"{len(self._with_stats().stats)} layers cannot fill {stages} stages "
                     "(a layer per stage at least)"))
        return True

    def share(self, other: JointSearch) -> None:
        """Use ``other``'s captures and shallow copy: the same model and call planned on
        another mesh (:mod:`autopar.search.mesh_shapes`) captures nothing twice."""
        self.captures.share(other.captures)

    def _with_stats(self) -> _Candidate | None:
        """The first priced candidate with layer statistics (any: they share the layers)."""
        return next((c for c, _ in self.priced if c.stats), None)

    def _stage_options(self) -> list[tuple[int, int]]:
        """The (stages, axis) splits of :meth:`PlanSpace.stage_options`, told of the
        captures' tied weights and the layers priced so far."""
        options, note = self.space.stage_options(tied_across_layers(self.captures.first()),
                                                  self._with_stats())
        if note:
            self._say(note)
        return options

    def run(self) -> tuple[Captured, Plan]:
        """Search and return the chosen capture (at the micro-batch size) and plan."""
        with show(bool(self.opts.progress), self.opts.time_limit, left=lambda: self._clock.left()):
            return self._run()

    def _run(self) -> tuple[Captured, Plan]:
        t0 = time.perf_counter()
        first = self.begin()
        self.widen(first)
        return self.finish(t0)

    def begin(self) -> tuple[int, int, int]:
        """A fresh budget (one per pass: a second follows estimates that proved wrong)
        and the first candidate, the plain one or the forced split; returns its split."""
        self._clock = TimeBudget(self.opts.time_limit, self.uncharged)
        self._stopped = set()
        if self.space.only is None:
            stages, axis = self.space.forced_splits()[0]
            first = (stages, self.space.micro_options(stages)[0], axis)
        else:
            first = self._first_kept()
            stages, axis = first[0], first[2]
        self._try(stages, first[1], math.inf, strict=True, estimate=self.captures.start_early(), axis=axis)
        if self.space.copies_split(first):
            self._try(1, 2, math.inf, estimate=self.captures.shallow is not None)
        if stages > 1:
            self._stage_options()  # forced stages: refuse tied weights across layers now
            for p, a in self.space.forced_splits()[1:]:  # the forced count from the other axes
                self._try(p, first[1], math.inf, estimate=self.captures.shallow is not None, axis=a)
        return first

    def _first_kept(self) -> tuple[int, int, int]:
        """The first split when :attr:`PlanSpace.only` restricts them: the first kept
        one, its most promising micro-batch count; PlanError when none is kept (tied
        weights across layers rule pipelines out)."""
        kept = self._stage_options()
        if not kept:
            raise PlanError(f"none of the splits {sorted(self.space.only or ())} searched on mesh "
                            f"{tuple(self.mesh.shape)} can run this model")
        stages, axis = kept[0]
        return stages, self.space.micro_order(stages, axis)[0], axis

    def widens(self) -> bool:
        """Whether :meth:`widen` searches the other splits: ``explore``, or memory pressure (ZeRO
        needed to fit, recomputation, no fit; not ZeRO chosen for speed, nor forced options)."""
        forced = self.opts.pipeline_stages is not None or self.opts.micro_batches is not None
        best = self.best()
        # memory pressure already costs time (ZeRO where the split without it does not
        # fit, recomputation, or nothing fits): pipelines and micro-batches may then be the
        # cheaper way to fit.  ZeRO chosen for speed (ZeRO-3 keeping its layers gathered
        # saves a data-parallel bucket's copies; ZeRO-1 shards the optimizer's update)
        # is no pressure, nor is what the user forced (zero_stage=, recompute=): no plain
        # config is priced to fit then, and every split costs a capture and an ILP
        pressed = best is None or (not self.opts.recompute and best[0].recomputes_more(best[1])) or (
            self.opts.zero_stage is None and best[1].config.zero_stage > 0
            and not self._fits_plainly(best[0]))
        return bool(self.opts.explore) or (pressed and not forced)

    def rest_floor(self, first: tuple[int, int, int]) -> float:
        """:meth:`PlanSpace.rest_floor` of the splits :meth:`widen` searches beyond ``first``."""
        return self.space.rest_floor(tied_across_layers(self.captures.first()), self._with_stats(),
                                     first) if self.widens() else math.inf

    def widen(self, first: tuple[int, int, int], seconds: float | None = None) -> None:
        """The other splits, when :meth:`widens`; ``seconds``: within that share of a mesh
        shape's budget (:mod:`autopar.search.mesh_shapes`), captures charged."""
        if seconds is not None:
            self._clock = TimeBudget(seconds, explore_share=1.0)
        if self.widens():
            est = self.captures.shallow is not None or self.captures.start_shallow(
                self.priced[0][0].stats if self.priced else None)
            # breadth first, each stage count's most promising micro-batch count first:
            # a time limit then cuts depth, not whole stage counts.  With a pipeline
            # more micro-batches shrink the bubble: the most first; without one they only
            # trade speed for memory: the fewest first.  Stages inside a node (a later
            # axis) come after those across nodes at each depth: they rarely win (the
            # slow link then carries the sub-mesh's traffic), so a time limit cuts them first
            if not est and self.best() is not None:
                self._clock.explore_all()  # nothing will be estimated: nothing to confirm
            self._explore(first, est)

    def finish(self, t0: float, seconds: float | None = None) -> tuple[Captured, Plan]:
        """The confirm phase: the best estimates planned at full depth, then the plan;
        ``seconds``: a budget of its own for it (the best mesh shape's)."""
        if seconds is not None:
            self._clock = TimeBudget(seconds, self.uncharged)
        self._clock.enter(Phase.CONFIRM)
        if self.best() is None:
            # no split fits with the fastest placements: let the budget shape them (in the
            # confirm phase, the first always: else a spent explore share would report
            # "no plan fits" without a memory-lean plan tried)
            lean = sorted({(c.stages, c.micro_batches, c.estimate, c.axis) for c, _ in self.priced})
            for k, (p, m, e, a) in enumerate(lean):
                self._try(p, m, self.budget, estimate=e, force=k == 0, axis=a)
        self._confirm_estimates()
        best = self.best(exact=True)
        if self._mismatch and not self.captures.exact:
            # the estimates stood for layers that differ at full depth after all: their
            # ranking is not to be trusted, so every split is planned at full depth
            self._say("the layers differ at full depth: planning every split at full depth")
            self.priced = [(c, p) for c, p in self.priced if not c.estimate]
            self.captures.shallow, self.captures.exact = None, True
            return self._run()
        if best is None:
            if not self.priced and self.opts.schedule == Schedule.INTERLEAVED.value:
                counts = {p: self.space.micro_options(p) for p, _ in self._stage_options() if p > 1}
                raise PlanError(
                    "schedule='interleaved-1f1b' has no split it can run: it needs a number of "
                    "micro-batches that is a multiple of the pipeline stages and a layer per "
                    f"virtual stage; micro-batch counts by stages: {counts}")
            if not self.priced:
                raise PlanError("the search found no plan within its time limit of "
                                f"{self.opts.time_limit} s; raise time_limit")
            need = min(p.min_memory for _, p in self.priced)
            raise NoFitError(
                f"no plan fits the memory budget of {format_bytes(self.budget)} per device: the "
                f"leanest plan found (ZeRO-3, recomputation, pipelining and micro-batches "
                f"considered) needs {format_bytes(need)} per device")
        cand, pr = best
        plan = recorded(cand, pr, self.priced, self.budget, self._call, self.opts, self.mesh)
        n_est = sum(1 for c, _ in self.priced if c.estimate)
        if n_est:
            msg = (f"{n_est} configurations estimated from a {KEEP}-layer copy of the model "
                   "(its repeated layers are identical), the chosen one planned at full depth")
            plan.solver.message = (plan.solver.message + "; " if plan.solver.message else "") + msg
        plan.timings.update(self.timings)
        plan.timings["joint_search"] = time.perf_counter() - t0
        self._clock.record(plan.timings)
        if self._stopped:
            spent = " and ".join(f"its {p} budget ({plan.timings[f'budget_{p}']:.1f} s)"
                                 for p in Phase if p in self._stopped)
            msg = (f"the joint search spent {spent} of time_limit={self.opts.time_limit} s after "
                   f"{len(self.priced)} configurations; this is the best plan found")
            plan.warnings.append(msg)
            plan.solver.message = (plan.solver.message + "; " if plan.solver.message else "") + msg
        c = pr.config
        self._say(f"chose {split_words(c.stages, c.pipeline_axis)} ({c.schedule}), {c.micro_batches} micro-batch(es), "
                  + (f"ZeRO-{c.zero_stage} over {zero_words(c.zero_axis)}" if c.zero_stage else "no ZeRO")
                  + f": {pr.step_seconds * 1e3:.3f} ms per step")
        return cand.cap, plan

    def _explore(self, first: tuple[int, int, int], est: bool) -> None:
        """Every (stages, micro-batches, axis) split but ``first`` (planned already), in
        rounds: each round takes each stage count's next micro-batch count
        (:meth:`PlanSpace.micro_order`).  The first round goes in the order of the stage counts
        (across nodes before inside one); every later one visits first the stage counts
        whose plans so far were fastest, so that a time limit cuts the unpromising ones.  Which
        splits are planned does not depend on the order, only which a limit cuts."""
        queues = {(p, a): self.space.micro_order(p, a) for p, a in self._stage_options()}
        order = sorted(queues, key=lambda pa: (pa[1] > 0, pa[0], pa[1]))
        while any(queues.values()):
            for p, a in order:
                if queues[(p, a)]:
                    m = queues[(p, a)].pop(0)
                    if (p, m, a) != first:  # (first keeps its turn in its round)
                        self._try(p, m, math.inf, estimate=est, axis=a)
            fastest: dict[tuple[int, int], float] = {}
            for c, pr in self.priced:
                if pr.feasible:
                    key = (c.stages, c.axis)
                    fastest[key] = min(fastest.get(key, math.inf), pr.step_seconds)
            order = sorted(queues, key=lambda pa: (fastest.get(pa, math.inf), pa[1] > 0, pa[0], pa[1]))

    def _fits_plainly(self, cand: _Candidate) -> bool:
        """True when a config priced for ``cand``'s split fits without ZeRO and without
        recomputation."""
        split = (cand.stages, cand.micro_batches, cand.axis)
        return any(p.feasible and p.config.zero_stage == 0 and not c.recomputes_more(p)
                   for c, p in self.priced if (c.stages, c.micro_batches, c.axis) == split)

    def _confirm_estimates(self, most: int = 3) -> None:
        """Plan at full depth the best estimated configurations (at most ``most`` splits)
        while one is faster than the best exact plan: only exact plans are chosen.  The
        first one is planned even when the time limit is spent: it finishes the search
        rather than widening it (else an estimate the search found faster would only
        appear in the summary as the road not taken)."""
        tried: set[tuple[int, int, int]] = set()
        while len(tried) < most and (not tried or not self._out_of_time()):
            best, exact = self.best(), self.best(exact=True)
            if best is None or not best[0].estimate or (
                    exact is not None and exact[1].step_seconds <= best[1].step_seconds):
                return
            split = (best[0].stages, best[0].micro_batches, best[0].axis)
            if split in tried:
                return
            # the variant the estimate won with: its placements, not all four, at full depth
            weights = (best[0].weight,)
            tried.add(split)
            estimated = best[1].step_seconds
            # this split's estimates have served: its exact configs replace them
            self.priced = [(c, p) for c, p in self.priced
                           if not (c.estimate and (c.stages, c.micro_batches, c.axis) == split)]
            n, first = len(self.priced), len(tried) == 1
            self._try(split[0], split[1], math.inf, force=first, weights=weights, axis=split[2])
            # the check that the estimates were exact: this split, planned at full depth
            exact = [p.step_seconds for _, p in self.priced[n:] if p.feasible]
            if not exact or not math.isclose(min(exact), estimated, rel_tol=1e-6):
                self._mismatch = True
                return
            if not any(p.feasible for _, p in self.priced[n:]):
                # memory-lean placements, as for any split
                self._try(split[0], split[1], self.budget, force=first, axis=split[2])


__all__ = ["JointSearch"]
