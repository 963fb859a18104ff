"""What a (pipeline stages, micro-batches) split means outside the search: the global
batch and its first micro-batch (positional and keyword inputs alike), the stage
sub-mesh carved out of mesh axis 0, and the plan's :class:`~autopar.plan.Request`
read from the graph captured at the micro-batch size."""

from __future__ import annotations

import dataclasses

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.cost_models import MeshSpec
from autopar.errors import PlanError
from autopar.ir import info
from autopar.plan import Request


def batch_size(example_inputs) -> int:
    """The global batch: dim 0 of the first tensor in the inputs, a pytree (positional
    arguments, or ``(args, kwargs)`` for models called as ``model(**batch)``)."""
    for x in pytree.tree_leaves(example_inputs):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise PlanError("micro-batching needs a tensor input with a batch dim (dim 0); the "
                    "example inputs (positional and keyword) hold none")


def micro_inputs(example_inputs, micro_batches: int):
    """The first micro-batch of a pytree of inputs: every tensor whose dim 0 is the
    batch, cut to ``B / M``; the structure is kept."""
    b = batch_size(example_inputs)
    if b % micro_batches:
        raise PlanError(f"the batch of {b} does not split into {micro_batches} micro-batches")
    m = b // micro_batches
    return pytree.tree_map(
        lambda x: x[:m] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == b else x,
        example_inputs)


def split_mesh(mesh: MeshSpec, stages: int) -> tuple[MeshSpec, MeshSpec]:
    """(full mesh with a leading pipeline axis, one stage's sub-mesh) for ``stages``
    pipeline stages carved out of mesh axis 0 (the outermost, slowest one)."""
    if stages == 1:
        return mesh, mesh
    a0 = mesh.shape[0]
    if a0 % stages:
        raise PlanError(f"{stages} pipeline stages do not divide mesh axis 0 of size {a0}")
    rest = ((a0 // stages,) if a0 > stages else ()) + tuple(mesh.shape[1:])
    full = mesh.with_shape((stages, *rest))
    if rest:
        sub = dataclasses.replace(full, shape=full.shape[1:], links=full.links[1:],
                                  axis_names=full.axis_names[1:])
    else:
        sub = dataclasses.replace(full, shape=(1,), links=full.links[:1], axis_names=("a0",))
    return full, sub


def request(gm: fx.GraphModule, micro_batches: int, mesh_shape: list[int],
            budget: float) -> Request:
    """The plan's :class:`~autopar.plan.Request` from the graph captured at the
    micro-batch size: tokens are read from the first integer input of two or more dims
    (token ids: batch x sequence), FLOPs from the annotated ops (x3: forward + backward)."""
    tokens = 0
    for n in gm.graph.nodes:
        if n.op != "placeholder" or info(n).param or info(n).buffer or len(info(n).outputs) != 1:
            continue
        t = info(n).out
        if t.ndim >= 2 and not t.dtype.is_floating_point and not t.dtype.is_complex \
                and t.dtype != torch.bool:
            tokens = t.shape[0] * t.shape[1] * micro_batches
            break
    flops = sum(info(n).flops for n in gm.graph.nodes if n.op == "call_function")
    return Request(mesh_shape=mesh_shape, memory_budget_bytes=float(budget), tokens_per_step=tokens,
                   model_flops_per_step=3.0 * flops * micro_batches)


def micro_counts(batch: int, stages: int) -> list[int]:
    """The counts of micro-batches that divide ``batch``, ascending, those below
    ``stages`` left out (a pipeline needs a micro-batch per stage) unless none is left."""
    opts = [m for m in range(1, batch + 1) if batch % m == 0]
    return [m for m in opts if m >= stages] or opts[-1:]


__all__ = ["batch_size", "micro_counts", "micro_inputs", "request", "split_mesh"]
