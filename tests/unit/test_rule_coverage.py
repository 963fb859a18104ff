"""Which ops have a sharding rule: the pointwise tag, the explicit rules that win over
it, the ops left out on purpose, and a model of the ops that used to run replicated
(each strategy's values are checked in test_rules.py)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from autopar.cost_models import blocking_time
from torch import nn
from torch.distributed.tensor import Shard

import autopar
from autopar import MeshSpec
from autopar.capture.annotate import annotate
from autopar.capture.trace import capture
from autopar.plans.placement import R
from autopar.report.summary import unsupported_ops
from autopar.search.node_prices import CostModel
from autopar.sharding.local_forms import describe
from autopar.sharding.rules import RuleCtx, has_rule, op_strategies, rule_of
from autopar.sharding.rules.pointwise import add_rule, linear_unary_rule, mul_rule
from autopar.sharding.rules.tagged import (
    EXCLUDED,
    shard_alike_rule,
    tag_registered,
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
    assert rule_of(aten.add.Tensor) is add_rule
    assert rule_of(aten.mul.Tensor) is mul_rule
    assert rule_of(aten.neg.default) is linear_unary_rule
    assert aten.add.Tensor not in tag_registered()
    assert rule_of(aten.acos.default) is shard_alike_rule
    assert rule_of(aten.hardswish.default) is shard_alike_rule  # untagged, listed


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


class _Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))  # so the reductions have a backward

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x * self.w
        return torch.linalg.vector_norm(x, dim=-1), x.var(-1), x.logsumexp(-1)


def test_split_reduced_dim_only_with_a_local_form_and_priced() -> None:
    """The 2-norm and the variance over a split dim lower to all-reduced sums
    (runtime/reductions.py; values and gradients checked in test_rules.py): the
    planner is offered that split, prices its all-reduces (one for the norm, two for
    the variance, each again in the backward) and explain names them; logsumexp has
    no such form and is not offered it."""
    mesh = MeshSpec.preset("cpu-gloo", shape=(4,))
    gm = annotate(capture(_Norms(), (torch.randn(4, 8, 16),)).gm)
    nodes = {str(n.target): n for n in gm.graph.nodes if n.op == "call_function"}
    cm = CostModel(mesh)
    one = blocking_time("all_reduce", mesh, 0, 4 * 8 * 4.0)
    for name, rounds in [("aten.linalg_vector_norm.default", 2), ("aten.var.dim", 4)]:
        node = nodes[name]
        split = [s for s in op_strategies(node, RuleCtx((4,))) if s.inputs[0] == (Shard(2),)]
        assert [s.outputs for s in split] == [((R,),)], name
        assert cm.own_comm(node, split[0]) == rounds * one, name
        assert "all-reduced" in describe(node, split[0], mesh)
    lse = nodes["aten.logsumexp.default"]
    assert not [s for s in op_strategies(lse, RuleCtx((4,))) if s.inputs[0] == (Shard(2),)]
