"""examples/moe.py without a process group: the routing's semantics, the expert-parallel
plan's lowering (all-to-all on the dispatched tokens and back) and what the planner
picks on its own where the experts dominate (planned on the meta device)."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import fx

from autopar import MeshSpec, auto_parallel, plan
from autopar.plans.roles import axis_roles
from autopar.runtime import collectives as C

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import moe  # noqa: E402

DISPATCH, EXPERT_IN, COMBINE = "gsec,gsm->egcm", "egcm,emh->egch", "gsec,egcm->gsm"


def _route_by_loops(probs: torch.Tensor, top_k: int, cap: int) -> torch.Tensor:
    """GShard's routing written as loops: per group, every token's first choice queues
    in token order, then the second choices behind them; a full expert drops."""
    g, s, e = probs.shape
    out = torch.zeros(g, s, e, cap, dtype=probs.dtype)
    gates, idx = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    for gi in range(g):
        used = [0] * e
        for j in range(top_k):
            for si in range(s):
                ex = int(idx[gi, si, j])
                if used[ex] < cap:
                    out[gi, si, ex, used[ex]] = gates[gi, si, j]
                    used[ex] += 1
    return out


@pytest.mark.parametrize(("top_k", "factor"), [(2, 1.0), (2, 0.5), (1, 1.0), (2, 4.0)])
def test_route_matches_loops(top_k: int, factor: float) -> None:
    """The cumsum formulation keeps and places exactly the tokens the loops do."""
    probs = torch.rand(3, 12, 4, generator=torch.Generator().manual_seed(top_k)).softmax(-1)
    cap = moe.capacity(12, 4, top_k, factor)
    combine, first = moe.route(probs, top_k, cap)
    torch.testing.assert_close(combine, _route_by_loops(probs, top_k, cap))
    assert torch.equal(first.argmax(-1), probs.argmax(-1))


def _graph(pm) -> fx.Graph:
    return pm.inner.graph


def _einsums(g: fx.Graph, eq: str) -> list[fx.Node]:
    return [n for n in g.nodes if n.target is torch.ops.aten.einsum.default and n.args[0] == eq]


# one layer on 2x2: the MIP over two mesh axes is the slow part of planning
@pytest.mark.parametrize(("shape", "axis", "layers"), [((2,), 0, 2), ((2, 2), 1, 1)])
def test_pinned_ep_lowers_to_all_to_all(shape: tuple[int, ...], axis: int, layers: int) -> None:
    """Under the EP pins the dispatched tokens go through an all-to-all (groups -> experts)
    into the experts' einsum, and the experts' output through the reverse all-to-all into
    the combine, on the expert axis."""
    model, ex = moe.build(layers=layers)
    mesh = MeshSpec.preset("cpu-gloo", shape=shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op may fall back to replication
        pm = auto_parallel(model, example_inputs=ex, mesh=mesh,
                           pins=moe.ep_pins(layers, len(shape)))
    g = _graph(pm)
    for disp, expert, comb in zip(_einsums(g, DISPATCH), _einsums(g, EXPERT_IN),
                                  _einsums(g, COMBINE), strict=True):
        there = expert.args[1][0]
        assert there.target is C.all_to_all and there.args == (disp, 1, 0, axis)
        back = comb.args[1][1]
        assert back.target is C.all_to_all and back.args[1:] == (0, 1, axis)
    assert len(_einsums(g, DISPATCH)) == layers
    assert "autopar_runtime_collectives_all_to_all(einsum, 1, 0, " in pm.code
    # the plan lists the same swaps (and the dense part's choices are the planner's)
    assert {s for _, s in pm.plan.redistributions() if s.startswith("all_to_all")} == {
        f"all_to_all(axis={axis}, dim=1->0)", f"all_to_all(axis={axis}, dim=0->1)"}


# A model whose experts dominate: 8 experts of 1024 -> 4096 -> 1024 per layer (~67M
# expert weights against ~4M dense ones per layer), 16k tokens.
BIG = {"layers": 2, "dim": 1024, "heads": 16, "hidden": 4096, "experts": 8, "vocab": 32000,
       "seq": 1024, "batch": 16}


def big(layers: int) -> tuple[torch.nn.Module, tuple]:
    with torch.device("meta"):
        return moe.build(**{**BIG, "layers": layers})


# The MoE layer is not series-parallel, so its layers are not clustered (docs/
# architecture.md) and the 2-D mesh goes to the flat MIP: hence one layer there (the
# same choice per layer; 24 s here against 45-75 s for two) and the slow step.
@pytest.mark.parametrize(("shape", "ep", "layers"), [
    ((8,), "S(0)", 2), pytest.param((2, 4), "RS(0)", 1, marks=pytest.mark.slow)])
def test_planner_picks_ep_when_experts_dominate(shape: tuple[int, ...], ep: str, layers: int) -> None:
    """8 A100s on NVLink: replicated experts would all-reduce ~1 GB of gradients per step
    and hold it 8 times; the planner splits them over the (inner) axis and moves the
    tokens by all-to-all, with the groups split on every axis (EP x DP on 2x4)."""
    model, ex = big(layers)
    p = plan(model, ex, MeshSpec.preset("8xA100-nvlink", shape=shape), search="ilp")
    experts = {v for k, v in p.params().items() if k.endswith(("w_in", "w_out"))}
    if len(shape) == 1:
        assert experts == {ep}
    else:
        # split on the inner axis; on the outer one replicated (EP4 x DP2) or split too
        # (EP8): a near tie on one NVLink node (96.7 against 96.9 ms a step) that data
        # parallel's copy of each gradient into its bucket, priced since stop 37, tips
        # to EP8.  Never replicated on the inner axis.
        assert len(experts) == 1 and experts <= {ep, "S(0)S(0)"}, experts
    ax = len(shape) - 1
    swaps = {(n, s) for n, s in p.redistributions() if s.startswith("all_to_all")}
    for k in range(layers):
        assert (f"einsum_{4 * k + 1}", f"all_to_all(axis={ax}, dim=1->0)") in swaps
        assert (f"einsum_{4 * k + 3}", f"all_to_all(axis={ax}, dim=0->1)") in swaps
    # the experts' matmul is priced as the batched matmul it is
    e, m, h = BIG["experts"], BIG["dim"], BIG["hidden"]
    g, s = BIG["batch"], BIG["seq"]
    c = moe.capacity(s, e, 2, 1.0)
    assert p.nodes["einsum_1"].flops == 2.0 * e * g * c * m * h
    assert math.isfinite(p.objective)
    # the summary says expert parallel on the expert axis (not FSDP: the experts are split
    # on their expert dim, the dense weights are not)
    role = axis_roles(p)[ax].kind
    assert role.endswith("EP") and "FSDP" not in role, role
