"""Host offload priced (decision ``offload``): the bytes it moves off the devices, its
host budget, and the planner reaching for it only when nothing fits without it."""

from __future__ import annotations

import pytest
import torch
from autopar.cost_models import optimizer_step_time

import autopar
from autopar import MeshSpec
from autopar.errors import NoFitError, PlanError
from autopar.plans.decisions import PlanOptions
from autopar.search.offload import kinds, offload_price
from autopar.search.stages.layer_stats import LayerStat, ParamStat
from autopar.search.stages.zero_price import zero_price

MESH = MeshSpec.preset("cpu-gloo", shape=(2,))
DP = {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}


def test_levels_weighed() -> None:
    assert kinds(PlanOptions(), 0, MESH) == ["none"]
    assert kinds(PlanOptions(offload="auto"), 1, MESH) == ["none", "optimizer"]
    assert kinds(PlanOptions(offload="auto"), 3, MESH) == ["none", "optimizer", "params"]
    assert kinds(PlanOptions(offload="params"), 1, MESH) == []  # needs ZeRO-3
    unknown = MeshSpec.preset("cpu-gloo", shape=(2,)).__class__.from_dict(
        {**MESH.to_dict(), "host_memory": None})
    assert kinds(PlanOptions(offload="auto"), 3, unknown) == ["none"]  # no host budget known


def test_optimizer_level_by_hand() -> None:
    layer = LayerStat("blocks.0", params=[ParamStat(4e6, (0,), "w", (1000, 1000))])
    z = zero_price(layer, MESH, 0, None, "adamw")
    off = offload_price([layer], [z], "optimizer", 0, None, MESH, "adamw", 1)
    assert off.optimizer == 8e6 and off.params == 0.0  # AdamW: two fp32 states
    assert off.host == 8e6 + 2 * 4e6  # the state, the parameters and gradients it steps
    host_step = optimizer_step_time(MESH, 4e6, 8e6)  # cpu-gloo: the host is the device
    assert off.step == pytest.approx(2 * 4e6 / MESH.mem_bandwidth + host_step - z.opt_step)
    # ZeRO-3's shards on 2 ranks: half of everything, and the shards leave the device too
    z3 = zero_price(layer, MESH, 3, 0, "adamw")
    p3 = offload_price([layer], [z3], "params", 3, 0, MESH, "adamw", 1)
    assert (p3.params, p3.optimizer) == (2e6, 4e6)
    assert p3.per_micro == pytest.approx((2 * 2e6 + 2e6) / MESH.mem_bandwidth)


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.net(x), y)

    return Loss(), (torch.randn(8, 512), torch.randn(8, 512))


def _plan(**kw):
    model, ex = _mlp()
    return autopar.plan(model, example_inputs=ex, mesh=MESH, pins=DP, **kw)


def test_offload_only_when_nothing_fits() -> None:
    roomy = _plan()
    assert roomy.decisions.offload == "none" and roomy.decisions.host_memory == 0.0
    assert "offload='auto' weighs" in roomy.explain("offload")
    # the leanest plan on the devices needs 4.0 MiB a device (ZeRO-3 and all); with the
    # shards and state on the host, the two layers gathered at once take 2.1 MiB
    budget = 3 * 2**20
    with pytest.raises(NoFitError):
        _plan(memory_budget=budget, offload="none")
    import autopar.search.captures as captures
    calls = []
    real = captures.capture

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    captures.capture = counted
    try:
        tight = _plan(memory_budget=budget)
    finally:
        captures.capture = real
    alone = len(calls)
    calls.clear()
    captures.capture = counted
    try:
        _plan(memory_budget=budget, offload="auto")
    finally:
        captures.capture = real
    assert alone == len(calls)  # the retry with offload reuses the first search's captures
    d = tight.decisions
    assert d.offload in ("optimizer", "params") and d.host_memory > 0
    assert tight.memory["total"] <= budget
    assert tight.explain("offload").startswith("nothing fits the devices without offload")
    assert "  offload        " in tight.summary()
    back = autopar.Plan.from_json(tight.to_json())
    assert (back.decisions.offload, back.decisions.host_memory) == (d.offload, d.host_memory)


def test_host_budget_is_a_budget() -> None:
    small = MeshSpec.from_dict({**MESH.to_dict(), "host_memory": 1e5})
    model, ex = _mlp()
    with pytest.raises(NoFitError):
        autopar.plan(model, example_inputs=ex, mesh=small, pins=DP, offload="optimizer")


def test_params_level_needs_zero3() -> None:
    with pytest.raises(PlanError, match="zero_stage=3"):
        _plan(offload="params", zero_stage=1)
    assert _plan(offload="params").decisions.zero_stage == 3
