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
  as DDP.  Where the plan moves activations between data-parallel ranks, or runs a
  schedule, the ranks exchange their shapes every call (one all-gather of a few
  integers) and all raise on a difference, so none waits in a collective another
  refused.  Conventions: a
  token-mean cross-entropy (Hugging Face's loss) divides by the count of real tokens
  over all ranks, as one process on the whole batch would; a ``mean`` over rows is the
  mean of the ranks' means, as DDP's gradient average is.
* **Pipelines and micro-batched copies** serve the planned shape only: their schedules
  are built for it.  Another shape raises :class:`InputMismatchError` on every rank.

A new shape costs one capture (an export: ~0.8 s for benchmarks/variable_length.py's
Llama on the 2-core VM) and a lowering, paid once per shape.  A graph that differs at a
shape (export drops no-op ops at a batch of 1) is planned again with every parameter
where it is (:attr:`ShapeRoutes.replan`).  Under ``compile=True`` the lowerings share compiled
templates (:mod:`autopar.module.shape_template`): a few compilations for any number
of shapes.
"""

from __future__ import annotations

import copy
import math
import operator
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.capture.annotate import annotate
from autopar.capture.trace import capture
from autopar.log import log
from autopar.module.shape_template import Shape, Templates
from autopar.plan.data import Plan
from autopar.plan.placement import Replicate, Shard, fmt_placements, is_replicate, parse_placements
from autopar.plan.splits import unsplit_axes
from autopar.runtime.call_check import gather_rows
from autopar.runtime.inputs import BatchMode, InputMismatchError, passthrough_inputs

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule

MAX_SHAPES = 4096
"""Shapes kept per module besides the planned one (least recently used dropped); each
is a few numbers (:class:`~autopar.module.shape_template.Shape`)."""

Shapes = tuple[tuple[int, ...] | None, ...]


@dataclass
class Route:
    """What runs one call: the lowering (``None``: the planned graph), the global shapes
    of the flat inputs it takes, and which of them it takes as this rank's rows."""

    shape: Shape | None
    shapes: list[tuple[int, ...] | None]
    passthrough: frozenset[int]


@dataclass
class ShapeRoutes:
    """The routes of one :class:`~autopar.module.parallel.ParallelModule` (see the module
    docstring); ``planned`` is the plan's own."""

    planned: Route
    training: bool = True
    """The mode the planned graph was captured in: new shapes are captured in it too."""
    cache: OrderedDict = field(default_factory=OrderedDict)
    templates: Templates = field(default_factory=Templates)
    built: int = 0
    """Graphs built for new shapes (the log and the closing numbers read it)."""
    _needs_agreement: bool | None = field(default=None, repr=False)
    batch: frozenset[int] = field(init=False, repr=False)
    """Flat inputs whose dim 0 is the batch (:func:`_batch_inputs` of the planned shapes)."""
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

    def __deepcopy__(self, memo: dict) -> ShapeRoutes:
        # a copy of the module (an EMA) builds its own graphs on its own parameters
        return ShapeRoutes(Route(None, list(self.planned.shapes), self.planned.passthrough),
                           self.training, model=self.model, fake=self.fake, replan=self.replan)

    def graphs(self) -> list[fx.GraphModule]:
        """The graphs run for other shapes (train/eval switches reach them too)."""
        return self.templates.modules()

    # ------------------------------------------------------------ choosing
    def select(self, pm: ParallelModule, flat: list) -> Route:
        """The route for this call's flat inputs (as this rank passed them); raises
        :class:`InputMismatchError` on every rank when some rank's shape cannot run."""
        b = pm.binder
        mine = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat)
        local = b.mode is BatchMode.LOCAL and bool(b.dp_axes)
        want = self._global(pm, mine) if local else mine
        route, error = self._route_or_error(pm, want, flat)
        if not (local and self._agree(pm)):
            if error is not None:
                raise error
            return route
        every = _exchange(mine, error is not None, self.planned.shapes, pm)
        failed = [r for r, (_, bad) in enumerate(every) if bad]
        if failed:
            raise error if error is not None else InputMismatchError(
                f"rank(s) {failed} cannot run the shape they were called with (their error "
                "says why); no rank ran this step")
        if len({s for s, _ in every}) > 1:
            shapes = {r: s for r, (s, _) in enumerate(every)}
            raise InputMismatchError(
                f"the ranks passed different shapes ({shapes}) under batch='local', and this "
                "plan exchanges activations between the data-parallel ranks (a batch input "
                "it gathers, experts' all-to-all, pipeline stages): pass equal shapes on "
                "every rank (pad to a common length, equal rows per rank)")
        return route

    def _agree(self, pm: ParallelModule) -> bool:
        """Whether the ranks must agree on their shapes before a call: the plan exchanges
        activations between data-parallel ranks (so their shapes must be equal), or runs
        a schedule built for its shape.  A plan that exchanges only gradients and the
        loss's sums (data parallel, ZeRO) needs no agreement, as DDP: each rank runs its
        own shape, and the call costs no collective."""
        if self._needs_agreement is None:
            d = pm.plan.decisions
            self._needs_agreement = (
                pm.runner is not None or d.copies > 1
                or not self.batch <= self.planned.passthrough
                or _cross_dp(pm.inner, pm.binder.dp_axes))
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
        if pm.runner is not None or d.copies > 1:
            raise InputMismatchError(
                f"{_shapes_text(pm.binder, want)}, but this plan runs {d.micro_batches} "
                f"micro-batch(es) over {d.pipeline_stages} pipeline stage(s), whose schedule "
                f"serves the planned shapes only ({_shapes_text(pm.binder, self.planned.shapes, '')}): "
                "use batches of the planned shape, or plan without pipeline stages and "
                "micro-batches to serve any shape")
        model = self.model
        if model is None:
            raise InputMismatchError(
                f"{_shapes_text(pm.binder, want)}: serving a new shape captures the model passed "
                "to auto_parallel at that shape, and a module loaded from an export has none: "
                f"call it with the planned shapes ({_shapes_text(pm.binder, self.planned.shapes, '')}), "
                "or build it with auto_parallel(model, plan=...)")
        t0 = time.perf_counter()
        args, kwargs = self._example(pm, want, flat)
        cap = self._capture(pm, model, args, kwargs)
        plan = pm.plan
        if not _same_graph(cap.gm, plan):
            # the model's graph differs at this shape (export drops ops that are no-ops
            # at a batch of 1): plan again, parameters where they are
            if self.replan is None or pm.binder.mode is BatchMode.LOCAL:
                raise InputMismatchError(
                    f"{_shapes_text(pm.binder, want)}: the model's graph at this shape differs "
                    "from the one planned; call it with the planned shapes or plan at this shape")
            log.info("shape %s: the model's graph differs from the planned one: planning it "
                     "again with every parameter where it is", list(want))
            cap, plan = self._in_mode(model, lambda: self.replan(model, args, kwargs, pm.plan))
            annotate(cap.gm)
        plan, dropped = _fit(plan, cap.gm, pm.binder, want)
        from autopar.passes.lower import lower
        gm = _adopt(pm, lower(cap.gm, plan))
        keep = passthrough_inputs(plan)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        route = Route(self.templates.add(gm, pm.training), list(want),
                      frozenset(i for i, n in enumerate(phs) if n.name in keep))
        self.built += 1
        log.info("shape %s: captured and lowered with the plan in %.2f s%s", list(want),
                 time.perf_counter() - t0,
                 f" (axes {sorted(dropped)} compute the whole of the dims they would split)"
                 if dropped else "")
        return route

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
        cap = self._in_mode(model, lambda: capture(model, args, kwargs,
                                                   precision=pm.plan.decisions.precision))
        annotate(cap.gm)
        return cap

    def _in_mode(self, model, fn: Callable):
        """``fn()`` with ``model`` in the planned graph's train/eval mode and its
        replaced-weights checks off (:func:`autopar.module.habits.building`)."""
        from autopar.module.habits import building

        mode = model.training
        model.train(self.training)
        try:
            with building():
                return fn()
        finally:
            model.train(mode)


def structure_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, FakeTensorMode]:
    """A copy of ``model`` whose parameters and buffers are fake tensors (same shapes,
    dtypes, devices and strides, no storage), and their fake mode: what capture needs,
    without the weights' memory.  Not the meta device: torch picks kernels by device
    (SDPA's CPU kernel lays its output out so that no ``contiguous`` follows; on meta one
    does), and the graph must be the planned one."""
    from autopar.module.habits import building

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    with building():
        return copy.deepcopy(model, memo), mode


def _same_graph(gm: fx.GraphModule, plan: Plan) -> bool:
    """Whether ``gm`` has the planned graph's ops on the same inputs (what lowering
    checks node by node)."""
    from autopar.capture.ir import tensor_inputs

    for n in gm.graph.nodes:
        np_ = plan.nodes.get(n.name)
        if n.op == "call_function" and n.target is not operator.getitem:
            if np_ is None or [u.name for u in tensor_inputs(n)] != np_.inputs:
                return False
    return True


def _batch_inputs(shapes: list) -> frozenset[int]:
    """Flat inputs whose dim 0 is the batch: dim 0 of the planned shape equal to the first
    tensor input's (:func:`autopar.plan.placement.graph_batch`'s convention)."""
    first = next((s for s in shapes if s), None)
    if not first:
        return frozenset()
    return frozenset(i for i, s in enumerate(shapes) if s and s[0] == first[0])


def _fit(plan: Plan, gm: fx.GraphModule, binder, want: Shapes) -> tuple[Plan, set[int]]:
    """``plan`` for the graph ``gm`` captured at ``want``: as it is where every split dim
    divides by its axes; else with as few axes as make every split divide dropped from
    the activations (replicated there: a batch of 8 on 2 x 8 ranks splits 8 ways on the
    second axis), when they split no parameter."""
    mesh = plan.mesh.shape
    dropped: set[int] = set()
    while True:
        bad = _undivided(plan, gm, dropped)
        if not bad:
            break
        dropped.update(unsplit_axes(*bad, mesh))
    if not dropped:
        return plan, dropped
    split = sorted(a for a in dropped if any(not is_replicate(parse_placements(p)[a])
                                              for p in plan.params().values()))
    if split:
        n = math.prod(mesh[a] for a in dropped)
        raise InputMismatchError(
            f"{_shapes_text(binder, want)}: a dim this plan splits over mesh axes "
            f"{sorted(dropped)} does not divide by their {n} ranks, and axes {split} also split "
            f"parameters, so they cannot compute it whole: pad the batch and the sequence to "
            f"multiples of {n} (a collator's pad_to_multiple_of={n}), with the padding masked")
    return _drop_axes(plan, dropped), dropped


def _undivided(plan: Plan, gm: fx.GraphModule, dropped: set[int]) -> tuple[int, list[int]] | None:
    """(size, axes) of the first activation dim that the axes not in ``dropped`` split
    unevenly, or ``None``."""
    from autopar.capture.ir import info

    mesh = plan.mesh.shape
    for n in gm.graph.nodes:
        np_ = plan.nodes.get(n.name)
        if np_ is None or np_.param or "autopar" not in n.meta:
            continue
        outs = info(n).outputs
        for k, text in enumerate(np_.out_placements[:len(outs)]):
            shape = outs[k].shape
            pl = parse_placements(text)
            for dim in sorted({p.dim for p in pl if isinstance(p, Shard)}):
                axes = [a for a, p in enumerate(pl)
                        if isinstance(p, Shard) and p.dim == dim and a not in dropped]
                if axes and dim < len(shape) and shape[dim] % math.prod(mesh[a] for a in axes):
                    return shape[dim], axes
    return None


def _drop_axes(plan: Plan, axes: set[int]) -> Plan:
    """``plan`` with every activation replicated on ``axes`` (no split, no partial sum):
    the ranks along them compute the same whole values."""
    def fix(text: str) -> str:
        pl = parse_placements(text)
        return fmt_placements(tuple(Replicate() if a in axes else p for a, p in enumerate(pl)))

    nodes = {k: (v if v.param else replace(v, in_placements=[fix(t) for t in v.in_placements],
                                           out_placements=[fix(t) for t in v.out_placements]))
             for k, v in plan.nodes.items()}
    d = plan.decisions
    local = None if d.local_axes is None else [a for a in d.local_axes if a not in axes]
    return replace(plan, nodes=nodes, decisions=replace(d, local_axes=local))


def _adopt(pm: ParallelModule, gm: fx.GraphModule) -> fx.GraphModule:
    """The lowered graph ``gm`` reading ``pm``'s own parameters, buffers and constants,
    with the runtime's graph rewrites applied as to the planned graph."""
    from autopar.passes.device import set_device

    if pm.zero is not None:
        pm.zero.rewrite(gm)
    root: dict[str, object] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target in root:
            continue
        get = operator.attrgetter(n.target)
        try:
            root[n.target] = get(pm.inner)
        except AttributeError:  # a constant captured at this shape alone
            root[n.target] = get(gm).to(pm._mesh_rt.device)
    new = fx.GraphModule(root, gm.graph)
    new._in_spec, new._out_spec = getattr(gm, "_in_spec", None), getattr(gm, "_out_spec", None)
    if pm.plan.decisions.recompute:
        from autopar.passes.recompute import recompute
        recompute(new, set(pm.plan.decisions.recompute))
    set_device([new], pm._mesh_rt.device)
    new.recompile()
    return new


def _cross_dp(gm: fx.GraphModule, dp_axes: tuple[int, ...]) -> bool:
    """Whether ``gm`` moves activations (values computed from its inputs) over a
    data-parallel axis.  A sum of a scalar (the loss, a token count) does not count, nor
    a gathered parameter (its shape is the same at every batch)."""
    from autopar.runtime import collectives as C
    from autopar.runtime import experts as E

    moving = {C.all_gather: 2, C.reduce_scatter: 2, C.all_to_all: 3, C.all_reduce: 1}
    data: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(u in data for u in n.all_input_nodes):
            data.add(n)
        if n.op != "call_function" or n not in data:
            continue
        if getattr(n.target, "__module__", "") == E.__name__:
            return True
        k = moving.get(n.target)
        if k is None or len(n.args) <= k:
            continue
        axis = n.args[k]
        axes = set(axis) if isinstance(axis, (tuple, list)) else {axis}
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        scalar = isinstance(val, torch.Tensor) and val.dim() == 0
        if axes & set(dp_axes) and not scalar:
            return True
    return False


def _exchange(mine: Shapes, failed: bool, planned: list, pm: ParallelModule
              ) -> list[tuple[Shapes | None, bool]]:
    """Every rank's (shapes as passed, whether it cannot run them): one all-gather of
    a few integers, laid out like the planned shapes (a rank whose tensors have other
    ranks is marked as failing: its own error says why)."""
    dims = [len(s) if s is not None else -1 for s in planned]
    fits = [len(s) if s is not None else -1 for s in mine] == dims
    row = [int(failed or not fits)] + [v for s in mine if s is not None for v in s] if fits \
        else [1] + [0] * sum(max(0, k) for k in dims)
    out = []
    for vals in gather_rows(row, pm._mesh_rt.device).tolist():
        shapes, i = [], 1
        for k in dims:
            shapes.append(None if k < 0 else tuple(vals[i:i + k]))
            i += max(0, k)
        out.append((tuple(shapes), bool(vals[0])))
    return out


def _shapes_text(binder, shapes, prefix: str = "called with ") -> str:
    parts = [f"{binder.names[i] if i < len(binder.names) else i} {tuple(s)}"
             for i, s in enumerate(shapes) if s is not None]
    return prefix + ", ".join(parts)


__all__ = ["MAX_SHAPES", "Route", "ShapeRoutes", "structure_copy"]
