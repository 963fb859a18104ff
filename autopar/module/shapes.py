"""Shapes other than the planned one: one plan, lowered again per shape.

A plan is searched and priced at the example's shape.  Its decisions (each node's
placements, ZeRO, recomputation) do not depend on the batch size or the sequence
length, so a call with another shape (a short last batch, an evaluation at batch 1,
every fine-tuning batch padded to its own longest sequence) runs the same plan on the
model captured at that shape: :class:`ShapeRoutes` captures the model once per new
global shape, lowers that graph with the plan (no new search), applies the runtime's
graph rewrites (ZeRO-3 gathers, recomputation, device, train/eval mode) on the
module's own parameters, and keeps it as the numbers where its graph differs from the
first of its kind (:mod:`autopar.module.shape_template`; the :data:`MAX_SHAPES` most
recent).  A shape seen before costs a dictionary lookup.

* **A dim that does not divide.**  A batch of 3 on 2 data-parallel ranks, a length of 17
  under context parallelism over 2: as few of the axes that split it as make the rest
  divide are dropped from the activations for that shape (the ranks along them compute
  the same rows; parameters and their gradient sync are as planned), which is exact.  Only axes that split no
  parameter can be dropped; otherwise the call raises :class:`InputMismatchError` naming
  the multiple to pad to.
* **``batch="local"`` with ranks holding different rows or lengths.**  Each rank runs
  the plan at its own shape (as if every data-parallel rank held rows like its own):
  the ranks then exchange only gradients and the loss's sums, so a plan that exchanges
  nothing else (data parallel, ZeRO) needs no agreement and issues no collective for it,
  as DDP.  Where activations meet between ranks that must hold equal shapes (every rank
  under ``batch="global"``; tensor-parallel peers; data-parallel ranks when activations
  cross them or a schedule runs: :class:`Agree`), the ranks exchange their shapes every
  call (one all-gather of a few integers) and all raise on a difference, so none waits
  in (or, on gloo, aborts at) a collective of another size.  Conventions: a
  token-mean cross-entropy (Hugging Face's loss) divides by the count of real tokens
  over all ranks, as one process on the whole batch would; a ``mean`` over rows is the
  mean of the ranks' means, as DDP's gradient average is.
* **Pipelines and gradient accumulation.**  A shape runs its own schedule's runner over
  the stage graphs of its micro-batch's lowering; a batch that does not divide into the
  planned micro-batches runs as equal ones that divide it
  (:func:`~autopar.plans.schedules.micro_batch_counts`); under ``batch="local"`` the ranks
  agree on the shape every call.  Micro-batched copies serve the planned shape
  only: another raises :class:`InputMismatchError` on every rank.

A new shape costs a capture and a lowering, paid once per shape.  The first two shapes
of a kind (the same dims differing from the planned shape: the length, say) are exported
(~0.4-0.8 s for benchmarks/variable_length.py's Llama on the 2-core VM), the second also
with those dims symbolic; every later shape of the kind is that symbolic graph given its
numbers (:mod:`autopar.module.shape_capture`, ~0.1 s), the graph an export would give.
A graph that differs at a shape (export drops no-op ops at a batch of 1) is planned
again with every parameter where it is (:attr:`ShapeRoutes.replan`).  Under
``compile=True`` the lowerings share compiled templates
(:mod:`autopar.module.shape_template`): a few compilations for any number of shapes.
"""

from __future__ import annotations

import copy
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.capture.annotate import annotate
from autopar.capture.grad_flow import from_inputs
from autopar.log import log
from autopar.module.habits import building
from autopar.module.runners import Switches, keep_loss_only, stage_runner
from autopar.module.shape_capture import ShapeCaptures
from autopar.module.shape_lowering import Shapes, adopt, fit_plan, same_graph, shapes_text
from autopar.module.shape_template import Shape, Templates
from autopar.passes.lower import lower
from autopar.plans.data import Plan
from autopar.plans.kinds import Schedule
from autopar.plans.schedules import micro_batch_counts
from autopar.plans.splits import micro_inputs
from autopar.runtime import collectives as C
from autopar.runtime import experts as E
from autopar.runtime.call_check import Agree, agreement, agreement_row, gather_rows
from autopar.runtime.inputs import BatchMode, InputMismatchError, passthrough_inputs
from autopar.runtime.packing import widest

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule
    from autopar.runtime.pipeline import PipelineRunner

MAX_SHAPES = 4096
"""Shapes kept per module besides the planned one (least recently used dropped); each
is a few numbers (:class:`~autopar.module.shape_template.Shape`)."""



@dataclass
class Route:
    """What runs one call: the lowering (``None``: the planned graph), the global shapes
    of the flat inputs it takes, and which of them it takes as this rank's rows."""

    shape: Shape | None
    shapes: list[tuple[int, ...] | None]
    passthrough: frozenset[int]
    runner: PipelineRunner | None = None
    """A pipeline's or micro-batched plan's runner at these shapes (``None``: the
    planned runner, or no schedule)."""


@dataclass
class ShapeRoutes:
    """The routes of one :class:`~autopar.module.parallel.ParallelModule` (see the module
    docstring); ``planned`` is the plan's own."""

    planned: Route
    training: bool = True
    """The mode the planned graph was captured in: new shapes are captured in it too."""
    cache: OrderedDict = field(default_factory=OrderedDict)
    templates: Templates = field(default_factory=Templates)
    runners: list = field(default_factory=list)
    """The runners of other shapes' routes (their graphs switch train/eval too)."""
    built: int = 0
    """Graphs built for new shapes (the log and the closing numbers read it)."""
    _needs_agreement: Agree | None = field(default=None, repr=False)
    batch: frozenset[int] = field(init=False, repr=False)
    """Flat inputs whose dim 0 is the batch (:func:`_batch_inputs` of the planned shapes)."""
    captures: ShapeCaptures = field(init=False, repr=False)
    """How new shapes are captured (exported, or given by a symbolic export)."""
    model: torch.nn.Module | None = field(default=None, repr=False)
    """The model passed to ``auto_parallel`` with fake tensors (:func:`structure_copy`):
    what a new shape is captured from, at no memory."""
    fake: FakeTensorMode | None = field(default=None, repr=False)
    replan: Callable | None = field(default=None, repr=False)
    """``(model, args, kwargs, plan) -> (capture, plan)``: the plan made again at a shape
    whose graph is not the planned one (export elides ops at a batch of 1), every
    parameter pinned where it is (:func:`autopar.api._replan`)."""

    def __post_init__(self) -> None:
        self.batch = _batch_inputs(self.planned.shapes)
        self.captures = ShapeCaptures(list(self.planned.shapes))

    def __deepcopy__(self, memo: dict) -> ShapeRoutes:
        # a copy of the module (an EMA) builds its own graphs on its own parameters
        return ShapeRoutes(Route(None, list(self.planned.shapes), self.planned.passthrough),
                           self.training, model=self.model, fake=self.fake, replan=self.replan)

    def graphs(self) -> list[fx.GraphModule]:
        """The graphs run for other shapes (train/eval switches reach them too)."""
        return self.templates.modules() + [m for r in self.runners for ch in r.chunks
                                           for m in ch.module.modules() if isinstance(m, fx.GraphModule)]

    # ------------------------------------------------------------ choosing
    def select(self, pm: ParallelModule, flat: list) -> Route:
        """The route for this call's flat inputs (as this rank passed them); raises
        :class:`InputMismatchError` on every rank when some rank's shape cannot run."""
        b = pm.binder
        mine = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat)
        local = b.mode is BatchMode.LOCAL and bool(b.dp_axes)
        want = self._global(pm, mine) if local else mine
        route, error = self._route_or_error(pm, want, flat)
        agree = self._agree(pm)
        if agree is Agree.NONE:
            if error is not None:
                raise error
            return route
        every = _exchange(mine, error is not None, self.planned.shapes, pm,
                          pm.data_parallel_rank if agree is Agree.SAME_DP else 0)
        failed = [r for r, (_, bad, _) in enumerate(every) if bad]
        if failed:
            raise error if error is not None else InputMismatchError(
                f"rank(s) {failed} cannot run the shape they were called with (their error "
                "says why); no rank ran this step")
        groups: dict[int, set] = {}
        for s, _, key in every:
            groups.setdefault(key, set()).add(s)
        if any(len(g) > 1 for g in groups.values()):
            shapes = {r: s for r, (s, _, _) in enumerate(every)}
            raise InputMismatchError(_disagreement(b.mode, agree, shapes))
        return route

    def pack_agree(self, pm: ParallelModule) -> Callable[[int], int] | None:
        """Under ``pack=True`` and ``batch="local"`` where every rank must call with equal
        shapes (:attr:`Agree.ALL`), the ranks pad their packs to the widest
        (:func:`~autopar.runtime.packing.widest`); None: each packs to its own width."""
        if pm.binder.mode is not BatchMode.LOCAL or self._agree(pm) is not Agree.ALL:
            return None
        return widest(pm._mesh_rt.device)

    def _agree(self, pm: ParallelModule) -> Agree:
        """Which ranks must call with equal shapes (:class:`Agree`), read once from the
        plan: where a rank's activations reach another rank (a collective of values
        computed from the inputs, a pipeline's transfers, a schedule built for its shape),
        ranks calling with different shapes would meet in collectives of different sizes
        (gloo aborts the process; NCCL waits), so they compare their shapes first.  A
        plan that exchanges only gradients and the loss's sums (data parallel, ZeRO)
        needs no agreement, as DDP: each rank runs its own shape, and the call costs no
        collective."""
        if self._needs_agreement is None:
            self._needs_agreement = _agreement(pm, self.batch <= self.planned.passthrough)
        return self._needs_agreement

    def _global(self, pm: ParallelModule, mine: Shapes) -> Shapes:
        """The global shapes for this rank's local ones: batch inputs' rows times the
        data-parallel degree (as if every data-parallel rank held rows like these)."""
        dp = math.prod(pm.plan.mesh.shape[a] for a in pm.binder.dp_axes)
        return tuple((s[0] * dp, *s[1:]) if i in self.batch and s else s for i, s in enumerate(mine))

    def _route_or_error(self, pm: ParallelModule, want: Shapes, flat: list
                        ) -> tuple[Route | None, Exception | None]:
        if list(want) == list(self.planned.shapes):
            return self.planned, None
        if want in self.cache:
            self.cache.move_to_end(want)
            return self.cache[want], None
        try:
            route = self._build(pm, want, flat)
        except InputMismatchError as e:
            return None, e
        self.cache[want] = route
        if len(self.cache) > MAX_SHAPES:
            self.cache.popitem(last=False)
        return route, None

    # ------------------------------------------------------------ building
    def _build(self, pm: ParallelModule, want: Shapes, flat: list) -> Route:
        d = pm.plan.decisions
        if any(want[i] and want[i][0] == 0 for i in self.batch):
            # refused before capture, whose error (a reshape of 0 elements) says nothing
            raise InputMismatchError(
                f"{shapes_text(pm.binder, want)}: a batch of no rows"
                + (" (this rank passed none under batch='local'; every data-parallel rank passes "
                   "at least one row a step, as DistributedSampler gives them)"
                   if pm.binder.mode is BatchMode.LOCAL else ""))
        if d.copies > 1:
            raise InputMismatchError(
                f"{shapes_text(pm.binder, want)}, but this plan runs {d.copies} copies of each "
                "micro-batch interleaved in one graph, built for the planned shapes only "
                f"({shapes_text(pm.binder, self.planned.shapes, '')}): use batches of the planned "
                "shape, or plan with copies=1 to serve any shape")
        model = self.model
        if model is None:
            raise InputMismatchError(
                f"{shapes_text(pm.binder, want)}: serving a new shape captures the model passed "
                "to auto_parallel at that shape, and a module loaded from an export has none: "
                f"call it with the planned shapes ({shapes_text(pm.binder, self.planned.shapes, '')}), "
                "or build it with auto_parallel(model, plan=...)")
        t0, given = time.perf_counter(), self.captures.instantiated
        cap, plan, micro = self._captured(pm, model, want, flat)
        plan, dropped = fit_plan(plan, cap.gm, pm.binder, want)
        gm = lower(cap.gm, plan)
        keep = passthrough_inputs(plan)
        passthrough = frozenset(i for i, n in enumerate(x for x in gm.graph.nodes if x.op == "placeholder")
                                if n.name in keep)
        if pm.runner is None:
            route = Route(self.templates.add(adopt(pm, gm), pm.training), list(want), passthrough)
        else:
            route = Route(None, list(want), passthrough, self._runner(pm, gm, plan, micro))
        self.built += 1
        log.info("shape %s: %s and lowered with the plan in %.2f s%s%s", list(want),
                 "captured" if given == self.captures.instantiated else "given by the symbolic graph",
                 time.perf_counter() - t0,
                 f", {micro} micro-batches" if micro != d.micro_batches else "",
                 f" (axes {sorted(dropped)} compute the whole of the dims they would split)"
                 if dropped else "")
        return route

    def _captured(self, pm: ParallelModule, model, want: Shapes, flat: list):
        """(capture, plan, micro-batches) at ``want``: the model captured at one
        micro-batch of it (the whole batch without a schedule) and the plan for it.  A
        graph that is not the planned one (export drops ops that are no-ops at a batch of
        1) is planned again with every parameter where it is; a pipeline tries its next
        count of micro-batches instead (:func:`micro_batch_counts`)."""
        whole = self._example(pm, want, flat)
        for micro in self._micro_batches(pm, want):
            # a pipeline's graph is one micro-batch's
            args, kwargs = micro_inputs(whole, micro) if micro > 1 else whole
            cap = self._capture(pm, model, args, kwargs)
            if same_graph(cap.gm, pm.plan):
                return cap, pm.plan, micro
        if self.replan is None or pm.binder.mode is BatchMode.LOCAL or pm.runner is not None:
            raise InputMismatchError(
                f"{shapes_text(pm.binder, want)}: the model's graph at this shape differs from "
                "the one planned (at a micro-batch of one row export drops ops that are no-ops "
                "there); call it with the planned shapes or plan at this shape")
        log.info("shape %s: the model's graph differs from the planned one: planning it "
                 "again with every parameter where it is", list(want))
        cap, plan = self._in_mode(model, lambda: self.replan(model, args, kwargs, pm.plan))
        annotate(cap.gm)
        return cap, plan, 1

    def _micro_batches(self, pm: ParallelModule, want: Shapes) -> list[int]:
        """The counts of equal micro-batches this shape may run as, best first
        (:func:`micro_batch_counts`); ``[1]`` without a schedule."""
        if pm.runner is None:
            return [1]
        d = pm.plan.decisions
        rows = next((want[i][0] for i in sorted(self.batch) if want[i]), 1)
        planned = next((self.planned.shapes[i][0] for i in sorted(self.batch)
                        if self.planned.shapes[i]), 1)
        counts = micro_batch_counts(rows, max(1, planned // d.micro_batches), d.schedule,
                                    d.pipeline_stages, d.virtual_stages)
        if not counts:
            raise InputMismatchError(
                f"{shapes_text(pm.binder, want)}: a batch of {rows} rows splits into no number of "
                f"equal micro-batches that schedule {d.schedule!r} over {d.pipeline_stages} stages "
                f"can run (it runs them in groups of {d.pipeline_stages}): pass a multiple of "
                f"{d.pipeline_stages} rows")
        return counts

    def _runner(self, pm: ParallelModule, gm: fx.GraphModule, plan: Plan, micro: int):
        """The schedule's runner of ``gm`` (one micro-batch's lowering) on this rank,
        compiled as the planned one is."""
        keep_loss_only(gm, micro, pm._out_spec)
        runner = stage_runner(adopt(pm, gm), plan, micro, pm._mesh_rt.stage, Switches(pm))
        runner.loss_scale = pm.runner.loss_scale
        if runner.schedule is not Schedule.ZERO_BUBBLE:
            # each stage graph as its family's template: a few compilations for any
            # number of shapes (zero-bubble splits the eager backward: its own graphs)
            for ch in runner.chunks:
                ch.module = _StageTemplate(self.templates, self.templates.add(ch.module, pm.training))
        self.runners.append(runner)
        return runner

    def _example(self, pm: ParallelModule, want: Shapes, flat: list) -> tuple[tuple, dict]:
        """A call at the global shapes ``want`` from this call's tensors (batch inputs
        repeated up to ``want``'s rows)."""
        def grow(x: object, s: tuple[int, ...] | None) -> object:
            if not isinstance(x, torch.Tensor):
                return x
            x = self.fake.from_tensor(x)  # captured with the model's fake tensors
            if s is None or tuple(x.shape) == s:
                return x
            reps = s[0] // max(1, x.shape[0])
            return torch.cat([x] * reps) if reps * x.shape[0] == s[0] else x

        args, kwargs = pytree.tree_unflatten([grow(x, s) for x, s in zip(flat, want)], pm.binder.spec)
        return tuple(args), dict(kwargs)

    def _capture(self, pm: ParallelModule, model, args: tuple, kwargs: dict):
        """The model captured for this call (in the planned graph's mode), annotated."""
        cap = self._in_mode(model, lambda: self.captures.capture(
            model, args, kwargs, pm.plan.decisions.precision, self.fake))
        annotate(cap.gm)
        return cap

    def _in_mode(self, model, fn: Callable):
        """``fn()`` with ``model`` in the planned graph's train/eval mode and its
        replaced-weights checks off (:func:`autopar.module.habits.building`)."""
        mode = model.training
        model.train(self.training)
        try:
            with building():
                return fn()
        finally:
            model.train(mode)


class _StageTemplate(torch.nn.Module):
    """A stage graph of another shape's runner, run as its family's template with the
    shape's numbers (:class:`~autopar.module.shape_template.Templates`: compiled once the
    module is)."""

    def __init__(self, templates: Templates, shape: Shape) -> None:
        super().__init__()
        self._templates, self._shape = templates, shape

    def forward(self, *args):
        """The stage graph's outputs for ``args`` (its inputs, then what it received)."""
        return self._templates.run(self._shape, list(args))


def structure_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, FakeTensorMode]:
    """A copy of ``model`` whose parameters and buffers are fake tensors (same shapes,
    dtypes, devices and strides, no storage), and their fake mode: what capture needs,
    without the weights' memory.  Not the meta device: torch picks kernels by device
    (SDPA's CPU kernel lays its output out so that no ``contiguous`` follows; on meta one
    does), and the graph must be the planned one."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    with building():
        return copy.deepcopy(model, memo), mode




def _batch_inputs(shapes: list) -> frozenset[int]:
    """Flat inputs whose dim 0 is the batch: dim 0 of the planned shape equal to the first
    tensor input's (:func:`autopar.plans.placement.graph_batch`'s convention)."""
    first = next((s for s in shapes if s), None)
    if not first:
        return frozenset()
    return frozenset(i for i, s in enumerate(shapes) if s and s[0] == first[0])










def _agreement(pm: ParallelModule, batch_passed_through: bool) -> Agree:
    """:func:`~autopar.runtime.call_check.agreement` for ``pm``: the axes its lowered
    graph moves activations over; a batch input the plan gathers under
    ``batch="local"`` crosses the data-parallel ranks too."""
    moving = _activation_axes(pm.inner)
    if pm.binder.mode is BatchMode.LOCAL and not batch_passed_through:
        moving |= set(pm.binder.dp_axes)
    return agreement(pm.plan, moving)


def _activation_axes(gm: fx.GraphModule) -> set[int]:
    """The mesh axes over which ``gm`` moves activations (values computed from its
    inputs): every axis (-1 stands for them) at an expert dispatch, whose token counts
    follow the routing.  A sum of a scalar (the loss, a token count) does not count, nor
    a gathered parameter (its shape is the same at every batch)."""

    moving = {C.all_gather: 2, C.reduce_scatter: 2, C.all_to_all: 3, C.all_reduce: 1}
    data = from_inputs(gm)
    out: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n not in data:
            continue
        if getattr(n.target, "__module__", "") == E.__name__:
            out.add(-1)
            continue
        k = moving.get(n.target)
        if k is None or len(n.args) <= k:
            continue
        axis = n.args[k]
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.dim() == 0):
            out |= set(axis) if isinstance(axis, (tuple, list)) else {axis}
    return out


def _disagreement(mode: BatchMode, agree: Agree, shapes: dict) -> str:
    """The error when ranks that must agree (:class:`Agree`) passed different shapes."""
    if mode is BatchMode.LOCAL and agree is Agree.SAME_DP:
        return (f"the ranks passed different shapes ({shapes}) under batch='local', and ranks that "
                "share pm.data_parallel_rank (tensor-parallel peers) exchange activations: pass "
                "them the same rows (DistributedSampler(ds, num_replicas=pm.data_parallel_size, "
                "rank=pm.data_parallel_rank))")
    if mode is BatchMode.LOCAL:
        return (f"the ranks passed different shapes ({shapes}) under batch='local', and this plan "
                "exchanges activations between ranks (a batch input it gathers, experts' "
                "all-to-all, pipeline stages): pass equal shapes on every rank (pad to a common "
                "length, equal rows per rank)")
    return (f"the ranks passed different shapes ({shapes}) under batch='global', where every "
            "rank passes the same, whole global batch: pass the same batch on every rank, or "
            "plan with batch='local' if each rank loads its own rows")


def _exchange(mine: Shapes, failed: bool, planned: list, pm: ParallelModule, key: int
              ) -> list[tuple[Shapes | None, bool, int]]:
    """Every rank's (shapes as passed, whether it cannot run them, ``key``: ranks of one
    key must agree): one all-gather of a few integers, laid out like the planned shapes
    (a rank whose tensors have other ranks is marked as failing: its own error says why)."""
    dims = [len(s) if s is not None else -1 for s in planned]
    fits = [len(s) if s is not None else -1 for s in mine] == dims
    row = [int(failed or not fits), key] + [v for s in mine if s is not None for v in s] if fits \
        else [1, key] + [0] * (agreement_row(dims) - 2)
    out = []
    for vals in gather_rows(row, pm._mesh_rt.device).tolist():
        shapes, i = [], 2
        for k in dims:
            shapes.append(None if k < 0 else tuple(vals[i:i + k]))
            i += max(0, k)
        out.append((tuple(shapes), bool(vals[0]), int(vals[1])))
    return out


__all__ = ["MAX_SHAPES", "Route", "ShapeRoutes", "structure_copy"]
