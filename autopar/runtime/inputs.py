"""How a ParallelModule takes its inputs: call structure, shapes and local batches.

The generated graph has a flat calling convention (one placeholder per tensor leaf of
the traced call).  :class:`InputBinder` turns a user's call, positional or
``model(**batch)`` with keywords in any order, into that flat list, and refuses what
the plan cannot run exactly: another call structure, or another shape (a smaller last
batch, a shorter sequence) - never truncating silently.

With ``batch="local"`` each data-parallel rank passes only its part of the global
batch (as a ``DistributedSampler`` gives it).  An input the plan splits over exactly
the data-parallel axes goes to the graph as it is (:func:`passthrough_inputs`: plain
data parallel issues no collective for its inputs, as DDP); any other batch tensor is
all-gathered over the data-parallel axes so the graph sees the global batch it was
planned for (one collective of the input's bytes per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.plans.placement import parse_placements
from autopar.runtime.mesh import current
from autopar.runtime.shards import gather_tensor, shard_tensor


class BatchMode(StrEnum):
    """Who passes which samples: every rank the whole global batch, or each
    data-parallel rank its own part."""

    GLOBAL = "global"
    LOCAL = "local"


class InputMismatchError(AutoparError, ValueError):
    """The call's structure or shapes differ from the ones the plan was made for."""


def _path_str(path) -> str:
    s = pytree.keystr(path)
    # the traced call is (args, kwargs): say "input_ids" rather than "[1]['input_ids']"
    if s.startswith("[0]"):
        return "positional argument " + s[3:] if s[3:] else "positional arguments"
    if s.startswith("[1]"):
        return "keyword argument " + s[3:]
    return s or "input"


@dataclass
class InputBinder:
    """Binds calls to the flat inputs of the generated graph (see the module docstring).

    ``spec``: the traced call's tree spec of ``(args, kwargs)``; ``shapes``: the planned
    shape of every leaf (``None`` for non-tensors), for the global batch."""

    spec: object = None
    shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    mode: BatchMode = BatchMode.GLOBAL
    dp_axes: tuple[int, ...] = ()
    passthrough: frozenset[int] = frozenset()
    """Flat inputs taken as this rank's rows without a gather (:func:`passthrough_inputs`;
    the lowered graph does not slice them)."""
    select: Callable[[list], object] | None = field(default=None, repr=False, compare=False)
    """Chooses the lowering a call runs (its ``shapes`` and ``passthrough``) from the
    flat inputs as passed; ``None``: the planned shapes only."""

    @classmethod
    def from_example(cls, args: Sequence, kwargs: dict | None, spec, mode: BatchMode | str = "global",
                     dp_axes: tuple[int, ...] = ()) -> InputBinder:
        """The binder for calls like ``model(*args, **kwargs)``."""
        leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs or {})))
        return cls(spec, [tuple(x.shape) if isinstance(x, torch.Tensor) else None for _, x in leaves],
                   [_path_str(p) for p, _ in leaves], BatchMode(mode), tuple(dp_axes))

    def _kwargs_order(self) -> list[str] | None:
        try:
            child = self.spec.child(1) if hasattr(self.spec, "child") else self.spec.children_specs[1]
            return list(child.context)
        except (AttributeError, IndexError, TypeError):
            return None

    def flatten(self, args: tuple, kwargs: dict, device: torch.device | None = None,
                given: Callable[[list], None] | None = None) -> list:
        """The flat inputs for a call, on ``device``; raises :class:`InputMismatchError` naming the
        argument, the planned and the given structure or shape.  ``given`` sees the flat
        inputs as this rank passed them, before any collective of the call (the ranks'
        agreement check: :mod:`autopar.runtime.call_check`)."""
        keys = self._kwargs_order()
        if keys is not None:
            missing = [k for k in keys if k not in kwargs]
            extra = [k for k in kwargs if k not in keys]
            if missing or extra:
                raise InputMismatchError(
                    f"the plan was made for keyword arguments {keys}; this call "
                    + (f"lacks {missing}" if missing else "") + (" and " if missing and extra else "")
                    + (f"adds {extra}" if extra else "") + ": call the module as it was planned")
            kwargs = {k: kwargs[k] for k in keys}  # the traced order, whatever the caller's
        flat, spec = pytree.tree_flatten((tuple(args), kwargs))
        if self.spec is not None and spec != self.spec:
            raise InputMismatchError(f"the call's structure {spec} differs from the planned "
                                     f"{self.spec}: pass the same arguments the plan was made with")
        if device is not None:  # batches may come from a CPU DataLoader
            flat = [x.to(device) if isinstance(x, torch.Tensor) else x for x in flat]
        # the shapes this call runs at: the planned ones, or another lowering's
        # (autopar.module.shapes: chosen alike on every rank before any collective)
        shapes, passthrough = self.shapes, self.passthrough
        if self.select is not None:
            route = self.select(flat)
            shapes, passthrough = route.shapes, route.passthrough
        if given is not None:
            if self.mode is BatchMode.GLOBAL:  # refuse a wrong shape before the ranks compare
                self.check_shapes(flat, local=False, shapes=shapes, passthrough=passthrough)
            given(flat)
        if self.mode is BatchMode.LOCAL:
            flat = self._gather_local(flat, shapes, passthrough)
        elif passthrough:
            # a plan made for local batches called with the global one (a loaded export):
            # the graph takes this rank's rows of these inputs, so cut them here
            self.check_shapes(flat, local=False, shapes=shapes, passthrough=passthrough)
            flat = self._own_rows(flat, passthrough)
        self.check_shapes(flat, shapes=shapes, passthrough=passthrough)
        return flat

    def _own_rows(self, flat: list, passthrough: frozenset[int]) -> list:
        m, pl, _ = self._split()
        return [shard_tensor(x, pl, m.shape, m.coord) if i in passthrough else x
                for i, x in enumerate(flat)]

    def _split(self):
        """(this rank's mesh, the batch's placements: dim 0 split over the data-parallel
        axes, the number of data-parallel ranks)."""
        m = current()
        pl = tuple(Shard(0) if a in self.dp_axes else None for a in range(len(m.shape)))
        return m, pl, math.prod(m.shape[a] for a in self.dp_axes)

    def check_shapes(self, flat: list, local: bool = True, shapes: list | None = None,
                     passthrough: frozenset[int] | None = None) -> None:
        """Refuse tensors whose shape is not ``shapes`` (the planned ones by default: a
        lowered graph's shapes are static, another batch or sequence length would be cut
        or mis-sharded); with ``local``, ``passthrough`` inputs are this rank's rows."""
        shapes = self.shapes if shapes is None else shapes
        passthrough = self.passthrough if passthrough is None else passthrough
        dp = self._split()[2] if passthrough else 1
        for i, x in enumerate(flat):
            want = shapes[i] if i < len(shapes) else None
            if want is not None and local and i in passthrough:
                want = (want[0] // dp, *want[1:])  # this rank's rows, as passed
            if want is not None and isinstance(x, torch.Tensor) and tuple(x.shape) != want:
                name = self.names[i] if i < len(self.names) else f"input {i}"
                if local and i in passthrough:
                    note = " (this rank's rows)"
                elif self.mode is BatchMode.LOCAL:
                    note = " (as the global batch gathered from every data-parallel rank)"
                else:
                    note = ""
                raise InputMismatchError(
                    f"{name} has shape {tuple(x.shape)}{note} but the plan was made for "
                    f"{want}: autopar runs the shapes it planned. Use batches of the planned "
                    "size (DataLoader(drop_last=True), or pad the last batch and mask its "
                    "loss), or plan again for this shape with auto_parallel")

    def _gather_local(self, flat: list, shapes: list, passthrough: frozenset[int]) -> list:
        if not self.dp_axes:
            return flat
        m, pl, dp = self._split()
        out = []
        for i, x in enumerate(flat):
            want = shapes[i] if i < len(shapes) else None
            if i in passthrough:  # the graph takes this rank's rows as they are
                out.append(x)
                continue
            if isinstance(x, torch.Tensor) and want and x.dim() > 0 and x.shape[0] * dp == want[0]:
                x = gather_tensor(x, pl, m.group)
            out.append(x)
        return out


def data_parallel_axes(plan) -> tuple[int, ...]:
    """Mesh axes over which the plan splits the batch: under ``batch="local"`` those that
    split the returned rows (:attr:`Decisions.local_axes`), else those on which the first
    batch input is sharded along dim 0.  Ranks that differ only on other axes (tensor-parallel
    peers, pipeline stages) must see the same samples."""
    if plan.decisions.batch == BatchMode.LOCAL.value and plan.decisions.local_axes is not None:
        return tuple(plan.decisions.local_axes)
    for n in plan.nodes.values():
        if n.kind != "input" or not n.shape or not n.shape[0]:
            continue
        pl = parse_placements(n.out_placements[0])
        axes = tuple(a for a, p in enumerate(pl) if isinstance(p, Shard) and p.dim == 0)
        if axes:
            return axes
    return ()


def passthrough_inputs(plan) -> frozenset[str]:
    """Inputs a ``batch="local"`` call hands to the graph as they are: those planned
    split on dim 0 over exactly the data-parallel axes (replicated on the others).  The
    binder would all-gather such an input and the graph slice it straight back to this
    rank's rows: the gather's collective (a latency per input per step, which DDP does not
    pay) buys nothing.  Only without pipeline stages and micro-batches, whose splits
    of the global batch are not this rank's rows."""
    d = plan.decisions
    if d.batch != BatchMode.LOCAL.value or d.pipeline_stages > 1 or d.micro_batches > 1:
        return frozenset()
    axes = data_parallel_axes(plan)
    if not axes:
        return frozenset()
    split = tuple(Shard(0) if a in axes else Replicate() for a in range(len(plan.mesh.shape)))
    return frozenset(n.name for n in plan.nodes.values() if n.kind == "input" and n.shape
                     and n.shape[0] and tuple(parse_placements(n.out_placements[0])) == split)


def data_parallel_coords(axes: tuple[int, ...], mesh_shape: Sequence[int],
                         coord: Sequence[int]) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) for ``DistributedSampler``: outer mesh
    axes are major, matching the order in which batch shards are laid out."""
    rank, size = 0, 1
    for a in axes:
        rank = rank * mesh_shape[a] + coord[a]
        size *= mesh_shape[a]
    return rank, size


__all__ = ["BatchMode", "InputBinder", "InputMismatchError", "data_parallel_axes",
           "data_parallel_coords", "passthrough_inputs"]
