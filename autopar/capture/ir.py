"""The IR: an aten-level ``torch.fx`` graph plus one :class:`NodeInfo` per node.

Every analysis pass writes its result into ``node.meta["autopar"]``; the graph itself
only ever holds ``placeholder``, ``get_attr``, ``call_function`` and ``output`` nodes
whose targets are aten overloads (``torch.ops.aten.*``), ``operator.getitem`` or
autopar's own runtime functions inserted by the lowering passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

META_KEY = "autopar"


@dataclass(frozen=True)
class TensorInfo:
    """Global shape and dtype of one tensor value."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) tensor."""
        return self.numel * _itemsize(self.dtype)

    @property
    def ndim(self) -> int:
        """Number of tensor dims."""
        return len(self.shape)


def _itemsize(dtype: torch.dtype) -> int:
    # (not a meta tensor per call: a deep model's search asks this millions of times)
    return dtype.itemsize


@dataclass
class NodeInfo:
    """What the annotate pass knows of a node.

    ``outputs`` holds one :class:`TensorInfo` per tensor output (several for ops that
    return tuples, none for nodes that produce no tensor); ``tuple_output`` says whether
    the node returns a tuple (consumers then read it through ``getitem``).
    """

    outputs: tuple[TensorInfo, ...] = ()
    tuple_output: bool = False
    flops: float = 0.0
    bytes_moved: float = 0.0
    param: str | None = None  # get_attr target of a parameter
    buffer: str | None = None  # get_attr target of a buffer
    extra: dict = field(default_factory=dict)
    backward: bool = True
    """The value receives a gradient in the backward (:mod:`autopar.capture.grad_flow`; True
    where nothing marked it)."""
    returned_grad: bool = True
    """Returned to the caller as a differentiated output (the loss)."""

    @property
    def out(self) -> TensorInfo:
        """The single tensor output (raises for tuple or tensor-less nodes)."""
        if len(self.outputs) != 1 or self.tuple_output:
            raise ValueError("node has no single tensor output")
        return self.outputs[0]


def info(node: fx.Node) -> NodeInfo:
    """The :class:`NodeInfo` of ``node`` (written by :func:`autopar.capture.annotate.annotate`)."""
    return node.meta[META_KEY]


def arg(node: fx.Node, idx: int, name: str, default: object = None) -> object:
    """Argument ``idx`` (or keyword ``name``) of ``node``, or ``default``."""
    if len(node.args) > idx:
        return node.args[idx]
    return node.kwargs.get(name, default)


def is_tensor_node(node: object) -> bool:
    """True for a graph node whose value is exactly one tensor."""
    return (
        isinstance(node, fx.Node)
        and META_KEY in node.meta
        and len(info(node).outputs) == 1
        and not info(node).tuple_output
    )


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The distinct tensor-valued input nodes of ``node`` in argument order.

    Rules give one placement per entry of this list, so its order is the contract
    between the rule registry, the solver and the lowering passes.
    """
    seen: list[fx.Node] = []
    for a in node.all_input_nodes:
        if is_tensor_node(a) and a not in seen:
            seen.append(a)
    return seen
