"""Planning-only API, pins, plan round trips and clear errors on bad input (no process group)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autopar
from autopar import CaptureError, MeshSpec, Plan, PlanError, Shard, auto_parallel, plan
from autopar.errors import GenerateError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402
import mlp  # noqa: E402


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    model, ex = gpt.build(layers=1)
    return plan(model, ex, MeshSpec.preset("cpu-gloo", shape=(2, 2)))


def test_plan_table_explain_json(gpt_plan: Plan) -> None:
    text = str(gpt_plan)
    assert "layout" in text and "step time" in text and "linear" in gpt_plan.table(nodes=True)
    assert "chosen" in gpt_plan.explain("linear")
    again = Plan.from_json(gpt_plan.to_json())
    assert again.params() == gpt_plan.params()
    assert again.objective == pytest.approx(gpt_plan.objective)
    assert "step       A" in gpt_plan.diff(again) and "0 differ" in gpt_plan.diff(again)


def test_plan_is_deterministic() -> None:
    model, ex = mlp.build()
    mesh = MeshSpec.preset("cpu-gloo", shape=(2,))
    a, b = plan(model, ex, mesh), plan(model, ex, mesh)
    assert [(n.in_placements, n.out_placements) for n in a.nodes.values()] == \
           [(n.in_placements, n.out_placements) for n in b.nodes.values()]


def test_pins_are_honoured_and_globs_lose_to_exact_names() -> None:
    model, ex = mlp.build()
    p = plan(model, ex, (2,), pins={"*": "R", "fc1.weight": (Shard(0),), "input:0": "S(0)"})
    assert p.params()["fc1.weight"] == "S(0)"
    assert p.params()["fc2.weight"] == "R"
    assert p.placement("x") == "S(0)"


def test_planning_only_module_code_and_export(tmp_path: Path) -> None:
    model, ex = mlp.build()
    pm = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                       pins={"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"})
    assert "autopar_runtime_collectives" in pm.code
    with pytest.raises(RuntimeError, match="planning-only"):
        pm(*ex)
    with pytest.raises(GenerateError, match="planning-only"):
        pm.generate(*ex)
    out = pm.export(tmp_path / "exp")
    for f in ("plan.json", "module.py", "meta.json", "rank0.pt", "rank1.pt", "README.md"):
        assert (out / f).exists()
    # each rank's file holds its own shard of fc1.weight (column halves)
    r0 = torch.load(out / "rank0.pt")["fc1.weight"][0]
    r1 = torch.load(out / "rank1.pt")["fc1.weight"][0]
    assert torch.equal(torch.cat([r0, r1]), model.fc1.weight.detach())
    compile(out.joinpath("module.py").read_text(), "module.py", "exec")
    # the whole state dict comes back in original names without a process group
    assert set(pm.full_state_dict()) == set(model.state_dict())


class Dynamic(nn.Module):
    """Data-dependent shapes: neither tracer can capture this."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0].sum() if x.sum().item() > 0 else x.sum()


def test_untraceable_model_names_the_line() -> None:
    # a value read into Python that decides a branch: the error names the forward's line
    # (before: both tracers' raw failures, no line of the model's)
    line = inspect.getsourcelines(Dynamic.forward)[1] + 1  # the return's line
    with pytest.raises(CaptureError, match=rf"(?s)torch.export.*test_api.py:{line}: return x\[x > 0\]"):
        plan(Dynamic(), (torch.randn(4),), (2,))


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="8xA100-nvlink"):
        MeshSpec.preset("16xTPU")


def test_indivisible_dim_is_avoided_or_errors() -> None:
    model, ex = mlp.build(d_in=6, hidden=10, d_out=3, batch=6)
    p = plan(model, ex, (4,))  # nothing divides by 4: the plan must replicate
    assert all(v == "R" for v in p.params().values())
    with pytest.raises(PlanError, match="not possible"):
        plan(model, ex, (4,), pins={"fc1.weight": "S(0)"})


def test_infeasible_memory_budget_says_how_much_is_needed() -> None:
    model, ex = mlp.build()
    with pytest.raises(PlanError, match=r"leanest plan found .* needs [\d.]+ KiB per device"):
        plan(model, ex, (2,), memory_budget=1024)


def test_bad_pins() -> None:
    model, ex = mlp.build()
    with pytest.raises(PlanError, match="names no parameter"):
        plan(model, ex, (2,), pins={"nope.weight": "R"})
    with pytest.raises(PlanError, match="placements for a 1-axis mesh"):
        plan(model, ex, (2,), pins={"fc1.weight": "RR"})


def test_hf_gpt2_captures_with_shapes() -> None:
    pytest.importorskip("transformers")
    import hf_gpt2

    from autopar.capture.annotate import annotate
    from autopar.capture.trace import capture

    model, ex = hf_gpt2.build()
    cap = capture(model, ex)
    annotate(cap.gm)
    infos = [n.meta["autopar"] for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert len(infos) > 100
    assert sum(i.flops for i in infos) > 0
    assert all(i.outputs or i.tuple_output is False for i in infos)
    assert "model.transformer.wte.weight" in {a for v in cap.aliases.values() for a in v}


def test_plan_takes_keyword_inputs_alone() -> None:
    # as auto_parallel does: before, plan(model, example_kwargs=...) raised TypeError for
    # the missing positional example_inputs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x).sum()

    x = torch.randn(4, 8)
    by_kw = plan(Kw(), example_kwargs={"x": x}, mesh=(2,))
    by_pos = plan(Kw(), (x,), (2,))
    assert by_kw.params() == by_pos.params()
    with pytest.raises(PlanError, match="example_inputs"):
        plan(Kw(), mesh=(2,))


def test_world_size_mismatch_without_group() -> None:
    from autopar.errors import MeshMismatchError
    from autopar.runtime.mesh import init_mesh

    with pytest.raises(MeshMismatchError, match="torchrun"):
        init_mesh((2, 2))


def test_public_names_have_docstrings() -> None:
    for name in autopar.__all__:
        if name in ("Shard", "Replicate", "Partial"):
            continue  # torch's own placement classes, re-exported
        obj = getattr(autopar, name)
        assert obj.__doc__, name
