"""A compiled plan is priced as inductor runs the graph (autopar/search/fusion.py): its
pointwise chains fused into one kernel each, moving only the chain's inputs and the
values read outside it and launching once; an eager plan is priced op by op as before.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

import autopar
from autopar import MeshSpec
from autopar.capture.annotate import annotate
from autopar.capture.ir import info, tensor_inputs
from autopar.capture.trace import capture
from autopar.plans.data import Plan
from autopar.plans.decisions import PlanOptions, decision_key
from autopar.search.entry import joint_plan
from autopar.search.fusion import fuse
from autopar.search.node_prices import CostModel
from autopar.search.stages.layer_stats import layer_stats
from autopar.sharding.rules import OpStrategy
from autopar.sharding.strategies import enumerate_strategies
from tests.dist.harness import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402


class Chain(nn.Module):
    """``x * w + b -> gelu -> dropout -> linear -> relu -> * 2 -> sum``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64))
        self.b = nn.Parameter(torch.randn(64))
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(nn.functional.gelu(x * self.w + self.b), 0.1, True)
        return (torch.relu(self.proj(h)) * 2).sum()


@pytest.fixture(scope="module")
def chain() -> torch.fx.GraphModule:
    cap = capture(Chain(), (torch.randn(8, 64),), {})
    annotate(cap.gm)
    return cap.gm


def _ops(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function"}


def test_pointwise_chains_fuse_and_a_matmul_splits_them(chain) -> None:
    ops = _ops(chain)
    f = fuse(chain)
    groups = {}
    for name, n in ops.items():
        if f.of(n) is not None:
            groups.setdefault(f.of(n).group, []).append(name)
    # the chain before the matmul, and the one after it with its trailing sum
    assert sorted(groups.values()) == [["mul", "add", "gelu", "dropout"], ["relu", "mul_1", "sum_1"]]
    assert f.groups == 2 and f.of(ops["linear"]) is None
    # one launch per group, by its first op
    assert [name for name, n in ops.items() if f.of(n) is not None and f.of(n).launches] == ["mul", "relu"]
    # the group reads x, w and b and writes the dropout's output only: the intermediates
    # (mul, add, gelu) never reach memory
    assert f.of(ops["mul"]).inputs == (True, True) and f.of(ops["add"]).inputs == (False, True)
    assert [n for n in ("mul", "add", "gelu", "dropout") if not f.of(ops[n]).internal] == ["dropout"]
    assert f.of(ops["sum_1"]).outputs == (True,)  # the loss is returned


def _descendants(n: torch.fx.Node) -> set[torch.fx.Node]:
    out, stack = set(), list(n.users)
    while stack:
        u = stack.pop()
        if u not in out:
            out.add(u)
            stack.extend(u.users)
    return out


def test_a_group_never_waits_on_an_op_outside_it() -> None:
    """A GPT block: the attention's residual add fuses with the norm after it, but not
    with the MLP's residual add, which reads the MLP the norm feeds (one kernel cannot
    both feed the MLP and wait for it): no op outside a group lies between two of its
    members."""
    model, ex = gpt.build(layers=2)
    cap = capture(model, tuple(ex), {})
    annotate(cap.gm)
    f = fuse(cap.gm)
    groups: dict[int, set] = {}
    for n, fused in f.ops.items():
        groups.setdefault(fused.group, set()).add(n)
    assert len(groups) == 2  # one per block
    for members in groups.values():
        assert sorted(str(n.target) for n in members) == ["aten.add.Tensor", "aten.layer_norm.default"]
        below = set().union(*(_descendants(m) for m in members)) - members
        for m in members:
            assert not any(s in below for s in m.all_input_nodes), m


def _priced(gm, fusion) -> tuple[CostModel, dict[torch.fx.Node, OpStrategy]]:
    """A cost model on one CPU device, and each op's first strategy (whole tensors)."""
    mesh = MeshSpec.preset("cpu-gloo", shape=(1,))
    strategies = enumerate_strategies(gm, tuple(mesh.shape))
    return CostModel(mesh, fusion=fusion), {n: s[0] for n, s in strategies.items() if s}


def test_fused_ops_move_only_the_groups_bytes_and_launch_once(chain) -> None:
    ops = _ops(chain)
    eager, strat = _priced(chain, None)
    compiled, _ = _priced(chain, fuse(chain))
    floor = eager.mesh.straggler * eager.mesh.kernel_floor * (1 + eager.backward_factor)
    t_eager = {k: eager.op_time(n, strat[n])[0] for k, n in ops.items()}
    t_comp = {k: compiled.op_time(n, strat[n])[0] for k, n in ops.items()}
    # a tiny graph: every kernel is at the launch floor eager; compiled, the two
    # groups launch once each (five launches fewer, less the few bytes the other
    # fused ops still move), and the matmul is priced as before
    assert t_eager == pytest.approx(dict.fromkeys(ops, floor))
    assert t_comp["linear"] == t_eager["linear"]
    assert 4.9 * floor < sum(t_eager.values()) - sum(t_comp.values()) <= 5 * floor
    # an intermediate kept for backward eagerly is kept by no compiled backward
    assert eager.node_memory(ops["gelu"], strat[ops["gelu"]]) > 0
    assert compiled.node_memory(ops["gelu"], strat[ops["gelu"]]) == 0
    # bytes: a fused op's price never exceeds its eager one; the bytes it moves are its
    # group's external tensors only
    big = dataclasses.replace(MeshSpec.preset("cpu-gloo", shape=(1,)), kernel_floor=0.0)
    e, c = CostModel(big), CostModel(big, fusion=fuse(chain))
    chain_ops = [ops[k] for k in ("mul", "add", "gelu", "dropout")]
    moved = sum(info(u).out.nbytes for u in (*tensor_inputs(ops["mul"]), ops["add"].args[1], ops["dropout"]))
    assert moved == 2 * 8 * 64 * 4 + 2 * 64 * 4  # x and the dropout's output; w and b
    group = sum(c.op_time(n, strat[n])[0] for n in chain_ops)
    # at least the external bytes (a member's FLOPs may price above its zero bytes)
    assert group >= moved / big.mem_bandwidth * (1 + c.backward_factor) * (1 - 1e-9)
    eager_group = sum(e.op_time(n, strat[n])[0] for n in chain_ops)
    assert group < 0.7 * eager_group  # each intermediate written and read again, eagerly


@pytest.fixture(scope="module")
def gpt_plans() -> dict[bool, tuple]:
    model, ex = gpt.build()
    mesh = MeshSpec.preset("cpu-gloo", shape=(4,))
    return {c: joint_plan(model, ex, mesh, PlanOptions(compile=c, search="drec", time_limit=10.0))
            for c in (False, True)}


def test_a_compiled_gpt_is_priced_faster_with_fewer_launches(gpt_plans) -> None:
    (_, eager), (cap_c, compiled) = gpt_plans[False], gpt_plans[True]
    assert (eager.decisions.compile, compiled.decisions.compile) == (False, True)
    assert compiled.decisions.step_seconds < eager.decisions.step_seconds
    assert compiled.decisions.breakdown["compute_seconds"] < eager.decisions.breakdown["compute_seconds"]
    fusion = fuse(cap_c.gm)
    assert fusion.groups >= 4  # each block's residual add and its layer norm at least
    kernels = [sum(len(st.kernels) for st in layer_stats(cap_c.gm, compiled, fusion=f))
               for f in (None, fusion)]
    assert kernels[1] < kernels[0]


def test_compiled_and_eager_plans_differ_by_key_and_round_trip(gpt_plans) -> None:
    eager, compiled = gpt_plans[False][1], gpt_plans[True][1]
    assert dict(decision_key(compiled.decisions))["compile"] is True
    assert dict(decision_key(eager.decisions))["compile"] is False
    again = Plan.from_json(compiled.to_json())
    assert again.decisions.compile is True and decision_key(again.decisions) == decision_key(compiled.decisions)
    assert Plan.from_json(eager.to_json()).decisions.compile is False
    # the summary says how the step was priced (it said nothing of compiling before)
    assert "compiled       torch.compile" in compiled.summary()
    assert "compiled" not in eager.summary()


def test_plan_takes_compile_and_refuses_a_non_bool() -> None:
    model, ex = gpt.build(layers=1)
    mesh = MeshSpec.preset("cpu-gloo", shape=(2,))
    assert autopar.plan(model, ex, mesh, compile=True, search="drec", time_limit=5.0).decisions.compile
    assert not autopar.plan(model, ex, mesh, compile=None, search="drec", time_limit=5.0).decisions.compile
    with pytest.raises(autopar.errors.ConfigError, match="compile"):
        autopar.plan(model, ex, mesh, compile="yes")
