"""Repeated-layer clustering (autopar/search/solvers/cluster.py) and planning on the meta device.

The clustered solver is the flat elimination DP shared between identical layers, so on
every GPT where both run it must return the flat optimum exactly (tolerance: float
summation order only, 1e-12 relative).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings

import pytest
import torch

from autopar import MeshSpec
from autopar.api import plan
from autopar.capture.annotate import annotate
from autopar.capture.trace import capture
from autopar.search.node_prices import CostModel
from autopar.search.op_placement import build_problem
from autopar.search.solvers.cluster import solve_clustered
from autopar.search.solvers.cluster_detect import find_clusters, shared_pricing
from autopar.search.solvers.ilp import solve_ilp
from autopar.search.solvers.problem import SolveStatus, evaluate
from autopar.sharding.strategies import enumerate_strategies
from examples.gpt import build


def _problem(layers: int, dim: int, preset: str, shape: tuple[int, ...], share: bool = False):
    with torch.device("meta"):
        model, ex = build(layers=layers, dim=dim, heads=4, vocab=512, seq=64, batch=16)
    cap = capture(model, ex)
    annotate(cap.gm)
    mesh = MeshSpec.preset(preset, shape=shape)
    st = enumerate_strategies(cap.gm, shape)
    pb = build_problem(cap.gm, mesh, st, CostModel(mesh), None,
                       shared_pricing(cap.gm, st) if share else None)
    return cap.gm, pb


@pytest.mark.parametrize("layers,dim,preset,shape", [
    (2, 64, "cpu-gloo", (4,)),
    (3, 256, "8xA100-nvlink", (2, 4)),
    (4, 512, "multinode-a100-ib", (2, 8)),
])
def test_clustered_equals_flat_optimum(layers, dim, preset, shape):
    gm, pb = _problem(layers, dim, preset, shape)
    cl = find_clusters(gm, pb.nodes, pb.strategies, pb.problem)
    assert cl is not None and len(cl.blocks) == layers and cl.classes == 1
    clustered = solve_clustered(pb.problem, cl, time_limit=30)
    flat = solve_ilp(pb.problem, time_limit=30)
    assert clustered.status is SolveStatus.OPTIMAL and flat.status is SolveStatus.OPTIMAL
    assert clustered.objective == pytest.approx(flat.objective, rel=1e-12)
    # expansion assigns every node a valid strategy and the objective is the plan's own
    assert len(clustered.choice) == pb.problem.num_nodes
    assert all(0 <= c < len(k) for c, k in zip(clustered.choice, pb.problem.node_costs))
    assert evaluate(pb.problem, clustered.choice)[0] == pytest.approx(clustered.objective, rel=1e-12)
    assert "clustered" in clustered.message


def test_shared_pricing_builds_the_same_problem():
    gm, flat = _problem(3, 128, "8xA100-nvlink", (2, 4))
    _, shared = _problem(3, 128, "8xA100-nvlink", (2, 4), share=True)
    a, b = flat.problem, shared.problem
    assert all((x == y).all() for x, y in zip(a.node_costs, b.node_costs))
    assert all((x == y).all() for x, y in zip(a.node_memory, b.node_memory))
    assert all(u == p and v == q and (m == n).all() for (u, v, m), (p, q, n) in zip(a.edges, b.edges))


@pytest.mark.slow  # ~15 s; the HF Llama budget case covers the same path
def test_budget_plans_fit_and_report_a_gap():
    gm, pb = _problem(3, 256, "8xA100-nvlink", (2, 4))
    cl = find_clusters(gm, pb.nodes, pb.strategies, pb.problem)
    free = solve_ilp(pb.problem)
    mem = evaluate(pb.problem, free.choice)[1]
    tight = dataclasses.replace(pb.problem, memory_budget=0.97 * mem)
    sol = solve_clustered(tight, cl, time_limit=20)
    assert evaluate(tight, sol.choice)[1] <= tight.memory_budget
    assert sol.objective >= free.objective * (1 - 1e-12)
    assert sol.status is SolveStatus.OPTIMAL or sol.gap is not None


def test_no_clusters_without_repeated_layers():
    gm, pb = _problem(1, 64, "cpu-gloo", (2,))
    assert find_clusters(gm, pb.nodes, pb.strategies, pb.problem) is None


def test_meta_device_plan_allocates_nothing():
    # 8 layers of dim 4096 hold 1.6e9 parameters: 6.5 GB in fp32 if anything allocated them
    with torch.device("meta"):
        model, ex = build(layers=8, dim=4096, heads=32, vocab=50304, seq=1024, batch=64)
    assert all(p.is_meta for p in model.parameters())
    t0 = time.perf_counter()
    p = plan(model, ex, MeshSpec.preset("multinode-a100-ib", shape=(2, 8)), search="ilp")
    assert time.perf_counter() - t0 < 60
    assert all(p.is_meta for p in model.parameters())
    assert p.solver.searcher == "ilp" and p.solver.backend.startswith("cluster")
    assert "clustered 8 repeated layers" in p.solver.message
    assert p.objective > 0 and len(p.nodes) > 8 * 30


# ------------------------------------------------------------------ Hugging Face Llama
def _llama_problem(layers: int, shape: tuple[int, ...], preset: str = "8xA100-nvlink",
                   precision: str = "native"):
    """A tiny HF Llama (GQA: 4 query heads, 2 key/value heads) on the meta device: its
    layers share the rotary cos/sin tables and the attention mask, which the one-entry
    block rule used to refuse.  The batch carries an ``attention_mask``: without one the
    mask is built from shapes alone, and capture turns it into SDPA's ``is_causal``."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.zeros(8, 64, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # replicated fallbacks of the rotary/mask ops
        cap = capture(model, (), batch, precision=precision)
        annotate(cap.gm)
        mesh = MeshSpec.preset(preset, shape=shape)
        st = enumerate_strategies(cap.gm, shape)
        pb = build_problem(cap.gm, mesh, st, CostModel(mesh), None)
    return model, ids, cap.gm, pb


@pytest.fixture(scope="module")
def llama4():
    return _llama_problem(4, (2, 4))


@pytest.mark.parametrize("precision", ["native", "bf16-mixed"])
def test_clustering_engages_on_hf_llama_and_equals_the_flat_optimum(llama4, precision):
    # bf16-mixed: a parameter's cast sits in the layer that uses it, so the layers stay
    # chain links (autopar/capture/mixed_precision.py)
    _, _, gm, pb = llama4 if precision == "native" else _llama_problem(4, (2, 4), precision=precision)
    cl = find_clusters(gm, pb.nodes, pb.strategies, pb.problem)
    assert cl is not None and len(cl.blocks) == 4 and cl.classes == 1
    # the rotary cos, sin and the mask feed every layer: shared inputs, not chain entries
    assert len(cl.sides) >= 2
    assert "1 layer class" in cl.describe()
    clustered = solve_clustered(pb.problem, cl, time_limit=60)
    flat = solve_ilp(pb.problem, time_limit=60)
    assert clustered is not None
    assert clustered.status is SolveStatus.OPTIMAL and flat.status is SolveStatus.OPTIMAL
    # the same DP, summed in another order: 1e-12 relative
    assert clustered.objective == pytest.approx(flat.objective, rel=1e-12)
    assert evaluate(pb.problem, clustered.choice)[0] == pytest.approx(clustered.objective, rel=1e-12)


def test_side_layouts_bounded_above_the_best_are_not_solved(llama4, monkeypatch):
    # the layouts of the shared rotary tables and mask: each is bounded before its MIP,
    # and the answer must be the one solving every layout gives (same plan, same value)
    import autopar.search.solvers.cluster as cluster

    _, _, gm, pb = llama4
    cl = find_clusters(gm, pb.nodes, pb.strategies, pb.problem)
    calls: list[int] = []
    real = cluster.solve_ilp

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cluster, "solve_ilp", counting)
    pruned = solve_clustered(pb.problem, cl, time_limit=60)
    n_pruned = len(calls)
    monkeypatch.setattr(cluster, "_reduced_bound", lambda reduced: -math.inf)  # solve all
    every = solve_clustered(pb.problem, cl, time_limit=60)
    n_layouts = len(calls) - n_pruned
    assert n_layouts > 1, "the test needs several side layouts"
    assert n_pruned < n_layouts
    assert pruned.choice == every.choice and pruned.objective == every.objective


@pytest.mark.slow
def test_clustered_budget_bound_is_valid_on_hf_llama():
    # one 4-device axis: the flat budgeted MIP proves its optimum in seconds here
    _, _, gm, pb = _llama_problem(4, (4,))
    cl = find_clusters(gm, pb.nodes, pb.strategies, pb.problem)
    free = solve_ilp(pb.problem)
    tight = dataclasses.replace(pb.problem, memory_budget=0.9 * evaluate(pb.problem, free.choice)[1])
    sol = solve_clustered(tight, cl, time_limit=60)
    flat = solve_ilp(tight, time_limit=120)
    assert evaluate(tight, sol.choice)[1] <= tight.memory_budget
    assert sol.gap is not None and sol.gap <= 0.01
    # the proven bound may not pass the true budgeted optimum (the flat MIP's, or its
    # incumbent when it stopped early; 1e-9 is float summation order)
    assert sol.objective * (1 - sol.gap) <= flat.objective * (1 + 1e-9)
    assert sol.objective >= (flat.objective * (1 - flat.gap) if flat.gap else flat.objective) * (1 - 1e-9)


def test_hf_llama_plan_says_its_layer_classes():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.zeros(8, 64, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, (), MeshSpec.preset("8xA100-nvlink", shape=(8,)), search="ilp",
                 example_kwargs={"input_ids": ids, "labels": ids})
    assert p.solver.backend.startswith("cluster")
    assert "clustered 3 repeated layers into 1 layer class" in p.solver.message


def _hf_case(name: str):
    import transformers as tf

    ids = torch.zeros(4, 16, dtype=torch.long)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3,
                            num_attention_heads=4, intermediate_size=128,
                            max_position_embeddings=32)
        return tf.BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}
    cfg = tf.ViTConfig(image_size=16, patch_size=4, hidden_size=64, num_hidden_layers=3,
                       num_attention_heads=4, intermediate_size=128, num_labels=5)
    return tf.ViTForImageClassification(cfg), {"pixel_values": torch.zeros(4, 3, 16, 16),
                                                "labels": torch.zeros(4, dtype=torch.long)}


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_clustering_on_hf_models_equals_the_flat_optimum(name):
    """GPT-2 (position embeddings), BERT (extended attention mask) and ViT as they come:
    each layer reads one shared input besides its predecessor's output."""
    model, kw = _hf_case(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (), kw)
        annotate(cap.gm)
        mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
        st = enumerate_strategies(cap.gm, (4,))
        pb = build_problem(cap.gm, mesh, st, CostModel(mesh), None)
    cl = find_clusters(cap.gm, pb.nodes, pb.strategies, pb.problem)
    assert cl is not None and len(cl.blocks) == 3 and cl.classes == 1
    clustered = solve_clustered(pb.problem, cl, time_limit=60)
    flat = solve_ilp(pb.problem, time_limit=60)
    assert clustered is not None and clustered.status is SolveStatus.OPTIMAL
    assert clustered.objective == pytest.approx(flat.objective, rel=1e-12)  # summation order
