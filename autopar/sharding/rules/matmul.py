"""Matrix products written as einsum equations (DTensor's habit).

Every letter of the equation can be sharded: a letter in the output shards the
output; a contracted letter leaves a Partial sum.  ``linear`` is
``...k,nk->...n`` plus a bias that follows the output's ``n`` (Partial when ``k`` is
sharded, so the bias is added once in total).
"""

from __future__ import annotations

import string

import torch
from torch import fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.capture.ir import arg, info
from autopar.plans.placement import P, R
from autopar.sharding.rules import AxisStrategy, RuleCtx, assign, ndim, register

aten = torch.ops.aten


def einsum_strategies(node: fx.Node, operands: list[fx.Node], equation: str,
                      extra: list[tuple[fx.Node | None, str]] = ()) -> list[AxisStrategy]:
    """1-D strategies for ``equation`` (e.g. ``"bmk,bkn->bmn"``) over ``operands``.

    ``extra`` lists additional inputs given as (node, letters) that broadcast against
    the output, like a bias ``"n"``; they are sharded like the output or made Partial
    when a contracted letter is sharded.
    """
    lhs, out = equation.split("->")
    ins = lhs.split(",")
    letters = sorted(set("".join(ins)) | set(out), key=lambda c: (lhs + out).index(c))
    result: list[AxisStrategy] = []
    for c in letters:
        mapping: list[tuple[object, Placement]] = []
        for x, spec in zip(operands, ins):
            mapping.append((x, Shard(spec.index(c)) if c in spec else R))
        if c in out:
            outp: Placement = Shard(out.index(c))
            for x, spec in extra:
                if x is not None:
                    mapping.append((x, Shard(spec.index(c)) if c in spec else R))
        else:
            outp = P
            for x, _ in extra:
                if x is not None:
                    mapping.append((x, P))
        s = assign(node, mapping, [outp])
        if s is not None:
            result.append(s)
    # Partial passes through a product when exactly one operand is Partial.
    for i in range(len(operands)):
        mapping = [(y, P if j == i else R) for j, y in enumerate(operands)]
        mapping += [(e, P) for e, _ in extra if e is not None]
        s = assign(node, mapping, [P])
        if s is not None:
            result.append(s)
    return result


def _batch_letters(n: int) -> str:
    return string.ascii_lowercase[:n]


@register(aten.linear.default)
def linear_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``y = x @ w.T + b``."""
    x, w = node.args[0], node.args[1]
    b = arg(node, 2, "bias")
    batch = _batch_letters(ndim(x) - 1).upper()
    return einsum_strategies(node, [x, w], f"{batch}k,nk->{batch}n", [(b, "n")])


@register(aten.addmm.default)
def addmm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``y = beta*bias + alpha*(m1 @ m2)``; the bias may be 1-D or 2-D."""
    b, m1, m2 = node.args[0], node.args[1], node.args[2]
    if arg(node, 3, "beta", 1) != 1:
        return []
    bspec = "mn"[2 - ndim(b):]
    return einsum_strategies(node, [m1, m2], "mk,kn->mn", [(b, bspec)])


@register(aten.mm.default)
def mm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``mk,kn->mn``."""
    return einsum_strategies(node, [node.args[0], node.args[1]], "mk,kn->mn")


@register(aten.bmm.default)
def bmm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``bmk,bkn->bmn``."""
    return einsum_strategies(node, [node.args[0], node.args[1]], "bmk,bkn->bmn")


@register(aten.baddbmm.default)
def baddbmm_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``y = beta*input + alpha*(b1 @ b2)``, ``bmk,bkn->bmn`` with ``input`` broadcast
    against the output.  A sharded ``k`` leaves the product Partial, and then ``input``
    must be Partial too: each rank adds ``beta`` times its summand, and the summands add
    up to ``beta*input`` (a replicated input would be added once per rank).  An input
    dim broadcast from size 1 stays whole."""
    inp, b1, b2 = node.args[0], node.args[1], node.args[2]
    out = info(node).out.shape
    ishape = info(inp).out.shape
    off = len(out) - len(ishape)
    spec = "".join(c if ishape[i - off] == out[i] else "_" for i, c in enumerate("bmn")
                   if i >= off)
    return einsum_strategies(node, [b1, b2], "bmk,bkn->bmn", [(inp, spec)])


@register(aten.matmul.default)
def matmul_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Batched matmul with equal batch dims (broadcast batch dims are replicated)."""
    a, b = node.args[0], node.args[1]
    na, nb = ndim(a), ndim(b)
    if na < 2 or nb < 2:
        return []
    if na == nb and info(a).out.shape[:-2] == info(b).out.shape[:-2]:
        batch = _batch_letters(na - 2).upper()
        return einsum_strategies(node, [a, b], f"{batch}mk,{batch}kn->{batch}mn")
    if nb == 2:
        batch = _batch_letters(na - 2).upper()
        return einsum_strategies(node, [a, b], f"{batch}mk,kn->{batch}mn")
    return []


def einsum_equation(node: fx.Node) -> tuple[list[str], str] | None:
    """(operand letters, output letters) of an ``aten.einsum`` node whose equation every
    strategy of :func:`einsum_strategies` computes correctly on local shards, else None.

    Refused: ellipsis (its dims are not named) and a letter twice in one operand (a
    diagonal).  A letter broadcast from size 1 needs no care here: sharding it would cut
    the size-1 dim, which the registry's divisibility filter drops.  An implicit output
    is the letters used once, sorted.
    """
    eq = str(node.args[0]).replace(" ", "")
    ops = list(node.args[1])
    if "." in eq:
        return None
    lhs, out = eq.split("->") if "->" in eq else (eq, None)
    specs = lhs.split(",")
    if out is None:
        out = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
    if len(specs) != len(ops) or any(len(set(s)) != len(s) for s in [*specs, out]):
        return None
    if any(not isinstance(x, fx.Node) or ndim(x) != len(spec) for x, spec in zip(ops, specs)):
        return None
    return specs, out


@register(aten.einsum.default)
def einsum_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """``torch.einsum`` as written: any letter shards (a contracted one leaves a Partial
    sum), and Partial passes through one operand.  MoE dispatch ``gsec,gsm->egcm`` and
    batched experts ``egcm,emh->egch`` are the uses that matter."""
    parsed = einsum_equation(node)
    if parsed is None:
        return []
    specs, out = parsed
    return einsum_strategies(node, list(node.args[1]), f"{','.join(specs)}->{out}")
