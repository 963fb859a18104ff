"""Scaled dot-product attention over ``[batch, heads, seq, head_dim]``.

Per mesh axis an attention node may
- shard batch (dim 0) or heads (dim 1) of every operand alike (a mask follows where it
  has the dim): no communication;
- shard the **query rows** (q dim 2) with k and v whole: each rank attends its rows to
  every key (the key/value all-gather is an ordinary redistribution on the edges,
  Llama 3's context parallelism); a mask follows on its row dim, a causal mask is
  offset by the rank's first row;
- shard the **sequence of q, k and v** (context parallelism, CP): the op exchanges
  data itself, either by the all-to-all head/sequence swap (DeepSpeed-Ulysses, when
  the local heads divide by the CP degree) or by passing key/value blocks around a
  ring (ring attention, otherwise).  The mask, if any, stays whole on the CP axes.

:func:`context_layout` reads which form a mesh strategy is, and says which
implementation lowers it; the registry drops mesh strategies it refuses (row axes
beside CP axes).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.capture.ir import arg, tensor_inputs
from autopar.plans.decisions import prices
from autopar.plans.kinds import ContextParallel
from autopar.plans.placement import Placements, R, local_shape
from autopar.sharding.rules import AxisStrategy, OpStrategy, RuleCtx, assign, register, shape

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
SEQ = 2  # the sequence dim of q, k and v


@dataclass(frozen=True)
class SdpaArgs:
    """The arguments of one ``scaled_dot_product_attention`` node."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool


def sdpa_args(node: fx.Node) -> SdpaArgs:
    """The node's arguments, positional or keyword, with SDPA's defaults."""
    mask = arg(node, 3, "attn_mask")
    return SdpaArgs(node.args[0], node.args[1], node.args[2],
                    mask if isinstance(mask, fx.Node) else None,
                    float(arg(node, 4, "dropout_p", 0.0)), bool(arg(node, 5, "is_causal", False)),
                    arg(node, 6, "scale"), bool(arg(node, 7, "enable_gqa", False)))


def sdpa_placements(node: fx.Node, inputs: Sequence[Placements]) -> tuple[
        Placements, Placements, Placements, Placements | None]:
    """(q, k, v, mask) placements of a strategy's ``inputs``.

    ``inputs`` follow ``tensor_inputs(node)``, which lists a node once however often the
    op reads it: self-attention written ``sdpa(x, x, x)`` has one input, ``sdpa(q, kv,
    kv, mask)`` three.  So look placements up by node, never by position (by position, a
    shared k and v read the mask's placement as v's, and ``sdpa(x, x, x, mask)`` lowered
    to query rows with k and v split)."""
    by = dict(zip(tensor_inputs(node), inputs))
    a = sdpa_args(node)
    return by[a.q], by[a.k], by[a.v], (by[a.mask] if a.mask is not None else None)


class CPImpl(enum.StrEnum):
    """How a sequence-sharded attention exchanges data across its CP axes."""

    ULYSSES = "ulysses"
    RING = "ring"


@dataclass(frozen=True)
class ContextLayout:
    """Which mesh axes shard the sequence of one attention node, and how.

    ``cp_axes`` shard q, k and v on the sequence (lowered by ``impl``); ``row_axes``
    shard only q's rows (k and v are whole there).
    """

    cp_axes: tuple[int, ...]
    row_axes: tuple[int, ...]
    impl: CPImpl | None

    @property
    def sharded(self) -> bool:
        """True when any axis splits the sequence."""
        return bool(self.cp_axes or self.row_axes)


def _mask_dim(a: SdpaArgs, d: int) -> int | None:
    """The mask's dim that runs along q's dim ``d`` (the mask is right-aligned to
    ``[batch, heads, rows, keys]``), unless it is broadcast there."""
    if a.mask is None:
        return None
    ms = shape(a.mask)
    md = d - (4 - len(ms))
    return md if md >= 0 and ms[md] == shape(a.q)[d] else None


def context_layout(node: fx.Node, inputs: Sequence[Placements],
                   mesh_shape: Sequence[int]) -> ContextLayout | None:
    """The sequence layout of ``node`` under input placements ``inputs`` (in
    ``tensor_inputs`` order: :func:`sdpa_placements`), or ``None`` when no lowering
    exists for it.

    Ulysses needs the heads each rank holds (after batch/head sharding on other axes)
    to divide by the CP degree, for q and for k/v; ring attention runs otherwise (one
    ring over all CP axes, the first axis major).
    """
    a = sdpa_args(node)
    qp, kp, _, _ = sdpa_placements(node, inputs)
    cp = tuple(i for i, p in enumerate(qp) if p == Shard(SEQ) and kp[i] == Shard(SEQ))
    rows = tuple(i for i, p in enumerate(qp) if p == Shard(SEQ) and kp[i] != Shard(SEQ))
    if not cp:
        return ContextLayout((), rows, None)
    if rows:
        return None  # a CP exchange of rows that are themselves split: not lowered
    degree = math.prod(mesh_shape[i] for i in cp)
    q_heads = local_shape(shape(a.q), qp, mesh_shape)[1]
    kv_heads = local_shape(shape(a.k), kp, mesh_shape)[1]
    if q_heads % degree == 0 and kv_heads % degree == 0:
        return ContextLayout(cp, (), CPImpl.ULYSSES)
    return ContextLayout(cp, (), CPImpl.RING)


def _mesh_ok(node: fx.Node, s: OpStrategy, mesh_shape: Sequence[int]) -> bool:
    return context_layout(node, s.inputs, mesh_shape) is not None


@register(SDPA, mesh_check=_mesh_ok)
def sdpa_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Shard batch (dim 0), heads (dim 1), q's rows, or the whole sequence (CP)."""
    a = sdpa_args(node)
    q, k, v, mask = a.q, a.k, a.v, a.mask
    if len(shape(q)) != 4 or len(shape(k)) != 4:
        return []
    result: list[AxisStrategy | None] = []
    for d in (0, 1):
        if shape(k)[d] != shape(q)[d]:
            continue  # grouped-query attention: k/v heads differ; keep replicated
        mapping: list[tuple[object, Placement]] = [(q, Shard(d)), (k, Shard(d)), (v, Shard(d))]
        if (md := _mask_dim(a, d)) is not None:
            mapping.append((mask, Shard(md)))
        result.append(assign(node, mapping, [Shard(d)]))
    if a.dropout_p == 0.0:
        # dropout would need the global mask's slice per row: not offered
        row_dim = _mask_dim(a, SEQ)
        rows: list[tuple[object, Placement]] = [(q, Shard(SEQ)), (k, R), (v, R)]
        if row_dim is not None:
            rows.append((mask, Shard(row_dim)))
        result.append(assign(node, rows, [Shard(SEQ)]))
        if not a.is_causal or shape(q)[SEQ] == shape(k)[SEQ]:
            # causal CP compares global positions: only for self-attention lengths
            result.append(assign(node, [(q, Shard(SEQ)), (k, Shard(SEQ)), (v, Shard(SEQ))],
                                 [Shard(SEQ)]))
    return [s for s in result if s is not None]


@prices("context_parallel")
def restrict_attention(strategies: dict[fx.Node, list[OpStrategy]], mode: str | None,
                       mesh_shape: Sequence[int]) -> None:
    """Keep, for every attention node, only the strategies ``context_parallel=mode``
    allows (``None``: all); a node left with none keeps a clear error for the caller."""
    if mode is None:
        return
    want = ContextParallel(mode)

    def allowed(node: fx.Node, s: OpStrategy) -> bool:
        lay = context_layout(node, s.inputs, mesh_shape)
        if lay is None:
            return False
        if want is ContextParallel.OFF:
            return not lay.sharded
        return bool(lay.row_axes) if want is ContextParallel.GATHER_KV else bool(lay.cp_axes)

    for node, pool in strategies.items():
        if node.op == "call_function" and node.target is SDPA:
            kept = [s for s in pool if allowed(node, s)]
            if not kept:
                raise ValueError(f"context_parallel={want.value!r}: no strategy of {node.name} "
                                 f"(shapes {[shape(x) for x in (node.args[0], node.args[1])]}) on "
                                 f"mesh {tuple(mesh_shape)} splits its sequence that way")
            strategies[node] = kept
