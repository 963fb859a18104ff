"""Per-op sharding rules, one file per op family.

A rule answers, for one node and ONE mesh axis, which placements its tensor inputs
may have and which placement each output then has (an :class:`AxisStrategy`).  The
registry expands rules over all mesh axes by product (DTensor's habit),
always adds the all-replicate strategy, and drops combinations whose shards do not
divide the tensor dims evenly.  An op without a rule is replicated, with a warning
that names it.

How to add an op: write ``@register(aten.my_op.default)`` on a function
``(node, RuleCtx) -> list[AxisStrategy]`` in the file of its family, import the file
in :func:`_load_families`, and add a sample to ``tests/unit/rule_samples.py``:
``tests/unit/test_rules.py``'s brute-force validator simulates the ranks and compares
with the unsharded op.
Ops tagged ``torch.Tag.pointwise`` need nothing: :mod:`.tagged` gives every one
without a rule of its own the shard-alike rule (a :class:`Fallback`).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.capture.ir import info, tensor_inputs
from autopar.errors import AutoparWarning
from autopar.plans.placement import P, Placements, R, fmt_placements, valid_for_shape

aten = torch.ops.aten


@dataclass(frozen=True)
class AxisStrategy:
    """A strategy on one mesh axis: a placement per tensor input and per output."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]


@dataclass(frozen=True)
class OpStrategy:
    """A strategy on the whole mesh: ``inputs[i]`` and ``outputs[j]`` are placement
    tuples with one entry per mesh axis."""

    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]

    @functools.cached_property
    def formatted(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(inputs, outputs) in short form (``S(0)R``), formatted once: a plan lists
        the best alternatives of every node, and one strategy object serves many plans."""
        return (tuple(fmt_placements(p) for p in self.inputs),
                tuple(fmt_placements(p) for p in self.outputs))


@dataclass(frozen=True)
class RuleCtx:
    """What a rule may look at besides the node: the mesh shape."""

    mesh_shape: tuple[int, ...]


Rule = Callable[[fx.Node, RuleCtx], list[AxisStrategy]]
MeshCheck = Callable[[fx.Node, OpStrategy, Sequence[int]], bool]
_RULES: dict[object, Rule] = {}
_MESH_CHECKS: dict[object, MeshCheck] = {}


@dataclass(frozen=True)
class Fallback:
    """Rules found by a property of the op rather than listed (:mod:`.tagged`: the
    pointwise tag): ``rule_for(target)`` gives the rule or None, ``targets()`` lists
    every op it covers.  Asked only for ops without a registered rule, so a listed
    rule always wins; looked up per op as planning meets it (listing every aten
    overload up front costs a quarter of a second a process)."""

    rule_for: Callable[[object], Rule | None]
    targets: Callable[[], list[object]]


_FALLBACKS: list[Fallback] = []


def register_fallback(fallback: Fallback) -> None:
    """Add a :class:`Fallback` (asked in registration order)."""
    _FALLBACKS.append(fallback)


def register(*targets: object, mesh_check: MeshCheck | None = None) -> Callable[[Rule], Rule]:
    """Decorator: register a rule for the given aten overloads.  ``mesh_check`` (optional)
    vets each mesh strategy the per-axis product makes, for ops whose lowering depends
    on how the axes combine (attention: no query-row split beside a CP exchange)."""
    def deco(fn: Rule) -> Rule:
        for t in targets:
            _RULES[t] = fn
            if mesh_check is not None:
                _MESH_CHECKS[t] = mesh_check
        return fn
    return deco


def rule_of(target: object) -> Rule | None:
    """The rule of ``target``: registered, else a fallback's (then remembered)."""
    _load_families()
    rule = _RULES.get(target)
    if rule is None:
        for fb in _FALLBACKS:
            rule = fb.rule_for(target)
            if rule is not None:
                _RULES[target] = rule
                break
    return rule


def has_rule(target: object) -> bool:
    """True when ``target`` has a rule (registered or a fallback's)."""
    return rule_of(target) is not None


def registered_ops() -> list[object]:
    """Every op with a rule, the fallbacks' included (for docs and the validator's
    coverage check)."""
    _load_families()
    for fb in _FALLBACKS:
        for t in fb.targets():
            rule_of(t)
    return list(_RULES)


_LOADED = False


def _load_families() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    # cycle: every rule family (e.g. autopar.sharding.rules.channel_norms) imports this one
    from autopar.sharding.rules import (  # noqa: F401  (imports register the rules)
        attention,
        channel_norms,
        conv,
        embedding,
        factories,
        losses,
        matmul,
        moe,
        moe_experts,
        norms,
        pointwise,
        reductions,
        statistics,
        views,
    )
    # the tag's fallback: asked only for ops no family above registered
    importlib.import_module("autopar.sharding.rules.tagged")


# ---------------------------------------------------------------- rule helpers
def ndim(x: fx.Node) -> int:
    """Number of dims of a tensor node."""
    return info(x).out.ndim


def shape(x: fx.Node) -> tuple[int, ...]:
    """Global shape of a tensor node."""
    return info(x).out.shape


def assign(node: fx.Node, mapping: Sequence[tuple[object, Placement]],
           outputs: Sequence[Placement]) -> AxisStrategy | None:
    """Build an :class:`AxisStrategy` from (input node, placement) pairs.

    Inputs not named get ``Replicate``; a node named twice with different placements
    makes the strategy impossible (returns ``None``).
    """
    chosen: dict[fx.Node, Placement] = {}
    for x, p in mapping:
        if not isinstance(x, fx.Node):
            continue
        if x in chosen and chosen[x] != p:
            return None
        chosen[x] = p
    return AxisStrategy(tuple(chosen.get(x, R) for x in tensor_inputs(node)), tuple(outputs))


def replicate_strategy(node: fx.Node) -> AxisStrategy:
    """Every input and output replicated: valid for every op."""
    return AxisStrategy(tuple(R for _ in tensor_inputs(node)),
                        tuple(R for _ in info(node).outputs))


def linear_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast from ``src`` to ``dst`` is linear (sums of pieces cast alike): to a
    floating or complex dtype, or to the same dtype.  A cast to an integer or boolean
    dtype truncates each piece (0.6 and 0.6 cast to 0 and 0, their sum 1.2 to 1) or
    wraps it, so a Partial sum does not pass through it."""
    return src == dst or dst.is_floating_point or dst.is_complex


def partial_through(node: fx.Node, partial_inputs: Sequence[object]) -> AxisStrategy | None:
    """For an op linear in ``partial_inputs``: those Partial, the rest replicated, output Partial."""
    mapping = [(x, P) for x in partial_inputs]
    return assign(node, mapping, [P for _ in info(node).outputs])


# ---------------------------------------------------------------- expansion
def axis_strategies(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """The 1-D strategies of ``node`` (rule output plus all-replicate, de-duplicated)."""
    rule = rule_of(node.target)
    out = [replicate_strategy(node)]
    if rule is None:
        name = str(node.target)
        if any(True for _ in tensor_inputs(node)):
            # every time (joint_plan de-duplicates per plan and keeps it in plan.warnings)
            warnings.warn(
                f"autopar: no sharding rule for op {name}; it runs replicated (all inputs "
                "gathered). Register a rule in autopar/sharding/rules/ to shard it.",
                AutoparWarning, stacklevel=2,
            )
        return out
    for s in rule(node, ctx):
        if s is not None and s not in out and not _partial_bool(node, s):
            out.append(s)
    return out


def _partial_bool(node: fx.Node, s: AxisStrategy) -> bool:
    """Whether ``s`` holds a boolean tensor as a Partial sum: booleans have no sum
    (``True + True`` is ``True``, not 2), so no rule may keep one pending."""
    ins = [info(x).out.dtype for x in tensor_inputs(node)]
    outs = [t.dtype for t in info(node).outputs]
    return any(p == P and d == torch.bool for p, d in [*zip(s.inputs, ins), *zip(s.outputs, outs)])


def combine_axes(per_axis: Sequence[AxisStrategy]) -> OpStrategy:
    """The mesh strategy made of one 1-D strategy per mesh axis (``per_axis[a]`` on axis
    ``a``); the searchers that decide axis by axis (D-Rec) build strategies with it."""
    first = per_axis[0]
    inputs = tuple(tuple(s.inputs[i] for s in per_axis) for i in range(len(first.inputs)))
    outputs = tuple(tuple(s.outputs[j] for s in per_axis) for j in range(len(first.outputs)))
    return OpStrategy(inputs, outputs)


def divides(node: fx.Node, s: OpStrategy, mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim of every input and output of ``node`` under ``s``
    is divided evenly by its mesh axes and the op's own mesh check (if registered)
    accepts ``s`` (the registry's validity filter)."""
    ins = [info(x).out.shape for x in tensor_inputs(node)] if node.op == "call_function" else []
    outs = [t.shape for t in info(node).outputs]
    if not (all(valid_for_shape(p, sh, mesh_shape) for p, sh in zip(s.inputs, ins))
            and all(valid_for_shape(p, sh, mesh_shape) for p, sh in zip(s.outputs, outs))):
        return False
    check = _MESH_CHECKS.get(node.target) if node.op == "call_function" else None
    return check is None or check(node, s, mesh_shape)


def op_strategies(node: fx.Node, ctx: RuleCtx) -> list[OpStrategy]:
    """All valid strategies of ``node`` on the mesh: the product of 1-D strategies
    over mesh axes, keeping those whose shards divide every tensor evenly."""
    ones = axis_strategies(node, ctx)
    result: list[OpStrategy] = []
    for combo in itertools.product(ones, repeat=len(ctx.mesh_shape)):
        s = combine_axes(combo)
        if divides(node, s, ctx.mesh_shape):
            result.append(s)
    return result


def pointwise_axis(node: fx.Node, tensors: Sequence[object], linear_in: Sequence[object] = (),
                   out_ndim: int | None = None) -> list[AxisStrategy]:
    """Broadcasting pointwise strategies: shard output dim d and every input whose
    right-aligned dim d is not broadcast; ``linear_in`` lists the inputs the op is
    linear in (add: all; mul: any one), which may be Partial."""
    outs = info(node).outputs
    nd = out_ndim if out_ndim is not None else outs[0].ndim
    result: list[AxisStrategy] = []
    for d in range(nd):
        mapping: list[tuple[object, Placement]] = []
        for x in tensors:
            if not isinstance(x, fx.Node) or not info(x).outputs:
                continue
            xs = shape(x)
            off = nd - len(xs)
            xd = d - off
            if xd >= 0 and xs[xd] == outs[0].shape[d]:
                mapping.append((x, Shard(xd)))
        s = assign(node, mapping, [Shard(d) for _ in outs])
        if s is not None:
            result.append(s)
    for group in linear_in:
        s = partial_through(node, group if isinstance(group, (list, tuple)) else [group])
        if s is not None:
            result.append(s)
    return result
