"""Pointwise ops found by PyTorch's own tag (DTensor's habit): every functional aten
overload tagged ``torch.Tag.pointwise`` that no family registers gets the shard-alike
rule (any non-broadcast dim sharded alike on every tensor input and every output; no
Partial, as for a non-linear op).

The tag is read as planning meets an op without a rule (a
:class:`~autopar.sharding.rules.Fallback`), so an explicit rule (``add``, ``mul``,
casts: the ops Partial passes through) always wins.  Left out, each for a reason:

- in-place (``relu_``) and ``out=`` overloads: the captured graph is functional;
- random ops (tagged ``nondeterministic_seeded``, e.g. ``rrelu``): every rank would draw
  its own numbers, the single process draws one set;
- :data:`EXCLUDED`: tagged pointwise, yet shard-alike is wrong for them.

:data:`UNTAGGED` lists elementwise ops PyTorch does not tag that models use
(``hardswish``): they are registered with the same rule.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.capture.ir import is_tensor_node
from autopar.sharding.rules import (
    AxisStrategy,
    Fallback,
    RuleCtx,
    pointwise_axis,
    register,
    register_fallback,
    rule_of,
)

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


def by_tag(op: object) -> bool:
    """Whether the tag gives ``op`` the shard-alike rule: a functional, non-random aten
    overload tagged pointwise, not :data:`EXCLUDED`."""
    return (isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags
            and torch.Tag.nondeterministic_seeded not in op.tags
            and _functional(op._schema) and op not in EXCLUDED)


def tagged_pointwise() -> list[torch._ops.OpOverload]:
    """Every functional, non-random aten overload tagged pointwise (sorted by name).
    The schemas are filtered first: an overload object (which carries the tags) costs
    tens of microseconds to make."""
    names = sorted({(s.name[len("aten::"):], s.overload_name or "default")
                    for s in torch._C._jit_get_all_schemas() if _functional(s)})
    ops = []
    for name, overload in names:
        op = getattr(getattr(aten, name), overload, None)
        if (op is not None and torch.Tag.pointwise in op.tags
                and torch.Tag.nondeterministic_seeded not in op.tags):
            ops.append(op)
    return ops


def tag_registered() -> list[object]:
    """The ops this module gives a rule: the tag's (less those a family registers) and
    :data:`UNTAGGED`; for docs and tests (planning never lists them)."""
    return [op for op in [*tagged_pointwise(), *UNTAGGED]
            if op not in EXCLUDED and rule_of(op) is shard_alike_rule]


register(*UNTAGGED)(shard_alike_rule)
register_fallback(Fallback(lambda op: shard_alike_rule if by_tag(op) else None,
                           lambda: [op for op in tagged_pointwise() if op not in EXCLUDED]))
