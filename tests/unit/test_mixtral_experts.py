"""Hugging Face experts modules as one op (autopar/capture/hf_experts.py,
autopar/runtime/experts.py, autopar/sharding/rules/moe_experts.py): capture, the op against the
module's own loop (values and gradients), FLOPs, the pinned expert-parallel plan's code
and its price.  The rule itself is checked on simulated ranks in test_rules.py
(samples ``moe_experts*``); real gloo ranks in tests/dist/test_mixtral_ep.py."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopar import MeshSpec, auto_parallel  # noqa: E402
from autopar.capture.annotate import annotate  # noqa: E402
from autopar.capture.hf_experts import experts_act, experts_as_op  # noqa: E402
from autopar.capture.ir import info  # noqa: E402
from autopar.capture.trace import capture  # noqa: E402
from autopar.runtime.experts import MOE_EXPERTS, moe_experts  # noqa: E402
from autopar.search.node_prices import CostModel  # noqa: E402
from autopar.sharding.rules import RuleCtx, op_strategies  # noqa: E402
from autopar.sharding.rules.moe_experts import expert_axes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_zoo  # noqa: E402


def _experts(seed: int = 0):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = transformers.MixtralConfig(hidden_size=8, intermediate_size=6, num_local_experts=4,
                                     num_experts_per_tok=2)
    torch.manual_seed(seed)
    m = MixtralExperts(cfg)
    with torch.no_grad():
        m.gate_up_proj.normal_()
        m.down_proj.normal_()
    return m


def test_capture_calls_one_op_per_layer_and_restores_the_model():
    model, batch = hf_zoo.build("mixtral")
    experts = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    before = model(**batch).loss.detach()
    cap = capture(model, (), batch)
    nodes = [n for n in cap.gm.graph.nodes if n.target is MOE_EXPERTS]
    assert len(nodes) == model.config.num_hidden_layers == len(experts)
    assert all(n.args[5] == "silu" for n in nodes)
    # no routing op of the experts' loop is left (nonzero/where/index_add)
    ops = {str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function"}
    assert not {o for o in ops if "nonzero" in o or "index_add" in o or "where" in o}, ops
    # the user's model is unchanged: no instance forward left, same loss
    assert all("forward" not in vars(m) for m in experts)
    assert torch.equal(model(**batch).loss.detach(), before)
    out = cap.gm(*batch.values())
    assert torch.equal((out[0] if isinstance(out, (tuple, list)) else out).detach(), before)


def test_restores_forward_on_error_and_keeps_an_instance_forward():
    m = _experts()
    own = m.forward  # a bound method set on the instance by the user
    m.forward = own
    with pytest.raises(RuntimeError), experts_as_op(m):
        assert m.forward is not own
        raise RuntimeError
    assert vars(m)["forward"] is own


def test_op_equals_the_module_loop_values_and_gradients():
    m = _experts()
    t, k = 10, 2
    h = torch.randn(t, 8, requires_grad=True)
    logits = torch.randn(t, 4)
    w0, idx = torch.softmax(logits, -1).topk(k)
    w = w0.detach().requires_grad_()
    ref = m(h, idx, w)
    ref.square().sum().backward()
    ref_grads = [x.grad.clone() for x in (h, w, m.gate_up_proj, m.down_proj)]
    for x in (h, w, m.gate_up_proj, m.down_proj):
        x.grad = None
    out = moe_experts(h, idx, w, m.gate_up_proj, m.down_proj, experts_act(m))
    assert torch.equal(out, ref)  # the same loop order: bit for bit
    out.square().sum().backward()
    for g, r in zip((h.grad, w.grad, m.gate_up_proj.grad, m.down_proj.grad), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_only_plain_experts_are_taken():
    m = _experts()
    assert experts_act(m) == "silu"
    m.has_bias = True
    assert experts_act(m) is None
    m = _experts()
    m.act_fn = torch.nn.Tanh()
    assert experts_act(m) is None
    assert experts_act(torch.nn.Linear(2, 2)) is None


def _ann():
    model, batch = hf_zoo.build("mixtral")
    gm = annotate(capture(model, (), batch).gm)
    return gm, next(n for n in gm.graph.nodes if n.target is MOE_EXPERTS)


def test_flops_count_routed_tokens_only():
    _, node = _ann()
    t, k = info(node.args[1]).out.shape
    h, i = info(node.args[0]).out.shape[1], info(node.args[4]).out.shape[2]
    assert info(node).flops == 2.0 * t * k * 3 * h * i


def test_expert_parallel_price_and_mesh_check():
    _, node = _ann()
    mesh = MeshSpec.preset("cpu-gloo", shape=(2, 2))
    cm = CostModel(mesh)
    pool = op_strategies(node, RuleCtx((2, 2)))
    # the experts split over one axis at most
    assert all(len(sum(expert_axes(s.inputs), ())) <= 1 for s in pool)
    ep = [s for s in pool if expert_axes(s.inputs)[0]]
    dp = [s for s in pool if not any(expert_axes(s.inputs))]
    assert ep and dp
    assert all(cm.own_comm(node, s) > 0 for s in ep)
    assert all(cm.own_comm(node, s) == 0 for s in dp)


def test_pinned_expert_parallel_plan_calls_the_dispatch():
    from tests.dist.mixtral_ep_case import build, ep_pins

    model, batch = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = auto_parallel(model, example_kwargs=batch, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                           pins=ep_pins((2,), 0), search="ilp")
    moe = [n for n in pm.plan.nodes.values() if "moe_experts" in str(n.op)]
    assert len(moe) == 2
    assert all(n.in_placements[0] == "S(0)" and n.in_placements[3] == "S(0)" for n in moe)
    assert pm.code.count("autopar_runtime_experts_expert_parallel(") == 2
    assert "moe_experts.default" not in pm.code
    text = pm.plan.explain(moe[0].name)
    assert "runs as: expert parallel over a0 (2)" in text and "its own exchanges" in text, text


def _mixtral_8x7b_plan(pins: dict | None = None):
    import transformers as tf

    import autopar
    from autopar import MeshSpec

    cfg = tf.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                           num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
    with torch.device("meta"):
        model = tf.MixtralForCausalLM(cfg)
    ids = torch.zeros(64, 4096, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                            mesh=MeshSpec.preset("multinode-h100-ib", shape=(8, 8)),
                            precision="bf16-mixed", batch="local", pins=pins or {})


@pytest.mark.slow
def test_golden_mixtral_8x7b_shape_gets_ep():
    """Mixtral-8x7B's layer shape (8 experts of 4096 -> 14336, top-2, GQA) on 8 nodes of
    8 H100s, bf16-mixed, 64 sequences of 4,096: the experts split on their expert dim
    over one mesh axis (EP, the dispatch all-to-alls), planned in seconds.

    Issue 14 asks for the intra-node axis unless the cost model proves otherwise, and
    here it does: EP inside the node replicates every expert on the 8 nodes, so their fp32
    gradients (2.8B parameters for these 2 layers) are all-reduced over InfiniBand, which
    bf16 expert compute no longer hides; EP across nodes sends only the routed tokens
    there (and shards each node's expert over NVLink).  Measured: 69 ms predicted against
    87 ms with the experts pinned to EP inside the node.  The test holds the planner to
    that reasoning whichever axis it picks: EP pinned to the intra-node axis is never
    predicted faster."""
    import time

    from torch.distributed.tensor import Shard

    from autopar.plans.placement import parse_placements
    from autopar.plans.roles import axis_roles

    t0 = time.perf_counter()
    p = _mixtral_8x7b_plan()
    seconds = time.perf_counter() - t0
    experts = {v for k, v in p.params().items() if k.endswith(("gate_up_proj", "down_proj"))}
    ep_axes = {a for v in experts for a, x in enumerate(parse_placements(v)) if x == Shard(0)}
    assert len(ep_axes) == 1, experts  # one expert-parallel axis, the same for every expert
    ep = ep_axes.pop()
    assert "EP" in axis_roles(p)[ep].kind, axis_roles(p)
    assert seconds < 60, seconds  # ~3 s on an idle 2-core machine
    if axis_roles(p)[ep].link != "intra-node":
        intra = _mixtral_8x7b_plan({"*experts.gate_up_proj": "RS(0)", "*experts.down_proj": "RS(0)"})
        assert intra.decisions.step_seconds >= p.decisions.step_seconds, \
            (intra.decisions.step_seconds, p.decisions.step_seconds)
