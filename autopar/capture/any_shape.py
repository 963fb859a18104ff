"""One export for every length: a model exported with symbolic dims, given numbers per call.

A module serving shapes other than the planned one (:mod:`autopar.module.shapes`) needs
the model's graph at each new shape.  Exporting it again costs ~0.4-0.8 s a shape (the
export's Python tracing of the whole model); a fine-tuning loop whose batches are padded
to their own longest sequence meets a new length nearly every step.  Here the model is
exported once with the dims that change (every input dim that differs from the planned
shape, dims that change together sharing one symbol), the passes of capture that read no
shape run on that symbolic graph (:func:`~autopar.capture.trace.finish_shapeless`), and a
shape is a copy of it with each symbol's expressions replaced by numbers, shapes
remade at those numbers, the slices that are whole at those numbers dropped
(a fixed-shape export never records them), and the shape-reading passes run
(:func:`~autopar.capture.trace.finish_shaped`): the graph a fixed-shape export would give,
up to node names, which are then taken from that export's graph by position.

:meth:`AnyShape.at` returns ``None`` where the copy cannot stand for an export (another
dim changed, a number outside the range export proved the graph for, a graph with other
ops); its caller then exports at that shape.  Its caller also checks the copy against a
real export at one shape before trusting it (:func:`capture_any_shape`): the same ops on the same
inputs and the same numbers.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import sympy
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.capture.graph_numbers import SYMBOLIC, inline, numbers, signature, value_at
from autopar.capture.trace import Captured, captured, export_module, finish_shaped, finish_shapeless
from autopar.log import log
from autopar.plans.kinds import Precision

_SLICE = torch.ops.aten.slice.Tensor
_ALIAS = torch.ops.aten.alias.default


@dataclass
class AnyShape:
    """A model exported with symbolic dims (``gm``: shapeless passes run) and the fixed
    export it was checked against (``base``: node names, specs, state keys)."""

    gm: fx.GraphModule
    base: Captured
    names: list[tuple[str, object, str]]
    """The fixed export's nodes before its shape-reading passes: (op, target, name)."""
    precision: Precision | str
    ranges: dict[sympy.Symbol, tuple[int, float]]

    def at(self, args: tuple, kwargs: dict, mode: FakeTensorMode) -> Captured | None:
        """The capture for a call with ``(args, kwargs)`` (fake tensors of ``mode``), or
        ``None`` when this graph cannot give it (then export at that shape)."""
        t0 = time.perf_counter()
        leaves = pytree.tree_leaves((args, kwargs))
        env = self._symbols(leaves)
        if env is None:
            return None
        try:
            gm = _renamed(_instantiate(self.gm, env, leaves, mode), self.names)
            if gm is not None:
                finish_shaped(gm, self.precision)
        except Exception as e:  # noqa: BLE001 - a shape this graph cannot give: export instead
            log.debug("the symbolic graph gives no graph at %s (%s: %s): exported instead",
                      env, type(e).__name__, e)
            return None
        if gm is None or signature(gm) != self._signature:
            return None
        return dataclasses.replace(self.base, gm=gm, seconds=time.perf_counter() - t0)

    def __post_init__(self) -> None:
        self._signature = signature(self.base.gm)

    def _symbols(self, leaves: list) -> dict[sympy.Symbol, int] | None:
        """Each symbol's number for a call with flat inputs ``leaves``; ``None`` when a
        dim the graph fixes differs, one symbol would take two numbers, or a number is
        out of its range."""
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(leaves) != len(phs):
            return None
        env: dict[sympy.Symbol, int] = {}
        for n, x in zip(phs, leaves):
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) != isinstance(x, torch.Tensor):
                return None
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() != x.dim():
                return None
            for s, k in zip(v.shape, x.shape):
                if not isinstance(s, torch.SymInt):
                    if int(s) != k:
                        return None
                elif not isinstance(s.node.expr, sympy.Symbol) or env.setdefault(s.node.expr, k) != k:
                    return None
        for sym, k in env.items():
            lo, hi = self.ranges.get(sym, (2, float("inf")))
            if not lo <= k <= hi:
                return None
        return env


def _instantiate(base: fx.GraphModule, env: dict, leaves: list, mode: FakeTensorMode) -> fx.GraphModule:
    """``base`` with its symbols at ``env``'s numbers: symbolic values inlined as
    numbers, and every node's fake value remade at the numbers its symbolic sizes and
    strides take (what running the ops on fake tensors would give, at ~1/10 the cost;
    :func:`capture_any_shape` checks both against an export once)."""
    g = fx.Graph()
    g.output(g.graph_copy(base.graph, {}))
    g._codegen = base.graph._codegen
    gm = fx.GraphModule(base, g)
    k = 0
    for n in list(g.nodes):
        val = n.meta.get("val")
        if n.op == "placeholder":
            x = leaves[k]
            k += 1
            n.meta["val"] = mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
        elif isinstance(val, SYMBOLIC):
            inline(n, value_at(val, env))
        elif val is not None:
            n.meta["val"] = _concrete(val, env, mode)
    g.eliminate_dead_code()
    return gm


def _concrete(val: object, env: dict, mode: FakeTensorMode) -> object:
    """A node's fake value with its symbolic sizes and strides at ``env``."""
    if isinstance(val, torch.Tensor):
        size = [value_at(d, env) if isinstance(d, torch.SymInt) else d for d in val.shape]
        stride = [value_at(d, env) if isinstance(d, torch.SymInt) else d for d in val.stride()]
        with mode:
            out = torch.empty_strided(size, stride, dtype=val.dtype, device=val.device)
        return out.requires_grad_(val.requires_grad) if val.requires_grad else out
    if isinstance(val, (tuple, list)):
        return type(val)(_concrete(v, env, mode) for v in val)
    return value_at(val, env) if isinstance(val, SYMBOLIC) else val


def _whole_slice(n: fx.Node) -> bool:
    """Whether ``n`` is a ``slice`` that keeps all of its input (step 1 from 0)."""
    if n.op != "call_function" or n.target is not _SLICE or not isinstance(n.args[0], fx.Node):
        return False
    a = list(n.args) + [None] * (5 - len(n.args))
    vi, vo = n.args[0].meta.get("val"), n.meta.get("val")
    return (a[2] or 0) == 0 and (a[4] if a[4] is not None else 1) == 1 and \
        isinstance(vi, torch.Tensor) and isinstance(vo, torch.Tensor) and vi.shape == vo.shape


def _renamed(gm: fx.GraphModule, ref: list[tuple[str, object, str]]) -> fx.GraphModule | None:
    """``gm`` node by node as ``ref`` (a fixed-shape export's nodes: op, target, name):
    its names, and its whole slices as that export records them (none, or an ``alias``
    where indexing did nothing else); ``None`` where the ops differ otherwise."""
    mine = list(gm.graph.nodes)
    g = fx.Graph()
    g._codegen = gm.graph._codegen  # the calling convention finish_shaped flattens
    env: dict[fx.Node, fx.Node] = {}
    i = 0
    for op, tgt, name in ref:
        while i < len(mine) and (mine[i].op, mine[i].target) != (op, tgt):
            if not _whole_slice(mine[i]) or tgt is _ALIAS:
                break
            env[mine[i]] = env[mine[i].args[0]]  # a whole slice the export elides
            i += 1
        if i == len(mine):
            return None
        a = mine[i]
        args, kwargs = fx.map_arg(a.args, env.__getitem__), fx.map_arg(a.kwargs, env.__getitem__)
        target = a.target
        if (a.op, a.target) != (op, tgt):
            if not (_whole_slice(a) and tgt is _ALIAS):
                return None
            target, args, kwargs = _ALIAS, (args[0],), {}
        new = g.create_node(a.op, target, args, kwargs, name, a.type)
        new.meta = a.meta
        env[a] = new
        i += 1
    if i != len(mine):
        return None
    return fx.GraphModule(gm, g)


def capture_any_shape(model: nn.Module, args: tuple, kwargs: dict, precision: Precision | str,
                      planned: list[tuple[int, ...] | None]) -> tuple[Captured, AnyShape | None]:
    """``model`` captured at ``(args, kwargs)`` as :func:`~autopar.capture.trace.capture`
    does, and exported once more with every dim that differs from ``planned`` (the flat
    inputs' planned shapes) symbolic, dims with equal planned and new sizes sharing one
    symbol: an :class:`AnyShape` when that graph gives this capture's graph here (the
    same ops, inputs and numbers), else ``None`` (export fixes a dim, or the graphs
    differ: export per shape)."""
    t0 = time.perf_counter()
    gm = export_module(model, args, kwargs)
    finish_shapeless(gm)
    names = [(n.op, n.target, n.name) for n in gm.graph.nodes]
    finish_shaped(gm, precision)
    base = captured(model, gm, time.perf_counter() - t0)
    leaves = pytree.tree_leaves((args, kwargs))
    shapes = _dynamic(leaves, planned)
    if shapes is None:
        return base, None
    t0 = time.perf_counter()
    try:
        sym = export_module(model, args, kwargs, shapes.dynamic_shapes(model, tuple(args), kwargs))
        finish_shapeless(sym)
        out = AnyShape(sym, base, names, precision, _ranges(sym))
        got = out.at(args, kwargs, _mode(leaves))
    except Exception as e:  # noqa: BLE001 - the model fixes these dims: export per shape
        log.debug("no symbolic-shape capture (%s: %s): exported per shape", type(e).__name__, e)
        return base, None
    if got is None or not _same(got.gm, base.gm):
        log.debug("the symbolic-shape graph is not the export's: exported per shape")
        return base, None
    log.info("captured once with symbolic dims in %.2f s: new shapes of this kind are not "
             "exported again", time.perf_counter() - t0)
    return base, out


def _dynamic(leaves: list, planned: list) -> torch.export.ShapesCollection | None:
    """Export's dynamic dims: every dim of ``leaves`` that differs from ``planned`` (both
    sizes at least 2: export fixes 0 and 1), one symbol per (planned, new) pair."""
    if len(leaves) != len(planned):
        return None
    dims: dict[tuple[int, int], object] = {}
    shapes = torch.export.ShapesCollection()
    for x, p in zip(leaves, planned):
        if not isinstance(x, torch.Tensor) or p is None or len(p) != x.dim():
            continue
        spec = {}
        for d, (k, was) in enumerate(zip(x.shape, p)):
            if k != was and min(k, was) >= 2:
                spec[d] = dims.setdefault((was, k), torch.export.Dim(f"d{len(dims)}", min=2))
        if spec:
            shapes[x] = spec
    return shapes if dims else None


def _mode(leaves: list) -> FakeTensorMode:
    for x in leaves:
        mode = getattr(x, "fake_mode", None)
        if mode is not None:
            return mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def _ranges(gm: fx.GraphModule) -> dict[sympy.Symbol, tuple[int, float]]:
    """Each input symbol's range as export proved the graph for it."""
    out: dict[sympy.Symbol, tuple[int, float]] = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        for s in v.shape if isinstance(v, torch.Tensor) else ():
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                r = s.node.shape_env.var_to_range.get(s.node.expr)
                if r is not None:
                    hi = float(r.upper) if r.upper.is_finite else float("inf")
                    out[s.node.expr] = (int(r.lower), hi)
    return out


def _same(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """The same ops on the same inputs with the same arguments and output shapes."""
    if signature(a) != signature(b) or numbers(a) != numbers(b):
        return False
    return [_shape(n) for n in a.graph.nodes] == [_shape(n) for n in b.graph.nodes]


def _shape(n: fx.Node) -> object:
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        return tuple(_shape_of(x) for x in v)
    return _shape_of(v)


def _shape_of(v: object) -> object:
    if not isinstance(v, torch.Tensor):
        return v if isinstance(v, (int, float, bool)) or v is None else type(v).__name__
    return tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad


__all__ = ["AnyShape", "capture_any_shape"]
