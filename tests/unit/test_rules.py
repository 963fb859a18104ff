"""Brute-force validation of every sharding rule on simulated ranks (DTensor's strategy_validation habit).

Each sample is a tiny model (captured with :func:`autopar.capture.trace.capture`) or, for
ops that ``torch.export`` never emits, a hand-built single-op aten graph.  For every
node with a rule, every :class:`~autopar.sharding.rules.OpStrategy` the registry offers on the
sample's meshes is run as the lowering would run it (see ``rule_sim``) and compared
with the unsharded op.  Tolerances are stated in ``rule_sim.TOL``.
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rule_grad import validate_node_grads
from rule_samples import (
    F64,
    SAMPLES,
    Arg,
    Sample,
    _placeholders,
    x0,
    x1,
)
from rule_samples_more import SKIP
from rule_sim import (
    check_strategy,
    node_values,
    validate_node,
)
from torch import fx, nn
from torch.distributed.tensor import Shard

from autopar.capture.annotate import annotate
from autopar.capture.ir import tensor_inputs
from autopar.plans.placement import P, R
from autopar.sharding.rules import OpStrategy, RuleCtx, has_rule, op_strategies, registered_ops
from autopar.sharding.rules.views import reshape_dim_map

aten = torch.ops.aten

# ---------------------------------------------------------------- the validator
@functools.cache
def built(name: str) -> tuple[fx.GraphModule, list[torch.Tensor], dict[str, object]]:
    sample = next(s for s in SAMPLES if s.name == name)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    gm, xs = sample.build(gen)
    return gm, xs, node_values(gm, xs)


def rule_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of a sample whose targets have a rule."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and has_rule(n.target)]


_CASES = [pytest.param(s, m, id=f"{s.name}-{'x'.join(map(str, m))}")
          for s in SAMPLES for m in s.meshes]


@pytest.mark.parametrize(("sample", "mesh"), _CASES)
def test_rule_strategies(sample: Sample, mesh: tuple[int, ...]) -> None:
    """Every strategy of every ruled node of the sample equals the unsharded op."""
    gm, _, env = built(sample.name)
    nodes = rule_nodes(gm)
    assert nodes, f"sample {sample.name} exercises no op with a rule"
    for node in nodes:
        inputs = [env[x.name].detach() for x in tensor_inputs(node)]
        validate_node_grads(node, mesh, inputs, shape_only=sample.shape_only)


def test_rule_coverage() -> None:
    """Every registered op is exercised by a sample or skipped with a reason."""
    covered = set()
    for s in SAMPLES:
        covered |= {n.target for n in rule_nodes(built(s.name)[0])}
    registered = set(registered_ops())
    missing = registered - covered - set(SKIP)
    assert not missing, f"ops with a rule but no validator sample: {sorted(map(str, missing))}"
    stale = set(SKIP) & covered
    assert not stale, f"SKIP lists ops that samples do cover: {sorted(map(str, stale))}"


# ---------------------------------------------------------------- the validator can fail
def _one_node(name: str, target: object) -> tuple[fx.Node, list[torch.Tensor]]:
    gm, _, env = built(name)
    node = next(n for n in gm.graph.nodes if n.target == target)
    return node, [env[x.name].detach() for x in tensor_inputs(node)]


def test_validator_rejects_partial_through_nonlinear() -> None:
    node, inputs = _one_node("activations", aten.relu.default)
    with pytest.raises(AssertionError):
        check_strategy(node, OpStrategy(((P,),), ((P,),)), (2,), inputs)


def test_validator_rejects_wrong_output_placement() -> None:
    node, inputs = _one_node("mm", aten.mm.default)
    # k sharded leaves a Partial sum, not a replicated product
    with pytest.raises(AssertionError):
        check_strategy(node, OpStrategy(((Shard(1),), (Shard(0),)), ((R,),)), (2,), inputs)


def test_validator_needs_real_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Vocab-parallel cross-entropy is only right because ranks really all-reduce:
    with a collective that does nothing the check must fail."""
    import rule_sim
    import torch.distributed as dist

    node, inputs = _one_node("cross_entropy_mean", aten.cross_entropy_loss.default)
    strategy = next(s for s in op_strategies(node, RuleCtx((2,)))
                    if s.inputs[0] == (Shard(1),))
    check_strategy(node, strategy, (2,), inputs)  # passes with the simulated group
    monkeypatch.setattr(rule_sim, "_all_reduce", lambda t, op=dist.ReduceOp.SUM, group=None,
                        async_op=False: None)
    with pytest.raises(AssertionError):
        check_strategy(node, strategy, (2,), inputs)


# ---------------------------------------------------------------- hypothesis: random shapes
_HSET = settings(max_examples=20, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def _direct_node(op: object, xs: list[torch.Tensor], *args: object) -> fx.Node:
    g = fx.Graph()
    phs = _placeholders(g, xs)
    real = [xs[a.i] if isinstance(a, Arg) else a for a in args]
    n = g.call_function(op, tuple(phs[a.i] if isinstance(a, Arg) else a for a in args))
    n.meta["val"] = op(*real)
    g.output(n)
    annotate(fx.GraphModule(nn.Module(), g))
    return n


_dims = st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4)


@_HSET
@given(out=_dims, mask=st.lists(st.booleans(), min_size=4, max_size=4),
       drop=st.integers(0, 3), op=st.sampled_from([aten.add.Tensor, aten.mul.Tensor,
                                                   aten.div.Tensor, aten.maximum.default]),
       mesh=st.sampled_from([(2,), (2, 2)]), seed=st.integers(0, 2**16))
def test_pointwise_broadcast_random(out, mask, drop, op, mesh, seed) -> None:
    """Any right-aligned broadcast of two operands."""
    gen = torch.Generator().manual_seed(seed)
    yshape = [1 if m else d for d, m in zip(out, mask)][min(drop, len(out) - 1):]
    x = torch.randn(out, dtype=F64, generator=gen)
    y = torch.rand(yshape, dtype=F64, generator=gen) + 0.5
    node = _direct_node(op, [x, y], x0, x1)
    validate_node(node, mesh, [x, y])


@st.composite
def _reshape_pair(draw):
    src = draw(_dims)
    n = 1
    for d in src:
        n *= d
    # factor n into a random destination shape
    dst, rest = [], n
    while rest > 1 and len(dst) < 4:
        f = draw(st.sampled_from([f for f in (1, 2, 3, 4, 6, rest) if rest % f == 0]))
        dst.append(f)
        rest //= f
    if rest > 1 or not dst:
        dst.append(rest)
    return src, dst


@_HSET
@given(pair=_reshape_pair(), mesh=st.sampled_from([(2,), (2, 2), (3,)]), seed=st.integers(0, 99))
def test_reshape_random(pair, mesh, seed) -> None:
    """reshape_dim_map: every offered sharding of a random view is a contiguous chunk."""
    src, dst = pair
    dm = reshape_dim_map(tuple(src), tuple(dst))
    assert len(set(dm.values())) == len(dm)
    x = torch.randn(src, dtype=F64, generator=torch.Generator().manual_seed(seed))
    node = _direct_node(aten.view.default, [x], x0, list(dst))
    validate_node(node, mesh, [x])


@_HSET
@given(batch=st.lists(st.sampled_from([1, 2, 4]), max_size=2), k=st.sampled_from([2, 4, 6]),
       n=st.sampled_from([2, 4, 3]), bias=st.booleans(), mesh=st.sampled_from([(2,), (2, 2), (4,)]),
       seed=st.integers(0, 99))
def test_linear_random(batch, k, n, bias, mesh, seed) -> None:
    """aten.linear with random batch dims, sizes and bias."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn([*batch, k], dtype=F64, generator=gen),
          torch.randn(n, k, dtype=F64, generator=gen)]
    if bias:
        xs.append(torch.randn(n, dtype=F64, generator=gen))
    node = _direct_node(aten.linear.default, xs, *[Arg(i) for i in range(len(xs))])
    validate_node(node, mesh, xs)
