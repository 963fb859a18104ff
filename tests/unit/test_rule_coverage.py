"""Which ops have a sharding rule: the pointwise tag, the explicit rules that win over
it, the ops left out on purpose, and a model of the ops that used to run replicated
(each strategy's values are checked in test_rules.py)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.report.summary import unsupported_ops
from autopar.sharding.rules import _RULES, has_rule
from autopar.sharding.rules.pointwise import add_rule, linear_unary_rule, mul_rule
from autopar.sharding.rules.tagged import (
    EXCLUDED,
    TAG_REGISTERED,
    shard_alike_rule,
    tagged_pointwise,
)

aten = torch.ops.aten


def test_every_tagged_pointwise_op_has_a_rule() -> None:
    """DTensor's habit: the tag decides.  Every functional, non-random aten overload
    tagged pointwise has a rule unless it is excluded with a reason."""
    tagged = tagged_pointwise()
    assert len(tagged) > 200
    missing = [str(op) for op in tagged if not has_rule(op) and op not in EXCLUDED]
    assert not missing
    assert all(reason for reason in EXCLUDED.values())
    assert not any(has_rule(op) for op in EXCLUDED)


def test_random_inplace_and_out_variants_get_no_rule() -> None:
    """rrelu draws a random slope per element (each rank would draw its own); in-place
    and out= overloads never appear in a functional graph."""
    for op in (aten.rrelu.default, aten.relu_.default, aten.acos.out, aten.clamp_.Tensor):
        assert not has_rule(op), op
    assert aten.rrelu.default not in tagged_pointwise()


def test_explicit_rules_win_over_the_tag() -> None:
    """The tag's rule offers no Partial; the explicit rules of the ops Partial passes
    through (sums, products, casts) must stay theirs."""
    assert _RULES[aten.add.Tensor] is add_rule
    assert _RULES[aten.mul.Tensor] is mul_rule
    assert _RULES[aten.neg.default] is linear_unary_rule
    assert aten.add.Tensor not in TAG_REGISTERED
    assert _RULES[aten.acos.default] is shard_alike_rule
    assert _RULES[aten.hardswish.default] is shard_alike_rule  # untagged, listed


class _Formerly(nn.Module):
    """Ops that ran replicated with a warning before they had rules."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.hardswish(h) + F.mish(h) + torch.expm1(h.clamp(-1, 1))
        h = F.normalize(h, dim=-1) * h.var(-1, keepdim=True) + h.logsumexp(-1, keepdim=True)
        h = h + h.max(-1, keepdim=True).values + torch.arange(8, dtype=h.dtype)
        h = torch.baddbmm(h, h, self.w.expand(h.shape[0], 8, 8))
        h = h.clamp(min=torch.zeros(8)) + torch.div(h, 3.0, rounding_mode="floor")
        return torch.linalg.vector_norm(h, dim=-1).sum()


def test_formerly_unsupported_ops_plan_without_warnings() -> None:
    """Before these rules, planning this model warned 'no sharding rule' for 12 ops
    (hardswish, mish, expm1, linalg_vector_norm, clamp_min, expand_as, var.dim,
    logsumexp, max.dim, baddbmm, clamp.Tensor, div.Tensor_mode) and ran each replicated."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = autopar.plan(_Formerly(), (torch.randn(4, 8, 8),), (2,))
    assert not [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert unsupported_ops(p) == []
