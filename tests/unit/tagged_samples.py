"""Validator samples for the ops ``autopar.sharding.rules.tagged`` registers by tag.

One sample per op, its arguments read off the op's schema: tensors of shapes that
broadcast against each other ``(4, 8)``, ``(8,)``, ``(4, 1)`` (so both the sharded and
the broadcast dims are exercised), scalars and ints fixed.  Values lie where every op
is defined (no NaN for the comparison to trip on): ``(0.1, 0.9)`` for most, above 1
for ``acosh`` and ``zeta``'s first argument, small positive integers for the integer
ops (gcd, shifts, bitwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autopar.sharding.rules.tagged import tag_registered

SHAPES = [(4, 8), (8,), (4, 1)]
INT_OPS = ("gcd", "lcm", "bitwise_", "__lshift__", "__rshift__", "__xor__")
ABOVE_ONE = {("acosh", 0), ("special_zeta", 0)}  # (op name, tensor index)
CLAMP_LIKE = ("clamp", "clip")


def _tensor_kind(name: str, k: int) -> tuple[str, int]:
    """(kind, high) of tensor input ``k``: T's kinds in test_rules."""
    if any(name.startswith(p) for p in INT_OPS):
        return "i", 9
    if (name, k) in ABOVE_ONE:
        return "g", 0
    if name == "native_dropout_backward" and k == 1:
        return "b", 0  # the dropout mask
    return "u", 0


def _scalar(name: str, arg: torch._C.Argument, ints: bool) -> object:
    t = str(arg.type)
    if t in ("Scalar", "number"):
        return 2 if ints or name == "special_zeta" else 0.5
    if t == "int":
        return 1  # polygamma's order, mvlgamma's p
    if t.startswith("float"):
        return 0.5
    if t == "bool":
        return False
    if t.startswith("str"):
        return "floor"
    raise ValueError(f"{name}: no sample value for argument {arg.name}: {t}")


def sample_call(op: torch._ops.OpOverload, tensor: Callable, arg: Callable
                ) -> tuple[list[object], list[object], dict[str, object]]:
    """(input specs, positional args, kwargs) of ``op``'s sample: ``tensor(kind, shape,
    high)`` makes an input spec, ``arg(i)`` the placeholder of input ``i``."""
    name = op._schema.name.removeprefix("aten::")
    ints = any(name.startswith(p) for p in INT_OPS)
    specs: list[object] = []
    args: list[object] = []
    for a in op._schema.arguments:
        t = str(a.type)
        if name in CLAMP_LIKE and t == "Optional[number]":
            args.append(0.3 if a.name == "min" else 0.7)
        elif t == "Tensor" or (t == "Optional[Tensor]" and name in CLAMP_LIKE):
            kind, high = _tensor_kind(name, len(specs))
            specs.append(tensor(kind, SHAPES[min(len(specs), 2)], high))
            args.append(arg(len(specs) - 1))
        elif not (a.kwarg_only or (a.has_default_value() and t not in ("Scalar", "number"))):
            args.append(_scalar(name, a, ints))
    kwargs: dict[str, object] = {}
    if op is torch.ops.aten.round.decimals:
        kwargs["decimals"] = 2
    if op in (torch.ops.aten.div.Tensor_mode, torch.ops.aten.div.Scalar_mode):
        kwargs["rounding_mode"] = "floor"
    return specs, args, kwargs


def tagged_ops() -> list[object]:
    """The ops registered by tag (and the untagged elementwise list)."""
    return tag_registered()
