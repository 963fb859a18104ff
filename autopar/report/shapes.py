"""Which shapes a plan serves, the shape it was priced at, and its step at another shape:
the bodies of ``plan.explain("shapes")`` and :meth:`Plan.predict
<autopar.plans.Plan.predict>`, and the summary's ``shapes`` line.

A plan is priced at its example's shape: batch ``B0`` (the example's global batch) and
sequence ``S0`` (dim 1 of the first integer input of two or more dims, the token ids;
none when the model takes none).  The module runs any batch and any length with the same
plan; with pipeline stages or micro-batches, batches that split into equal micro-batches
(priced at the planned shape only); with interleaved copies, the planned shape only.

:func:`predict` re-prices the plan's own per-node prices at another shape, without a
search: see its docstring for what is scaled how.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Shard

from autopar.cost_models import blocking_time, kernel_rate
from autopar.errors import ConfigError
from autopar.plans.placement import is_shard, parse_placements
from autopar.plans.splits import unsplit_axes

if TYPE_CHECKING:
    from autopar.plans.data import NodePlan, Plan, Redistribution

BACKWARD_FACTOR = 2.0
"""Backward over forward compute, as the cost model prices every op
(``autopar.search.node_prices.CostModel.backward_factor``): a recomputed layer pays
``1 / (1 + BACKWARD_FACTOR)`` of its ops' compute again."""

_ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product")
_MATMULS = frozenset({"matmul", "bmm", "baddbmm", "mm", "einsum"})
_COLLECTIVES = frozenset({"all_reduce", "reduce_scatter", "all_gather", "all_to_all"})


@dataclass(frozen=True)
class PricedShape:
    """The shape a plan was priced at: the global ``batch`` and the ``seq`` length of
    the token ids (None when the model takes none)."""

    batch: int
    seq: int | None

    @property
    def tokens(self) -> int:
        """Tokens per step (0 without token ids)."""
        return self.batch * self.seq if self.seq else 0

    def words(self) -> str:
        """``"batch 4 x seq 16 (64 tokens)"``."""
        if self.seq is None:
            return f"batch {self.batch}"
        return f"batch {self.batch} x seq {self.seq} ({self.tokens} tokens)"


def priced_shape(plan: Plan) -> PricedShape:
    """The shape ``plan`` was priced at (see the module docstring)."""
    b = plan.decisions.global_batch
    if not b:  # plans made without the joint search record no global batch
        b = next((n.shape[0][0] for n in plan.nodes.values()
                  if n.kind == "input" and n.shape and n.shape[0]), 1)
    tokens = plan.request.tokens_per_step
    return PricedShape(b, tokens // b if tokens and b else None)


def serves_any_shape(plan: Plan) -> bool:
    """True when the module runs shapes other than the planned one: every plan but one
    of interleaved copies (``copies``), whose graph is built for its batch."""
    return plan.decisions.copies <= 1


def _scheduled(plan: Plan) -> bool:
    """Pipeline stages or micro-batches: other shapes run, priced at the planned one only."""
    d = plan.decisions
    return d.pipeline_stages > 1 or d.micro_batches > 1


def batch_axes(plan: Plan) -> tuple[int, ...]:
    """The mesh axes that split the batch: under ``batch="local"`` the ranks' own axes,
    else the axes any batch-carrying tensor is split over along dim 0."""
    d = plan.decisions
    if d.batch == "local" and d.local_axes:
        return tuple(d.local_axes)
    shape = priced_shape(plan)
    axes: set[int] = set()
    for name, (b, _) in _exponents(plan, shape).items():
        if b:
            for pl in plan.nodes[name].out_placements[:1]:
                axes |= {a for a, p in enumerate(parse_placements(pl)) if is_shard(p, 0)}
    return tuple(sorted(axes))


def served_words(plan: Plan, short: bool = False) -> str:
    """Which shapes the plan serves, in words (``short``: the summary's)."""
    shape = priced_shape(plan)
    d = plan.decisions
    if not serves_any_shape(plan):
        if short:
            return "this shape only (copies)"
        return (f"only {shape.words()}: the plan runs {d.copies} copies of each micro-batch in "
                "one graph, built for that batch; another shape raises InputMismatchError "
                "(plan again at it)")
    if _scheduled(plan):
        why = " and ".join(w for w, on in ((f"{d.pipeline_stages} pipeline stages",
                                            d.pipeline_stages > 1),
                                           (f"{d.micro_batches} micro-batches", d.micro_batches > 1))
                           if on)
        if short:
            return "any length, and batches that split into equal micro-batches (priced at this shape only)"
        return (f"any length, and any batch that splits into equal micro-batches the plan's "
                f"{why} can run (as near the planned size as divide it; not of one row when "
                "the planned ones are larger): each new shape is captured once and run with "
                "this plan, no new search; plan.predict prices the planned shape only")
    length = " and any length" if shape.seq else ""
    if short:
        return f"any batch{length} (plan.predict(batch={', seq=' if shape.seq else ''}) prices them)"
    return (f"any batch >= 1{length}: each new shape is captured once and run with this plan, "
            "no new search")


def _shard_degree(placement: str, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(n for p, n in zip(parse_placements(placement), mesh_shape)
                     if isinstance(p, Shard))


def _exponents(plan: Plan, shape: PricedShape) -> dict[str, tuple[int, int]]:
    """For every tensor that depends on the model's inputs: (does it carry the batch,
    how many of its dims grow with the sequence: 0, 1 or 2).  Read from the plan's
    shapes, in graph order: an input carries the batch when its dim 0 is ``B0`` and a
    sequence dim per other dim of size ``S0``; an op's output inherits its inputs'
    (the sum of both operands' for a matmul, whose scores are ``S x S``; the most of
    any input's otherwise), at most as many as it has dims of those sizes.  A dim 0
    of ``B0 * S0`` is the batch and one sequence dim flattened (a loss's rows).
    Tensors computed from no input (weights, a causal mask or rotary table built from
    ``arange``) are left out: they are taken not to grow."""
    b0, s0 = shape.batch, shape.seq
    out: dict[str, tuple[int, int]] = {}
    for n in plan.nodes.values():
        if n.kind in ("param", "buffer") or not n.shape or not n.shape[0]:
            continue
        dims = n.shape[0]
        flat = bool(s0) and b0 * s0 != b0 and dims[0] == b0 * s0
        avail = sum(1 for x in dims[1:] if s0 and x == s0) + flat
        if n.kind == "input":
            b, s = int(dims[0] == b0 or flat), avail
        else:
            ins = [out[u] for u in n.inputs if u in out]
            if not ins:
                continue
            b = int(any(x[0] for x in ins) and (dims[0] == b0 or flat))
            s = sum(x[1] for x in ins) if n.op in _MATMULS else max(x[1] for x in ins)
            s = min(s, avail)
        out[n.name] = (b, min(s, 2))
    return out


@dataclass
class _Growth:
    """How each tensor grows from the priced shape to the asked one, per rank."""

    exps: dict[str, tuple[int, int]]
    rb: float
    rs: float
    unsplit: dict[int, int]
    """Mesh axes that split the batch at the priced shape but not at the asked one (a
    batch they do not divide runs replicated over them), with their sizes."""
    mesh_shape: tuple[int, ...]

    def of(self, name: str, placement: str | None = None) -> float:
        """The factor tensor ``name``'s local bytes grow by."""
        e = self.exps.get(name)
        if e is None:
            return 1.0
        g = (self.rb if e[0] else 1.0) * self.rs ** e[1]
        if e[0] and self.unsplit and placement:
            pl = parse_placements(placement)
            g *= math.prod(n for a, n in self.unsplit.items() if a < len(pl) and is_shard(pl[a], 0))
        return g


def _bytes(plan: Plan, n: NodePlan, grow: _Growth) -> tuple[float, float]:
    """Local bytes an op reads and writes (forward), at the priced shape and grown."""
    old = new = 0.0
    mesh = plan.mesh.shape
    tensors = [(u, plan.nodes[u].shape[0] if plan.nodes[u].shape else [], pl, plan.nodes[u].dtype)
               for u, pl in zip(n.inputs, n.in_placements) if u in plan.nodes]
    tensors += [(n.name, s, pl, n.dtype) for s, pl in zip(n.shape, n.out_placements)]
    for name, dims, pl, dtype in tensors:
        size = math.prod(dims) / _shard_degree(pl, mesh) * _itemsize(dtype)
        old += size
        new += size * grow.of(name, pl)
    return old, new


def _itemsize(dtype: str) -> int:
    t = getattr(torch, dtype, None) if dtype else None
    return t.itemsize if isinstance(t, torch.dtype) else 4  # plans before dtypes: fp32


def _roofline(plan: Plan, n: NodePlan, flops: float, nbytes: float, div: int) -> float:
    """What :func:`autopar.cost_models.compute_time` takes the max of, for one op."""
    mesh = plan.mesh
    dtype = getattr(torch, n.dtype, None) if n.dtype else None
    local = flops / div
    flop_s = local / kernel_rate(mesh, local, dtype if isinstance(dtype, torch.dtype) else None) \
        if local else 0.0
    return max(flop_s, nbytes / mesh.mem_bandwidth, mesh.kernel_floor)


def _op_delta(plan: Plan, n: NodePlan, grow: _Growth) -> tuple[float, float]:
    """(compute, edge communication) an op adds at the asked shape, forward + backward."""
    mesh = plan.mesh.shape
    div = math.prod(k for a, k in enumerate(mesh)
                    if any(is_shard(parse_placements(p)[a]) for p in (*n.in_placements, *n.out_placements)))
    held = [(u, p) for u, p in zip(n.inputs, n.in_placements) if u in grow.exps]
    held += [(n.name, p) for p in n.out_placements[:1] if n.name in grow.exps]
    most = max((grow.of(u, p) for u, p in held), default=1.0)
    d_comp = 0.0
    if n.compute > 0:
        g_flops = most
        if n.op.startswith(_ATTENTION) and held:
            # an attention kernel's work is B x S x S while its tensors grow as tokens
            g_flops = most * grow.rs
        b_old, b_new = _bytes(plan, n, grow)
        old = _roofline(plan, n, n.flops, b_old, div)
        ratio = _roofline(plan, n, n.flops * g_flops, b_new, div) / old if old > 0 else 1.0
        own = n.own_comm  # the op's own exchanges move its activations: they grow as they do
        d_comp = (n.compute - own) * (ratio - 1.0) + own * (most - 1.0)
    d_comm = sum(_edge_delta(plan, r, grow.of(r.input, r.src)) for r in n.redistributions)
    if n.comm and not n.redistributions:  # a plan assembled without the steps
        d_comm = n.comm * (most - 1.0)
    return d_comp, d_comm


def _edge_delta(plan: Plan, r: Redistribution, growth: float) -> float:
    """What a redistribution adds when its tensor grows by ``growth``: its bytes' share
    of the price grows, each collective's latency (its price at one byte) does not.  The
    edge is priced forward and backward (its dual) where a gradient flows back, which a
    price under twice the latencies rules out."""
    latency = 0.0
    for step in r.steps:
        kind, _, rest = step.partition("(")
        axis = re.search(r"axis=(\d+)", rest)
        if kind in _COLLECTIVES and axis:
            latency += blocking_time(kind, plan.mesh, int(axis.group(1)), 1.0)
    fixed = min(r.seconds, 2.0 * latency if r.seconds >= 2.0 * latency else latency)
    return (r.seconds - fixed) * (growth - 1.0)


def predict(plan: Plan, batch: int | None = None, seq: int | None = None) -> float:
    """Predicted seconds per training step of ``plan`` at global ``batch`` and sequence
    length ``seq`` (None: the priced one), without a new search.

    At the priced shape this is the plan's own predicted step.  Elsewhere each part of
    that step is scaled by how it depends on the shape:

    * every op's compute is priced again by the cost model's roofline (the max of its
      FLOPs at the kernel rate, its bytes at the memory bandwidth and the per-kernel
      launch floor), with its FLOPs and each tensor's bytes grown by the shape: a
      tensor carrying the batch grows with it, and with the sequence once per sequence
      dim it has (:func:`_exponents`); weights and tensors built from no input do not
      grow.  FLOPs grow as the op's largest tensor, attention's as ``B x S^2``, so an
      op at the launch floor stays there until its work passes it.  The ratio of the
      two prices scales the op's planned price, which keeps what the roofline leaves
      out (the context-parallel attention's imbalance);
    * the redistributions on the ops' input edges grow as the bytes they move, their
      collectives' latencies constant; the ops' own exchanges and an output's return to
      the caller (priced inside its op: the logits gathered under ``batch="global"``)
      grow as their bytes, latencies included (a larger shape is over-priced by them, a
      smaller one under-priced); recomputed layers pay their forward share again;
    * parameter-sized terms are constant: gradient buckets, ZeRO's gathers and
      reductions, the optimizer; the gradient sync left after the backward stays as
      planned, unless a shorter backward cannot hide the rest (:func:`_sync_delta`);
    * a batch that the batch-splitting axes do not divide runs replicated over them
      (as the module runs it): every rank computes the whole batch.

    Raises :class:`~autopar.errors.ConfigError` for a plan with pipeline stages,
    micro-batches or copies (priced at their own shape only) or a bad value."""
    shape = priced_shape(plan)
    d = plan.decisions
    step = d.step_seconds or plan.objective
    for name, v in (("batch", batch), ("seq", seq)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"predict: {name} must be a positive integer, got {v!r}")
    if seq is not None and shape.seq is None:
        raise ConfigError("predict: the plan's model takes no token ids, so it has no sequence "
                          "length to change; pass batch= only")
    b = shape.batch if batch is None else batch
    s = shape.seq if seq is None else seq
    if (b, s) == (shape.batch, shape.seq):
        return step
    if not serves_any_shape(plan) or _scheduled(plan):
        raise ConfigError(f"predict: this plan serves {served_words(plan)}; to price batch {b}"
                          + (f" x seq {s}" if s else "") + ", plan again with an example of that shape")
    return step + _delta(plan, shape, b, s)


def _delta(plan: Plan, shape: PricedShape, b: int, s: int | None) -> float:
    """The step's change from the priced shape to (``b``, ``s``): see :func:`predict`."""
    d = plan.decisions
    mesh = plan.mesh.shape
    axes = batch_axes(plan)
    split = math.prod(mesh[a] for a in axes)
    unsplit = {a: mesh[a] for a in unsplit_axes(b, axes, mesh)} if split > 1 else {}
    grow = _Growth(_exponents(plan, shape), b / shape.batch,
                   (s / shape.seq) if s and shape.seq else 1.0, unsplit, mesh)
    recomputed = set(d.recompute)
    d_comp = d_comm = d_re = compute = 0.0
    for n in plan.nodes.values():
        if n.kind != "op":
            continue
        c, m = _op_delta(plan, n, grow)
        d_comp += c
        d_comm += m
        compute += n.compute
        if n.layer in recomputed:
            d_re += c / (1.0 + BACKWARD_FACTOR) + m / 2.0
    parts = d.stage_parts[0] if d.stage_parts else {}
    sync, exposed = parts.get("sync", 0.0), parts.get("sync_exposed", 0.0)
    share = BACKWARD_FACTOR / (1.0 + BACKWARD_FACTOR)
    return d_comp + d_comm + d_re + _sync_delta(plan, sync, exposed, share * compute,
                                                share * (compute + d_comp))


def _sync_delta(plan: Plan, sync: float, exposed: float, backward: float, new_backward: float
                ) -> float:
    """What more of the gradient sync the step exposes after a backward of
    ``new_backward`` seconds instead of ``backward``: the backward hides at most its
    length times ``mesh.overlap`` of the sync, so at least ``sync - overlap x backward``
    is left after it; the planned exposure (the last buckets' tail) is kept, never
    less."""
    overlap = plan.mesh.overlap

    def least(bwd: float) -> float:
        return max(0.0, sync - overlap * bwd)

    return max(0.0, least(new_backward) - max(exposed, least(backward)))


def explain_shapes(plan: Plan) -> str:
    """What ``plan.explain("shapes")`` says: the priced shape, the shapes served and the
    predicted step at the priced shape and at a few others."""
    shape = priced_shape(plan)
    d = plan.decisions
    step = d.step_seconds or plan.objective
    lines = [f"priced at {shape.words()}: {step * 1e3:.4g} ms per step predicted, for that shape",
             f"serves {served_words(plan)}"]
    if serves_any_shape(plan) and not _scheduled(plan):
        axes = batch_axes(plan)
        split = math.prod(plan.mesh.shape[a] for a in axes)
        if split > 1:
            names = ", ".join(plan.mesh.axis_names[a] for a in axes)
            lines.append(f"  a batch not divisible by {split} (mesh {'axes' if len(axes) > 1 else 'axis'} "
                         f"{names}, which split{'' if len(axes) > 1 else 's'} the batch) runs replicated over "
                         f"as few of {'them' if len(axes) > 1 else 'it'} as make the rest divide it: the ranks "
                         "along those compute the same rows for that call")
        if d.batch == "local":
            lines.append("  batch=\"local\": ranks may pass different row counts and lengths")
        if d.pack:
            lines.append("  pack=True: a right-padded batch runs packed, its padding dropped, so its "
                         "shape is the packed one (rows x the real tokens a row holds), as priced")
        lines.append(f"predicted at other shapes (plan.predict(batch={', seq=' if shape.seq else ''}), "
                     "no new search):")
        for b, s in _examples(shape):
            what = PricedShape(b, s).words()
            lines.append(f"  {what:<36} {predict(plan, b, s) * 1e3:.4g} ms")
    return "\n".join(lines)


def _examples(shape: PricedShape) -> list[tuple[int, int | None]]:
    """A few shapes around the priced one: batch 1, half and double; half and double
    the length."""
    b, s = shape.batch, shape.seq
    out = [(1, s), (max(1, b // 2), s), (2 * b, s)]
    if s:
        out += [(b, max(1, s // 2)), (b, 2 * s)]
    seen: list[tuple[int, int | None]] = []
    for x in out:
        if x not in seen and x != (b, s):
            seen.append(x)
    return seen


__all__ = ["BACKWARD_FACTOR", "PricedShape", "batch_axes", "explain_shapes", "predict",
           "priced_shape", "served_words", "serves_any_shape"]
