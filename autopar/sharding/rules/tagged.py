"""Pointwise ops found by PyTorch's own tag (DTensor's habit): every functional aten
overload tagged ``torch.Tag.pointwise`` that no other family registers gets the
shard-alike rule (any non-broadcast dim sharded alike on every tensor input and every
output; no Partial, as for a non-linear op).

This module loads last, so an explicit rule (``add``, ``mul``, casts: the ops Partial
passes through) always wins.  Left out, each for a reason:

- in-place (``relu_``) and ``out=`` overloads: the captured graph is functional;
- random ops (tagged ``nondeterministic_seeded``, e.g. ``rrelu``): every rank would draw
  its own numbers, the single process draws one set;
- :data:`EXCLUDED`: tagged pointwise, yet shard-alike is wrong for them.

:data:`UNTAGGED` lists elementwise ops PyTorch does not tag that models use
(``hardswish``): they get the same rule.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.capture.ir import is_tensor_node
from autopar.sharding.rules import AxisStrategy, RuleCtx, has_rule, pointwise_axis, register

aten = torch.ops.aten

EXCLUDED: dict[object, str] = {
    # returns one bool for the whole pair of tensors: a reduction over every element,
    # so each rank's piece answers a different question
    aten.equal.default: "a whole-tensor comparison returning a bool (a reduction)",
}

UNTAGGED = [
    aten.hardswish.default, aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default, aten.mish_backward.default,
    aten.elu_backward.default, aten.leaky_relu_backward.default,
    aten.softplus_backward.default, aten.hardtanh_backward.default,
]


def _flat_tensor_args(node: fx.Node) -> list[object]:
    flat: list[object] = []
    for a in [*node.args, *node.kwargs.values()]:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return [a for a in flat if is_tensor_node(a)]


def shard_alike_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Every non-broadcast output dim sharded alike on every tensor input; no Partial."""
    return pointwise_axis(node, _flat_tensor_args(node))


def _functional(s: torch._C.FunctionSchema) -> bool:
    return (s.name.startswith("aten::") and not s.is_mutable and not s.name.endswith("_")
            and not s.overload_name.endswith("out"))


def tagged_pointwise() -> list[torch._ops.OpOverload]:
    """Every functional, non-random aten overload tagged pointwise (sorted by name).
    The schemas are filtered first: an overload object (which carries the tags) costs
    tens of microseconds to make, and this runs once per process."""
    names = sorted({(s.name[len("aten::"):], s.overload_name or "default")
                    for s in torch._C._jit_get_all_schemas() if _functional(s)})
    ops = []
    for name, overload in names:
        op = getattr(getattr(aten, name), overload, None)
        if (op is not None and torch.Tag.pointwise in op.tags
                and torch.Tag.nondeterministic_seeded not in op.tags):
            ops.append(op)
    return ops


def _register_all() -> list[object]:
    """Register the rule for every tagged or listed op no family registered; return them."""
    added = [op for op in [*tagged_pointwise(), *UNTAGGED]
             if not has_rule(op) and op not in EXCLUDED]
    register(*added)(shard_alike_rule)
    return added


TAG_REGISTERED: list[object] = _register_all()
"""The ops this module gave a rule (the tag's and :data:`UNTAGGED`), for docs and tests."""
