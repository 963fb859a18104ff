"""The joint search's plan space: the (pipeline stages, mesh axis) splits, the
micro-batch counts and the configurations (schedule, ZeRO stage and axes, virtual
stages) priced on each candidate placement.

:class:`PlanSpace` is held by :class:`autopar.search.joint.JointSearch`; it is given the
mesh, the options and the call, and what it reads of the search's progress (the layer
statistics priced so far, the tied weights of its captures) is passed to the method
that needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.capture.grad_flow import loss_output
from autopar.capture.ir import info
from autopar.capture.layers import layer_keys
from autopar.capture.trace import Captured
from autopar.capture.user_checkpoint import Coverage
from autopar.cost_models import MeshSpec
from autopar.errors import PlanError
from autopar.plans.data import Plan
from autopar.plans.decisions import PlanOptions
from autopar.plans.kinds import Schedule
from autopar.plans.schedules import conflict
from autopar.plans.splits import batch_size, micro_counts, pipeline_splits, split_mesh
from autopar.search.compression import kinds as compression_kinds
from autopar.search.forced import zero_groups
from autopar.search.offload import kinds as offload_kinds
from autopar.search.stages.layer_stats import LayerStat, kernel_floor
from autopar.search.stages.pipeline_step import split_lower_bound
from autopar.search.stages.priced import Config, Priced, choice_fields, forced_fields
from autopar.search.stages.step_terms import bubble_share


@dataclass
class _Candidate:
    """One placement of one split, with what pricing it needs."""

    stages: int
    micro_batches: int
    cap: Captured
    plan: Plan
    stats: list[LayerStat]
    full: MeshSpec
    estimate: bool = False  # priced from the shallow copy (autopar/search/shallow.py)
    weight: float = 1.0  # the gradient-sync weight its placements were solved with
    axis: int = 0  # the mesh axis the pipeline stages are carved from

    def recomputes_more(self, pr: Priced) -> bool:
        """True when ``pr`` recomputes a layer the model does not checkpoint itself: what
        the memory budget asked for (the model's own checkpointing is no pressure)."""
        own = {st.key for st in self.stats if st.checkpointed is not Coverage.NONE}
        return any(set(sp.recompute) - own for sp in pr.stages)


def tied_across_layers(cap: Captured | None) -> list[str]:
    """Parameters used by more than one layer of ``cap`` (tied embedding and head): a
    pipeline would need their gradients summed across stages, which the runtime refuses."""
    if cap is None:
        return []
    keys = layer_keys(cap.gm)
    out = []
    for n in cap.gm.graph.nodes:
        if n.op == "get_attr" and info(n).param is not None:
            if len({keys[u] for u in n.users if u in keys}) > 1:
                out.append(info(n).param)
    return out


class PlanSpace:
    """The plan space of one joint search on ``mesh`` under ``opts`` for the batch of
    ``call`` (positional inputs, keyword inputs); see the module docstring.  ``known``,
    where a method takes it: a priced candidate with layer statistics (any: what they
    share is the model's layers and their compute), ``None`` before there is one."""

    def __init__(self, mesh: MeshSpec, opts: PlanOptions, call: tuple) -> None:
        self.mesh, self.opts, self.call = mesh, opts, call
        # the only (stages, axis) splits searched, when a shape search searches this
        # mesh for some of its splits alone (autopar/search/mesh_shapes.py); None: all
        self.only: frozenset[tuple[int, int]] | None = None
        # configs()' lists by what they depend on
        self._config_lists: dict[tuple, list[Config]] = {}

    def _enough_layers(self, known: _Candidate | None, stages: int) -> None:
        """Forced stages need a computing layer each (a stage that computes nothing is
        never planned): say so, rather than that no plan fits memory."""
        if known is None or stages <= 1:
            return
        layers = [st.key for st in known.stats if st.compute > 0]
        if len(layers) < stages:
            raise PlanError(f"pipeline_stages={stages} needs at least {stages} layers that compute, "
                            f"one per stage, but the model has {len(layers)} "
                            f"({', '.join(layers) or 'none'}): stages are cut between layers "
                            "(repeated blocks such as model.layers.N, with what comes before and "
                            "after them)")

    def stage_options(self, tied: list[str], known: _Candidate | None,
                      ) -> tuple[list[tuple[int, int]], str | None]:
        """(stages, mesh axis they are carved from): every factor of every axis (across
        nodes and inside a node), or the forced count and axis; with what to tell the
        user when the splits are cut short.  ``tied``: :func:`tied_across_layers`."""
        p = self.opts.pipeline_stages
        if p is not None:
            if p > 1 and tied:
                raise PlanError(f"pipeline_stages={p} is impossible: "
                                f"{', '.join(tied)} is used by several layers (tied weights), "
                                "which would have to live on two stages")
            self._enough_layers(known, p)
            return self.forced_splits(), None
        if tied:
            return self._kept([(1, 0)]), f"no pipelining: tied weights {', '.join(tied)} span several layers"
        return self._kept([(1, 0)] + self._splits()), None

    def _kept(self, splits: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``splits`` restricted to :attr:`only` when it is set."""
        return splits if self.only is None else [s for s in splits if s in self.only]

    def _splits(self, stages: int | None = None) -> list[tuple[int, int]]:
        """The pipeline splits of the mesh (of ``stages`` stages only, when given), on the
        forced ``pipeline_axis`` alone when there is one."""
        return [(q, a) for q, a in pipeline_splits(tuple(self.mesh.shape))
                if stages in (None, q) and self.opts.pipeline_axis in (None, a)]

    def forced_splits(self) -> list[tuple[int, int]]:
        """The splits of the forced ``pipeline_stages``: from each axis it divides (or
        the forced ``pipeline_axis``)."""
        p = self.opts.pipeline_stages or 1
        return [(1, 0)] if p == 1 else self._splits(p)

    def micro_options(self, stages: int) -> list[int]:
        """Micro-batch counts for ``stages``: every count that divides the batch (a deep
        pipeline needs many, 64-1,024 in published runs, to shrink its bubble; before,
        only 1-32 in powers of two were tried), at least one per stage; two copies
        forced (``copies=2``) run as two micro-batches."""
        if self.opts.micro_batches is not None:
            return [self.opts.micro_batches]
        if self.opts.copies == 2:
            return [2]
        return micro_counts(batch_size(self.call), stages)

    def micro_order(self, stages: int, axis: int = 0) -> list[int]:
        """:meth:`micro_options` most promising first.  Without a pipeline the fewest
        (more only trade speed for memory).  With one, first the most micro-batches whose
        micro-batch still has a sample per data-parallel device of a stage when tensor
        parallelism takes its last axis inside a node (Megatron's layout), then the most
        whose micro-batch has a sample per device of a stage (more shrink the bubble),
        then the fewer, then those with smaller micro-batches, the larger first, except
        that the first count's halvings come right after it: every count dividing the
        batch goes down to one sample, which on a wide stage leaves the data-parallel
        devices nothing to split, and a time limit should not be
        spent on those first (a search that runs to its end prices them all in any
        order; the order decides which a time limit cuts, and how soon a good plan
        bounds the others)."""
        opts = self.micro_options(stages)
        if stages <= 1:
            return opts
        b, per_stage = batch_size(self.call), math.prod(self.mesh.shape) // stages
        spans = [m for m in opts if b // m >= per_stage]
        order = sorted(spans, reverse=True) + [m for m in opts if b // m < per_stage]
        sub = split_mesh(self.mesh, stages, axis)[1].shape
        node = self.mesh.gpus_per_node
        if len(sub) > 1 and node is not None and 1 < sub[-1] <= node:
            per_rank = per_stage // sub[-1]
            tp = [m for m in opts if b // m >= per_rank]
            if tp:
                order = [max(tp)] + [m for m in order if m != max(tp)]
        # then the first's halvings (twice the samples per device each, half the
        # micro-batches: the best count is mostly near the first), then the rest as above
        near = [m for m in (order[0] // 2 ** k for k in range(1, 64)) if m in opts and order[0] % m == 0]
        return order[:1] + near + [m for m in order[1:] if m not in near]

    def configs(self, cand: _Candidate) -> list[Config]:
        """Every configuration priced on ``cand``: ZeRO stage and axes, schedule,
        ZeRO-3's reduction under accumulation, virtual stages, compression, offload and
        copies, each as forced or every option that can run; the forced values of the
        decisions its stages choose passed through (:func:`forced_fields`), and each
        value of the decisions the registry lists choices for (:func:`choice_fields`)."""
        sub = cand.plan.mesh
        zs = self._zero_stages()
        params = [(q.replicated, q.bytes) for st in cand.stats for q in st.params]
        axes = zero_groups(tuple(sub.shape), self.opts.zero_axes, params) if any(zs) else []
        scheds = self._schedules(cand.stages)
        self._check_recompute(cand.stats)
        virtual = self._virtual(cand)
        recomputes = self._recomputes(cand.stats)
        # the same list for every plan of a split whose parameters group alike (a deep
        # model's search asks for a split's configs about a thousand times)
        key = (cand.stages, cand.micro_batches, cand.axis, tuple(zs), tuple(axes),
               tuple(scheds), tuple(virtual), recomputes)
        known_configs = self._config_lists.get(key)
        if known_configs is not None:
            return known_configs
        out, forced, choices = [], forced_fields(self.opts), choice_fields(self.opts)
        for z in zs:
            # ZeRO needs a sub-mesh axis to shard over: no config when there is none
            for a in (axes if z else [None]):
                for s in scheds:
                    if conflict(s, recomputes, z):
                        continue  # a schedule that cannot run with these decisions
                    # ZeRO-3 under plain accumulation: reduce-scatter in every
                    # micro-batch, or once a step from whole gradients (more memory)
                    once = [False, True] if z == 3 and cand.micro_batches > 1 and cand.stages == 1 else [False]
                    for v in (virtual if s == Schedule.INTERLEAVED.value else [1]):
                        out.extend(Config(stages=cand.stages, micro_batches=cand.micro_batches,
                                          schedule=s, zero_stage=z, zero_axis=a, virtual=v,
                                          pipeline_axis=cand.axis, reduce_once=o, compression=c,
                                          rank=r, offload=h, copies=k, **forced, **ch)
                                   for o in once for c, r in compression_kinds(self.opts)
                                   for h in offload_kinds(self.opts, z, sub)
                                   for k in self._copies(cand) for ch in choices)
        self._config_lists[key] = out
        return out

    def _zero_stages(self) -> list[int]:
        """The ZeRO stages :meth:`configs` tries: the forced one, else all four; only
        stage 3 when its parameter shards live in host memory."""
        if self.opts.zero_stage is not None:
            if self.opts.offload == "params" and self.opts.zero_stage != 3:
                raise PlanError(f"offload='params' keeps ZeRO-3's parameter shards in host memory: "
                                f"it needs zero_stage=3, not {self.opts.zero_stage}")
            return [self.opts.zero_stage]
        return [3] if self.opts.offload == "params" else [0, 1, 2, 3]

    def _check_recompute(self, stats: list[LayerStat]) -> None:
        """The layers ``recompute=`` names exist and can be recomputed."""
        if not self.opts.recompute:
            return
        bad = sorted(set(self.opts.recompute) - {st.key for st in stats})
        if bad:
            raise PlanError(f"recompute names unknown layer(s) {bad}; the model's layers are "
                            f"{[st.key for st in stats]}")
        stateful = sorted(st.key for st in stats if st.key in self.opts.recompute and st.updates_state)
        if stateful:
            raise PlanError(f"recompute names layer(s) {stateful} whose forward updates state in "
                            "place (a training batch norm's running statistics): recomputing "
                            "would update it twice; leave them out of recompute=")

    def _recomputes(self, stats: list[LayerStat]) -> bool:
        """Whether recomputation is asked for, by ``recompute=`` or by the model's own
        checkpointing; a forced schedule that cannot run the model's own is an error."""
        own = [st.key for st in stats if st.checkpointed is not Coverage.NONE]
        why = conflict(self.opts.schedule, bool(own), None)
        if why:
            raise PlanError(f"schedule={self.opts.schedule!r} cannot run the model's own activation "
                            f"checkpointing of {', '.join(own)} ({why}): use another schedule, or "
                            "turn the model's checkpointing off (Hugging Face: "
                            "model.gradient_checkpointing_disable())")
        return bool(self.opts.recompute) or bool(own)

    def copies_split(self, first: tuple[int, int, int]) -> bool:
        """Under ``copies="auto"``: whether to price the one-stage split of two
        micro-batches, where two copies can run, whatever memory asks for (widening
        alone may skip it); ``first``: the split priced first."""
        return self.opts.copies == "auto" and first[:2] != (1, 2) and bool(self._kept([(1, 0)])) \
            and self.opts.pipeline_stages in (None, 1) and self.opts.micro_batches in (None, 2) \
            and 2 in self.micro_options(1)

    def _copies(self, cand: _Candidate) -> list[int]:
        """Multi-copy overlap's options on ``cand`` (decision ``copies``): off unless
        asked; two copies need one stage, two micro-batches (captured at half the batch)
        and a graph returning its loss alone (:mod:`autopar.passes.multi_copy`)."""
        asked = self.opts.copies
        if asked in (None, 1):
            return [1]
        # the loss alone, or named among the outputs (a Hugging Face output's ``loss``:
        # the runtime keeps it alone, autopar.module.runners.keep_loss_only)
        loss = loss_output(cand.cap.gm, cand.cap.out_spec)[1] is not None
        ok = cand.stages == 1 and cand.micro_batches == 2 and loss
        if asked == "auto":
            return [1, 2] if ok else [1]
        return [2] if ok else []

    def _schedules(self, stages: int) -> list[str]:
        """The schedules :meth:`configs` prices on ``stages`` stages: the forced one, else
        all four, those a forced chunk count rules out left out; none without a pipeline."""
        if stages <= 1:
            return [Schedule.NONE.value]
        scheds = [self.opts.schedule] if self.opts.schedule else [
            Schedule.ONE_F_ONE_B.value, Schedule.GPIPE.value, Schedule.INTERLEAVED.value,
            Schedule.ZERO_BUBBLE.value]
        v = self.opts.virtual_stages
        if v is not None:  # forced chunks decide whether the schedule interleaves
            scheds = [s for s in scheds if (s == Schedule.INTERLEAVED.value) == (v > 1)]
        return scheds

    def split_floor(self, known: _Candidate | None, stages: int, micro: int) -> float | None:
        """A lower bound on the step of every config of a split, for
        :meth:`autopar.search.joint.JointSearch._bounded` (``None`` before any layer
        statistics exist)."""
        if known is None:
            return None
        # per layer, device-seconds of the whole batch, over a stage's devices, per
        # micro-batch; and each op at least its launch, so that many micro-batches of
        # small ops are bounded too (a deep pipeline can run thousands of micro-batches)
        devices = math.prod(self.mesh.shape) // stages
        scale = known.micro_batches / micro
        launches = kernel_floor(known.stats, self.mesh, devices, scale, min(1.0, scale))
        floors = [max(st.floor * scale / devices, k) for st, k in zip(known.stats, launches)]
        return split_lower_bound(floors, stages, micro, self.mesh.idle_reuse,
                                 self._schedule_shapes(stages, micro, len(floors)))

    def rest_floor(self, tied: list[str], known: _Candidate | None, first: tuple[int, int, int]) -> float:
        """The least :meth:`split_floor` of every (stages, micro-batches, axis) split the
        search widens to (:meth:`stage_options` x :meth:`micro_order`) but ``first``:
        no split of them can be faster (``math.inf`` when there is none; 0 before there
        are layer statistics).  The floor does not depend on the axis: once per count."""
        splits = {(p, m) for p, a in self.stage_options(tied, known)[0]
                  for m in self.micro_order(p, a) if (p, m, a) != first}
        floors = [self.split_floor(known, p, m) for p, m in sorted(splits)]
        return min((0.0 if f is None else f for f in floors), default=math.inf)

    def _schedule_shapes(self, stages: int, micro: int, layers: int) -> list[tuple[float, int]]:
        """(bubble share, model chunks per rank) of every schedule :meth:`configs` may
        price on a split of ``stages`` stages and ``micro`` micro-batches over ``layers``
        layers (what a bound on all of them must allow for)."""
        if stages <= 1:
            return [(1.0, 1)]
        out = []
        for s in self._schedules(stages):
            if s == Schedule.INTERLEAVED.value:
                out += [(1.0 / v, v) for v in self._chunks(stages, micro, layers)]
            else:
                out.append((bubble_share(Config(stages=stages, micro_batches=micro, schedule=s)), 1))
        return out

    def _virtual(self, cand: _Candidate) -> list[int]:
        """Model chunks per rank the interleaved schedule tries on ``cand``: the forced
        count, else 2 and 4 where each virtual stage still gets a layer; none when the
        micro-batches are not a multiple of the stages (the schedule's groups: other
        counts may be, and a forced count that is not fails in ``check_forced``)."""
        return self._chunks(cand.stages, cand.micro_batches, len(cand.stats))

    def _chunks(self, p: int, micro: int, layers: int) -> list[int]:
        """:meth:`_virtual` of ``p`` stages, ``micro`` micro-batches over ``layers`` layers."""
        if micro % p:
            return []
        want = [self.opts.virtual_stages] if self.opts.virtual_stages else [2, 4]
        return [v for v in want if v > 1 and p * v <= layers]


__all__ = ["PlanSpace", "tied_across_layers"]
