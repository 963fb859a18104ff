"""ZeRO's pricing against the collectives and copies its runtime issues: the optimizer
step sharded, reductions and gathers per micro-batch or per step, kept outputs."""

from __future__ import annotations

import pytest
from autopar.cost_models import MeshSpec

approx = pytest.approx


def test_optimizer_step_is_memory_bound_and_sharded_by_zero():
    from autopar.cost_models import optimizer_step_time

    from autopar.search.stages.layer_stats import LayerStat, ParamStat
    from autopar.search.stages.zero_price import zero_price

    mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
    # AdamW: read params, grads, m, v; write params, m, v
    assert optimizer_step_time(mesh, 1e9, 2e9) == pytest.approx(7e9 / mesh.mem_bandwidth)
    assert optimizer_step_time(mesh, 1e9, 0.0) == pytest.approx(3e9 / mesh.mem_bandwidth)  # plain SGD
    with pytest.raises(ValueError):
        optimizer_step_time(mesh, -1.0, 0.0)
    layer = LayerStat("blocks.0", params=[ParamStat(4e8, (0,)), ParamStat(1e8, (0,))])
    plain = zero_price(layer, mesh, 0, None, "adamw").opt_step
    assert plain == pytest.approx(optimizer_step_time(mesh, 5e8, 1e9))
    # ZeRO-1 over the 4-way axis: each rank updates a quarter (every stage alike)
    for stage in (1, 2, 3):
        assert zero_price(layer, mesh, stage, 0, "adamw").opt_step == pytest.approx(plain / 4)


def test_zero_priced_per_micro_batch_as_the_runtime_runs_it():
    """runtime/zero.py reduces stages 1-2 once, after the last micro-batch's backward
    (stage 2 then holds whole gradients, like stage 1), and stage 3 reduce-scatters in
    every micro-batch's backward (runtime/zero3.py): before, both were priced as if
    there were one micro-batch."""
    from autopar.search.stages.layer_stats import LayerStat, ParamStat
    from autopar.search.stages.zero_price import zero_price

    mesh = MeshSpec.preset("8xA100-nvlink", shape=(4,))
    layer = LayerStat("blocks.0", params=[ParamStat(4e8, (0,)), ParamStat(1e8, (0,))])
    one, four = (zero_price(layer, mesh, 2, 0, "adamw", m) for m in (1, 4))
    assert one.grads == pytest.approx(5e8 / 4) and four.grads == pytest.approx(5e8)
    # stage 1 also frees a whole gradient once its bucket launches (runtime/zero.py)
    assert zero_price(layer, mesh, 1, 0, "adamw", 1).grads == pytest.approx(5e8 / 4)
    # stages 1-2 hold the whole parameters the graph reads and the shards the optimizer steps
    assert one.params == pytest.approx(5e8 + 5e8 / 4)
    one, four = (zero_price(layer, mesh, 3, 0, "adamw", m) for m in (1, 4))
    assert four.grads == one.grads == pytest.approx(5e8 / 4)
    # 3 of the 4 reduce-scatters are per micro-batch work: 3/4 of one per micro-batch
    assert four.gather_mb - one.gather_mb == pytest.approx(0.75 * one.zero_sync)
    assert one.zero_sync > 0 and four.sync == pytest.approx(one.sync)


def test_zero12_gather_after_the_step_pays_one_latency_per_layer():
    """runtime/zero.py gathers the updated shards of stages 1-2 in fused buckets: the
    model charges each parameter's bytes and one latency per layer (it charged a latency
    per parameter: 69 x 1.3 ms on a calibrated gloo link, the +67 ms by which ZeRO-1
    was over-priced against data parallel, docs/benchmarks.md)."""
    from autopar.cost_models import all_gather_time

    from autopar.search.stages.layer_stats import LayerStat, ParamStat
    from autopar.search.stages.zero_price import zero_price

    mesh = MeshSpec.preset("cpu-gloo", shape=(4,))
    many = LayerStat("blocks.0", params=[ParamStat(1e4, (0,)) for _ in range(20)])
    one = LayerStat("blocks.0", params=[ParamStat(2e5, (0,))])
    for stage in (1, 2):
        g_many = zero_price(many, mesh, stage, 0, "adamw").gather_step
        g_one = zero_price(one, mesh, stage, 0, "adamw").gather_step
        # (each parameter's bytes less the d bytes its latency term stood for: 1e-4 here)
        assert g_many == pytest.approx(g_one, rel=1e-3)
        assert g_one == pytest.approx(all_gather_time(mesh, (0,), 2e5), rel=1e-6)
        assert g_many < 2 * all_gather_time(mesh, (0,), 1e4) * 10
    assert zero_price(one, mesh, 3, 0, "adamw").gather_step == 0.0


def test_zero1_reduction_is_priced_as_the_all_reduce_it_runs():
    """runtime/zero.py all-reduces a stage-1 bucket over the ZeRO axes and the other
    replicated axes at once (and keeps its part); stage 2 reduce-scatters it.  On gloo
    the reduce-scatter is the slower of the two (calibrated: 13-16 ms against 8-10 for
    4 MiB on 4 ranks), and stage 1 was priced as a reduce-scatter plus an all-reduce of
    the part over the other axes."""
    import dataclasses

    from autopar.cost_models import all_reduce_time, reduce_scatter_time
    from autopar.cost_models.link import LinkSpec

    from autopar.search.stages.layer_stats import LayerStat, ParamStat
    from autopar.search.stages.zero_price import zero_price

    base = MeshSpec.preset("cpu-gloo", shape=(2, 2))
    # a calibrated-like link: reduce-scatter at a ninth of the all-reduce's bandwidth
    link = LinkSpec(alpha=7e-4, beta=9e8, kinds=(("reduce_scatter", 7e-4, 1e8),))
    mesh = dataclasses.replace(base, links=(link, link), intra=None, gpus_per_node=None)
    layer = LayerStat("blocks.0", params=[ParamStat(4e6, (0, 1))])
    z1 = zero_price(layer, mesh, 1, 1, "adamw")
    z2 = zero_price(layer, mesh, 2, 1, "adamw")
    ar = all_reduce_time(mesh, (1, 0), 4e6) - all_reduce_time(mesh, (1, 0), 1.0)
    assert z1.zero_sync == pytest.approx(ar + all_reduce_time(mesh, (1, 0), 4), rel=1e-6)
    rs = reduce_scatter_time(mesh, (1,), 4e6)
    assert z2.zero_sync > rs > z1.zero_sync  # stage 2 pays its reduce-scatter
    # only stage 3 counts a reduce-scatter per micro-batch
    assert zero_price(layer, mesh, 1, 1, "adamw", 4).gather_mb == 0.0


def test_zero_runtime_copies_are_priced():
    """The ZeRO runtime copies shards into the all-gather's input, whole parameters out
    of the rank-major gathered buffer and gradients into the reduction's layout: on 4
    gloo ranks the GPT's ZeRO-3 spent about 15 ms a step more in ``aten::copy_`` and
    ``aten::cat`` than data parallel.  Stage 3 makes them in every micro-batch, stages 1-2
    once a step; data parallel copies each gradient into its bucket."""
    from autopar.cost_models import compute_time

    from autopar.search.stages.layer_stats import LayerStat, ParamStat
    from autopar.search.stages.zero_price import copied_bytes, zero_price

    mesh = MeshSpec.preset("cpu-gloo", shape=(4,))
    assert copied_bytes(4e6, 4) == pytest.approx(6 * 4e6 + 4e6)
    layer = LayerStat("blocks.0", params=[ParamStat(4e6, (0,))])
    copies = compute_time(mesh, 0.0, copied_bytes(4e6, 4))
    assert copies > 1e-3  # 28 MB at the preset's bandwidth: milliseconds, not noise
    one, four = (zero_price(layer, mesh, 3, 0, "adamw", m) for m in (1, 4))
    from autopar.cost_models import all_gather_time
    assert one.gather_mb == pytest.approx(2 * all_gather_time(mesh, 0, 4e6) + copies, rel=1e-6)
    assert four.gather_mb - one.gather_mb == pytest.approx(0.75 * one.zero_sync, rel=1e-6)
    assert one.copy_step == 0.0  # stage 3's are per micro-batch
    for m in (1, 4):  # stages 1-2: once a step, whatever the micro-batches
        assert zero_price(layer, mesh, 1, 0, "adamw", m).copy_step == pytest.approx(copies)
    # data parallel copies each gradient into its bucket (runtime/grad_sync.py), once a step
    assert zero_price(layer, mesh, 0, None, "adamw").copy_step == \
        pytest.approx(compute_time(mesh, 0.0, 2 * 4e6))
    assert zero_price(LayerStat("x", params=[ParamStat(4e6, ())]), mesh, 0, None, "adamw").copy_step == 0.0


def test_zero3_per_micro_batch_charge_is_its_own_reduce_scatter_only():
    """A parameter replicated on a second axis is also all-reduced there, but only once,
    after the last backward (GradSync is off before it): the per-micro-batch charge is
    the ZeRO axis's reduce-scatter alone."""
    from autopar.cost_models import reduce_scatter_time

    from autopar.search.stages.layer_stats import LayerStat, ParamStat
    from autopar.search.stages.zero_price import zero_price

    mesh = MeshSpec.preset("8xA100-nvlink", shape=(2, 4))
    layer = LayerStat("blocks.0", params=[ParamStat(4e8, (0, 1))])
    one, four = (zero_price(layer, mesh, 3, 1, "adamw", m) for m in (1, 4))
    rs = reduce_scatter_time(mesh, (1,), 4e8)
    assert one.zero_sync > rs * 1.01  # it holds the all-reduce over axis 0 too
    assert four.gather_mb - one.gather_mb == pytest.approx(0.75 * rs, rel=1e-6)


def test_an_output_is_kept_only_when_backward_reads_it():
    import torch
    from torch import fx

    from autopar.search.node_prices import kept_for_backward

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    norm = g.call_function(aten.native_layer_norm.default, (x, [8], None, None, 1e-5))
    out = g.call_function(aten.gelu.default, (x,))
    cast = g.call_function(aten._to_copy.default, (out,), {"dtype": torch.bfloat16})
    view = g.call_function(aten.view.default, (cast, [-1]))
    sm = g.call_function(aten._softmax.default, (x, -1, False))
    sm16 = g.call_function(aten._to_copy.default, (sm,), {"dtype": torch.bfloat16})
    # HF RMSNorm: x.pow(2).mean(-1); rsqrt; x * rsqrt; the residual add after
    sq = g.call_function(aten.pow.Tensor_Scalar, (x, 2))
    var = g.call_function(aten.mean.dim, (sq, [-1], True))
    r = g.call_function(aten.rsqrt.default, (var,))
    scaled = g.call_function(aten.mul.Tensor, (x, r))
    res = g.call_function(aten.add.Tensor, (scaled, x))
    g.output((norm, view, sm16, res))
    assert not kept_for_backward(out)  # gelu's fp32 output: only its bf16 copy is kept
    assert kept_for_backward(sm)  # softmax's backward reads its own (fp32) result
    assert kept_for_backward(cast)  # the copy is read by a view the graph returns
    assert kept_for_backward(norm)  # returned
    assert not kept_for_backward(sq)  # read only by a mean, which keeps no input
    assert kept_for_backward(var)  # rsqrt is not listed as keeping no input: kept (one value a row)
    assert not kept_for_backward(scaled)  # read only by the residual add
    assert kept_for_backward(r)  # read by a product
