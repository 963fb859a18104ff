"""``precision="bf16-mixed"``: autocast's casts written into the captured graph
(autopar/capture/mixed_precision.py), priced by dtype (cost_models: ``MeshSpec.peak_for``) and
recorded in the plan. The runtime's equivalence is in tests/dist/test_mixed_precision.py."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from autopar.cost_models import compute_time
from torch import nn

import autopar
from autopar import MeshSpec
from autopar.capture.mixed_precision import apply_mixed_precision
from autopar.capture.trace import capture
from autopar.errors import ConfigError
from autopar.plans.data import Plan
from autopar.plans.kinds import Precision

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402
import hf_zoo  # noqa: E402

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        h = self.norm(self.up(x))
        return x + torch.softmax(self.down(h), -1)


def _dtypes(gm) -> dict:
    return {n.name: n.meta["val"].dtype for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def test_policy_casts_matmuls_down_and_norms_back_up():
    cap = capture(Block(), (torch.randn(4, 8),), precision="bf16-mixed")
    dt = _dtypes(cap.gm)
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    assert dt["linear"] == dt["linear_1"] == torch.bfloat16
    assert dt["layer_norm"] == torch.float32  # its bf16 input was cast back up
    assert nodes["layer_norm"].args[0].target is aten._to_copy.default
    assert dt["softmax"] == torch.float32
    # the residual add promotes: the model's output keeps the input's dtype
    assert dt["add"] == torch.float32
    # parameters stay fp32 (masters); each cast sits right before its first user
    assert dt["up_weight"] == torch.float32
    order = list(cap.gm.graph.nodes)
    for n in order:
        if n.target is aten._to_copy.default:
            first = min(n.users, key=order.index)
            between = order[order.index(n) + 1:order.index(first)]
            assert all(b.target is aten._to_copy.default for b in between)
    assert "_to_copy" in cap.gm.code


def test_native_is_a_no_op_and_unknown_precisions_are_refused():
    cap = capture(Block(), (torch.randn(4, 8),))
    before = cap.gm.code
    assert apply_mixed_precision(cap.gm, "native") == 0 and cap.gm.code == before
    assert Precision.parse(None) is Precision.NATIVE
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        Precision.parse("fp8")
    with pytest.raises(ConfigError, match="unknown precision"):
        autopar.plan(Block(), (torch.randn(4, 8),), (2,), precision="fp8")


def test_hf_llama_graph_computes_what_torch_autocast_computes():
    model, batch = hf_zoo.build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mixed = capture(model, (), batch, precision="bf16-mixed")
        native = capture(model, (), batch)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = float(model(**batch).loss)
        got = float(mixed.gm(*batch.values())[0])
        full = float(native.gm(*batch.values())[0])
    # CPU autocast and the CUDA policy of the pass agree on every op of Llama: the same
    # casts give the same bits; the fp32 graph is 1.6e-5 away, so this could fail
    assert got == pytest.approx(ref, rel=1e-6)
    assert abs(full - ref) > 1e-6 * abs(ref)


@pytest.mark.parametrize("name", ["llama", "mixtral", "t5"])
def test_reused_values_equal_a_full_repropagation(name, monkeypatch):
    """The pass re-runs only the nodes whose inputs changed dtype and keeps the capture's
    value for the rest; a full fake-tensor re-propagation (a fresh mode, every node run)
    gives the same casts, code and every node's dtype and shape."""
    import autopar.capture.mixed_precision as mp

    model, batch = hf_zoo.build(name)

    def sig(cap):
        return cap.gm.code, [(n.name, [(getattr(x, "dtype", None), tuple(getattr(x, "shape", ())))
                                       for x in torch.utils._pytree.tree_leaves(n.meta.get("val"))])
                             for n in cap.gm.graph.nodes]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = sig(capture(model, (), batch, precision="bf16-mixed"))
        monkeypatch.setattr(mp, "detect_fake_mode", lambda vals: None)  # the full propagation
        full = sig(capture(model, (), batch, precision="bf16-mixed"))
    assert "_to_copy" in fast[0]
    assert fast == full


def test_hf_mixtral_experts_compute_what_torch_autocast_computes():
    """The experts op (autopar/runtime/experts.py) under bf16-mixed runs its matmuls in
    bf16 as transformers' loop does under autocast: its weights cast like a linear's,
    each row cast at the matmul, the routing weights' product kept in fp32 (before, the
    op ran in fp32 and was priced at the fp32 peak: 15x slower than it runs on H100)."""
    model, batch = hf_zoo.build("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mixed = capture(model, (), batch, precision="bf16-mixed")
    experts = [n for n in mixed.gm.graph.nodes if "moe_experts" in str(n.target)]
    assert experts and all(n.args[3].meta["val"].dtype == torch.bfloat16
                           and n.args[4].meta["val"].dtype == torch.bfloat16 for n in experts)
    assert all(n.meta["val"].dtype == torch.float32 for n in experts)  # the residual's dtype
    # the reference runs transformers' eager loop, the computation the op mirrors: its
    # default grouped_mm sums a token's experts in another order, and on CPU its
    # fallback is a custom op that autocast does not cast (it computes in fp32)
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = float(model(**batch).loss)
        got = float(mixed.gm(*batch.values())[0])
        full = float(capture(model, (), batch).gm(*batch.values())[0])
    assert got == ref  # the same casts in the same order: the same bits
    assert full != ref  # fp32 experts land elsewhere (1.7e-6 relative on this tiny model)


def _gpt_plan(precision: str, budget: float | None = None):
    cfg = gpt.GPTConfig(vocab=1024, seq=1024, dim=512, heads=8, layers=2)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    ids = torch.zeros(16, 1024, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, (ids, ids), MeshSpec.preset("8xA100-nvlink", shape=(4,)),
                            precision=precision, memory_budget=budget)


def test_memory_decides_differently_in_bf16_mixed():
    """Golden (issue 10): under a budget between the two plans' needs, the fp32 model must
    accumulate, recompute or shard, while the bf16-mixed one (bf16 activations where
    autocast keeps them) fits as it is and is faster on the bf16 tensor cores."""
    free32, free16 = _gpt_plan("native"), _gpt_plan("bf16-mixed")
    assert free16.memory["activations"] < free32.memory["activations"]
    budget = (free16.memory["total"] + free32.memory["total"]) / 2
    p32, p16 = _gpt_plan("native", budget), _gpt_plan("bf16-mixed", budget)
    d32, d16 = p32.decisions, p16.decisions
    assert (d16.micro_batches, d16.zero_stage, d16.recompute) == (1, 0, [])
    assert d32.micro_batches > 1 or d32.zero_stage > 0 or d32.recompute
    assert p32.memory["total"] <= budget and p16.memory["total"] <= budget
    # A100: 312 TFLOP/s bf16 against 19.5 fp32 (no TF32 by default)
    assert d16.step_seconds < d32.step_seconds / 4
    assert d16.precision == "bf16-mixed" and d32.precision == "native"
    # the summary says so; a native plan says nothing about precision
    assert "precision      bf16-mixed" in str(p16) and "precision " not in str(p32)
    again = Plan.from_json(p16.to_json())
    assert again.decisions.precision == "bf16-mixed"


def test_compute_is_priced_at_the_dtypes_peak():
    h100 = MeshSpec.preset("8xH100-nvlink")
    assert h100.peak_for(torch.bfloat16) == 989e12 and h100.peak_for(torch.float32) == 67e12
    f = 1e12
    assert compute_time(h100, f, 0.0, torch.float32) == pytest.approx(
        compute_time(h100, f, 0.0, torch.bfloat16) * 989 / 67)
    assert compute_time(h100, f, 0.0) == compute_time(h100, f, 0.0, torch.bfloat16)
    cpu = MeshSpec.preset("cpu-gloo")  # one rate for every dtype
    assert cpu.peak_for(torch.float32) == cpu.peak_for(torch.bfloat16) == cpu.peak_flops
    assert MeshSpec.from_dict(h100.to_dict()) == h100
    with pytest.raises(ValueError, match="fp32_peak_flops"):
        MeshSpec.from_dict({**h100.to_dict(), "fp32_peak_flops": -1.0})


def test_fp16_mixed_plans_like_bf16_mixed_with_float16_casts():
    """fp16 has bf16's size and (on the GPU presets) its tensor-core peak: the same plan,
    priced the same, with float16 where bf16-mixed has bfloat16."""
    p16, pbf = _gpt_plan("fp16-mixed"), _gpt_plan("bf16-mixed")
    assert p16.decisions.precision == "fp16-mixed"
    assert p16.params() == pbf.params()
    assert p16.decisions.step_seconds == pytest.approx(pbf.decisions.step_seconds)
    assert p16.memory["total"] == pytest.approx(pbf.memory["total"])
    model, ex = gpt.build(layers=1)
    gm = capture(model, ex, precision="fp16-mixed").gm
    low = {d for d in _dtypes(gm).values() if d in (torch.float16, torch.bfloat16)}
    assert low == {torch.float16}
    assert Precision.parse("fp16-mixed").low is torch.float16
    assert Plan.from_json(p16.to_json()).decisions.precision == "fp16-mixed"
