"""One capture for every micro-batch size.

The joint search prices each (pipeline stages, micro-batches) split on the graph at that
split's micro-batch size.  Exporting the model once per size cost ~0.8 s per size for a
4-layer copy of Llama-3 70B, five sizes in one 1,024-device search.  Here the model is
exported once with a dynamic batch dim (every input whose dim 0 is the batch shares one
symbol), capture's passes (:func:`autopar.capture.trace.finish`) run once on that graph, and a
size is a copy of it with the batch symbol's expressions replaced by numbers and the
shapes propagated again with fake tensors.

The joint search uses it for its estimates (the shallow copy of the model,
:mod:`autopar.search.shallow`); the plan it returns is planned on a graph exported at its own
size.  Under ``blocks=`` (the user's model is the shallow stand-in, and its plans are never
lowered) every size after the first comes from it.  A size's copy is not the same graph as an export at that size: it keeps a few
no-op slices (whole-dim ``slice`` ops that a fixed-size export drops), which the rules
shard like their input.  A test checks that it prices exactly like that export (input
shapes, and every layer's time, compute, activations and parameter bytes under the
chosen plan, on HF Llama, Mixtral and GPT-2).  A model whose export fixes the batch (code that
branches on it) or a size of 1 (export specializes sizes 0 and 1) is exported per size as
before: :meth:`AnyBatch.at` returns ``None`` for it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import sympy
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from autopar.capture.graph_numbers import SYMBOLIC, inline, value_at
from autopar.capture.trace import Captured, captured, export_module, finish
from autopar.log import log
from autopar.plans.kinds import Precision


@dataclass
class AnyBatch:
    """A model captured once with a symbolic batch (``base``: its graph, with the names,
    specs and state keys every size shares): :meth:`at` gives it at one size."""

    base: Captured
    symbol: sympy.Symbol

    def at(self, size: int) -> Captured | None:
        """The capture at batch ``size`` (``None`` when this graph cannot give it: then
        export at that size)."""
        if size < 2:
            return None
        t0 = time.perf_counter()
        g = fx.Graph()
        g.output(g.graph_copy(self.base.gm.graph, {}))
        gm = fx.GraphModule(self.base.gm, g)
        gm._in_spec, gm._out_spec = self.base.in_spec, self.base.out_spec
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        inputs = []
        try:
            for n in list(g.nodes):
                val = n.meta.get("val")
                if n.op == "placeholder":
                    inputs.append(self._input(val, size, mode))
                elif isinstance(val, SYMBOLIC):
                    inline(n, self._number(val, size))
            g.eliminate_dead_code()
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
        except Exception as e:  # noqa: BLE001 - a shape this graph cannot give: export instead
            log.debug("the symbolic-batch graph gives no batch of %d (%s: %s): exported instead",
                      size, type(e).__name__, e)
            return None
        gm.recompile()
        # same parameters, inputs and specs as the symbolic graph: its names serve
        return dataclasses.replace(self.base, gm=gm, seconds=time.perf_counter() - t0)

    def _number(self, val: object, size: int) -> object:
        """The value of a symbolic int/bool/float of the graph at batch ``size``."""
        return value_at(val, {self.symbol: size})

    def _input(self, val: object, size: int, mode: FakeTensorMode) -> object:
        if isinstance(val, SYMBOLIC):
            return self._number(val, size)
        if not isinstance(val, torch.Tensor):
            return val
        shape = [self._number(s, size) if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
        with mode:
            return torch.empty(shape, dtype=val.dtype, device=val.device)


def capture_any_batch(model: nn.Module, call: tuple, precision: Precision | str) -> AnyBatch | None:
    """Export ``model`` called with ``call`` (``(args, kwargs)``) once with dim 0 of every
    batch-sized input dynamic; ``None`` when export will not keep the batch symbolic."""
    t0 = time.perf_counter()
    leaves = [x for x in pytree.tree_leaves(call) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not leaves or leaves[0].shape[0] < 2:
        return None
    b = leaves[0].shape[0]
    # one tensor passed twice (``input_ids`` as ``labels``) would be one fake tensor to
    # export with a dynamic dim, and the graph would read both from one input
    seen: set[int] = set()

    def distinct(x: object) -> object:
        if isinstance(x, torch.Tensor) and id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x

    args, kwargs = pytree.tree_map(distinct, call)
    leaves = [x for x in pytree.tree_leaves((args, kwargs))
              if isinstance(x, torch.Tensor) and x.dim() > 0]
    shapes = torch.export.ShapesCollection()
    dim = torch.export.Dim("batch", min=2)
    for x in leaves:
        if x.shape[0] == b:
            shapes[x] = {0: dim}
    try:
        gm = export_module(model, args, kwargs, shapes.dynamic_shapes(model, tuple(args), kwargs))
        symbols = {s for n in gm.graph.nodes if n.op == "placeholder"
                   for s in _free(n.meta.get("val"))}
        if len(symbols) != 1:
            log.debug("no symbolic-batch capture: the export has %d free symbols", len(symbols))
            return None  # the batch was specialized away, or something else is dynamic
        finish(gm, precision)  # capture's passes on a symbolic graph: may fail where an export would not
    except Exception as e:  # noqa: BLE001 - the model fixes its batch: export per size
        log.debug("no symbolic-batch capture (%s: %s): exported per size", type(e).__name__, e)
        return None
    return AnyBatch(captured(model, gm, time.perf_counter() - t0), symbols.pop())


def _free(val: object) -> set:
    if not isinstance(val, torch.Tensor):
        return set()
    return {f for s in val.shape if isinstance(s, torch.SymInt) for f in s.node.expr.free_symbols}


__all__ = ["AnyBatch", "capture_any_batch"]
