"""Pointwise and activation ops: shard any non-broadcast dim alike on every input.

Partial inputs pass through only where the op is linear in them: ``add``/``sub`` of
two tensors (both Partial), ``mul`` with one Partial factor, ``div`` with a Partial
numerator, negation, copies and casts to a floating dtype (a cast to an integer dtype
truncates each piece).  No boolean tensor is ever Partial (the registry drops such
strategies: booleans have no sum).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.distributed.tensor import Shard

from autopar.capture.ir import arg, info, is_tensor_node
from autopar.sharding.rules import AxisStrategy, RuleCtx, linear_cast, pointwise_axis, register

aten = torch.ops.aten

NONLINEAR_UNARY = [
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.tanh.default,
    aten.sigmoid.default, aten.exp.default, aten.log.default, aten.sqrt.default,
    aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.abs.default, aten.sin.default,
    aten.cos.default, aten.erf.default, aten.reciprocal.default, aten.dropout.default,
    aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default, aten.softplus.default,
    aten.native_dropout.default, aten.ne.Scalar, aten.eq.Scalar, aten.lt.Scalar,
    aten.gt.Scalar, aten.le.Scalar, aten.ge.Scalar, aten.logical_not.default,
    aten.bitwise_not.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.empty_like.default, aten.masked_fill.Scalar,
    aten.clamp.default, aten.triu.default, aten.tril.default,
]
LINEAR_UNARY = [
    aten.neg.default, aten.clone.default, aten.to.dtype, aten.to.dtype_layout,
    aten._to_copy.default, aten.type_as.default, aten.alias.default, aten.detach.default,
    aten.to.device,
    aten.contiguous.default, aten.lift_fresh_copy.default,
]
NONLINEAR_BINARY = [
    aten.maximum.default, aten.minimum.default, aten.eq.Tensor, aten.ne.Tensor,
    aten.lt.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.ge.Tensor, aten.__and__.Tensor,
    aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.logical_and.default, aten.logical_or.default, aten.pow.Tensor_Tensor,
    aten.masked_fill.Tensor, aten.where.self, aten.atan2.default,
    aten.gelu_backward.default, aten.threshold_backward.default,
    # Hugging Face's mask and position-bucket arithmetic (T5's relative positions)
    aten.min.other, aten.max.other, aten.where.ScalarOther, aten.where.ScalarSelf,
]

# tril/triu act on the last two dims: sharding those changes which elements are masked.
_LAST_TWO_FIXED = {aten.triu.default, aten.tril.default}


def _tensor_args(node: fx.Node) -> list[object]:
    flat: list[object] = []
    for a in node.args:
        if isinstance(a, (list, tuple)):
            flat.extend(a)
        else:
            flat.append(a)
    flat.extend(node.kwargs.values())
    return [a for a in flat if is_tensor_node(a)]


def _drop_dims(strats: list[AxisStrategy], node: fx.Node, dims: set[int]) -> list[AxisStrategy]:
    return [s for s in strats if not any(isinstance(p, Shard) and p.dim in dims for p in s.outputs)]


@register(*NONLINEAR_UNARY, *NONLINEAR_BINARY)
def nonlinear_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Shard alike; no Partial (the op is not linear)."""
    strats = pointwise_axis(node, _tensor_args(node))
    if node.target in _LAST_TWO_FIXED:
        nd = info(node).out.ndim
        strats = _drop_dims(strats, node, {nd - 1, nd - 2})
    return strats


@register(*LINEAR_UNARY)
def linear_unary_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Shard alike, and Partial passes through (casts: only where :func:`linear_cast`)."""
    x = node.args[0]
    linear = linear_cast(info(x).out.dtype, info(node).out.dtype)
    return pointwise_axis(node, _tensor_args(node), linear_in=[x] if linear else [])


@register(aten.add.Tensor, aten.sub.Tensor, operator.add, operator.sub)
def add_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Sum of two tensors is linear in both together; a scalar operand forbids Partial
    (it would be added once per rank)."""
    tensors = _tensor_args(node)
    both = len(tensors) == 2 and all(is_tensor_node(a) for a in node.args[:2])
    alpha = arg(node, 2, "alpha", 1)
    linear = [tensors] if both and alpha == 1 else []
    return pointwise_axis(node, tensors, linear_in=linear)


@register(aten.mul.Tensor, aten.mul.Scalar, operator.mul)
def mul_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Product is linear in each factor separately (a factor used twice, as in
    ``x * x``, is not linear, so it never becomes Partial)."""
    tensors = _tensor_args(node)
    return pointwise_axis(node, tensors,
                          linear_in=[[t] for t in tensors if tensors.count(t) == 1])


@register(aten.div.Tensor, aten.div.Scalar, operator.truediv)
def div_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Quotient is linear in the numerator only (unless it is also the denominator)."""
    tensors = _tensor_args(node)
    num = node.args[0]
    linear = is_tensor_node(num) and tensors.count(num) == 1
    return pointwise_axis(node, tensors, linear_in=[[num]] if linear else [])


@register(aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar)
def add_scalar_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Adding a scalar: shard alike, never Partial."""
    return pointwise_axis(node, _tensor_args(node))


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(node: fx.Node, ctx: RuleCtx) -> list[AxisStrategy]:
    """Like a pointwise op with one output per input (all the broadcast shape)."""
    tensors = list(node.args[0])
    return pointwise_axis(node, tensors)
