"""How a module captures the model at a shape it has not served yet.

The first new shape of a kind (the dims that differ from the planned shape: the length,
the batch, both) is exported as the plan was (:func:`~autopar.capture.trace.capture`).
The second is exported twice, once fixed and once with those dims symbolic
(:func:`~autopar.capture.any_shape.capture_any_shape`), and the symbolic graph is kept
when it gives the fixed export's graph at that shape: every later shape of that kind is
that graph given its numbers (:meth:`~autopar.capture.any_shape.AnyShape.at`: ~0.1 s
for benchmarks/variable_length.py's Llama against ~0.35 s for an export), the same graph
an export would give.  A kind met once (a short last batch, an evaluation at batch 1)
costs no symbolic export; a kind whose symbolic graph is not the export's (a model that
branches on the length, a batch of 1) is exported at each shape, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.capture.any_shape import AnyShape, capture_any_shape
from autopar.capture.trace import Captured, capture
from autopar.plans.kinds import Precision

_FAILED = "failed"
"""A kind whose symbolic graph was not the export's: exported at each shape."""


@dataclass
class ShapeCaptures:
    """The captures of one module's new shapes (see the module docstring); ``planned``:
    the flat inputs' planned shapes."""

    planned: list[tuple[int, ...] | None]
    kinds: dict[tuple, int | AnyShape | str] = field(default_factory=dict)
    """Per kind: fixed exports so far, its symbolic graph, or :data:`_FAILED`."""
    exported: int = 0
    """Shapes exported (the fixed way)."""
    instantiated: int = 0
    """Shapes given by a symbolic graph, exported no more."""

    def capture(self, model: nn.Module, args: tuple, kwargs: dict, precision: Precision | str,
                mode: FakeTensorMode | None) -> Captured:
        """The model's capture at ``(args, kwargs)`` (fake tensors of ``mode``)."""
        mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
        leaves = pytree.tree_leaves((args, kwargs))
        key = _kind(leaves, self.planned)
        state = self.kinds.get(key, 0)
        if isinstance(state, AnyShape):
            cap = state.at(args, kwargs, mode)
            if cap is not None:
                self.instantiated += 1
                return cap
        self.exported += 1
        if state == 1 and key:
            cap, sym = capture_any_shape(model, args, kwargs, precision, self.planned)
            self.kinds[key] = sym if sym is not None else _FAILED
            return cap
        if isinstance(state, int):
            self.kinds[key] = state + 1
        return capture(model, args, kwargs, precision=precision)


def _kind(leaves: list, planned: list) -> tuple:
    """Which dims of the call differ from the planned shapes: (input, dim) pairs."""
    out = []
    for i, (x, p) in enumerate(zip(leaves, planned)):
        if isinstance(x, torch.Tensor) and p is not None and len(p) == x.dim():
            out.extend((i, d) for d, (k, was) in enumerate(zip(x.shape, p)) if k != was)
    return tuple(out)


__all__ = ["ShapeCaptures"]
