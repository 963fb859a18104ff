"""Which shapes a plan serves and what it predicts at them: ``plan.explain("shapes")``,
the summary's ``shapes`` line and ``plan.predict(batch=, seq=)`` (autopar/report/shapes.py)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar import MeshSpec, Plan
from autopar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402
import mlp  # noqa: E402

B0, S0 = 8, 256
MESH = MeshSpec.preset("8xA100-nvlink", shape=(2, 2))


def _llama():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(cfg)


def _plan_at(model, b: int, s: int, **forced) -> Plan:
    with torch.device("meta"):
        ids = torch.randint(0, 4096, (b, s))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 on an A100 preset: priced at the fp32 rate
        return autopar.plan(model, (), MESH, example_kwargs={"input_ids": ids, "labels": ids},
                            **forced)


@pytest.fixture(scope="module")
def llama():
    """A Llama (GQA, hidden 256, head dim 32) planned at batch 8 x 256 tokens on 2x2 A100s,
    big enough that its ops are priced above the kernel launch floor."""
    model = _llama()
    return model, _plan_at(model, B0, S0)


def _forced(p: Plan) -> dict:
    """The plan's own decisions and parameter placements, forced: a plan at another shape
    then differs from it by the shape alone."""
    d = p.decisions
    return dict(zero_stage=d.zero_stage, zero_axes=d.zero_axes or None, pipeline_stages=1,
                micro_batches=1, recompute=list(d.recompute), pins=p.params())


def test_predict_at_the_priced_shape_is_the_plan_step(llama, tmp_path):
    _, p = llama
    step = p.decisions.step_seconds
    assert step > 0
    assert p.predict() == step
    assert p.predict(batch=B0, seq=S0) == step
    # the JSON keeps what predict reads (each node's dtype among it)
    p.to_json(tmp_path / "plan.json")
    q = Plan.from_json(tmp_path / "plan.json")
    assert q.nodes["linear"].dtype == "float32" and q.nodes["input_ids"].dtype == "int64"
    assert q.predict() == step
    assert q.predict(batch=2 * B0, seq=S0 // 2) == p.predict(batch=2 * B0, seq=S0 // 2)


def test_predict_grows_with_batch_and_with_length(llama):
    _, p = llama
    # batches the batch-splitting axes (2x2 here) divide, and lengths up to 8x
    by_batch = [p.predict(batch=b) for b in (4, 8, 16, 32, 64)]
    by_seq = [p.predict(seq=s) for s in (32, 64, 128, 256, 512, 1024, 2048)]
    for xs in (by_batch, by_seq):
        assert all(a <= b for a, b in zip(xs, xs[1:])), xs
        assert xs[-1] > 2 * xs[0]
    # a batch the 4 batch-splitting ranks do not divide runs whole on every rank: dearer
    # than a larger batch that divides
    assert p.predict(batch=9) > p.predict(batch=12) > p.predict(batch=8)
    # the length's growth is more than linear (attention's S x S) where the batch's is not:
    # the same tokens cost more as one long sequence
    assert p.predict(batch=B0, seq=4 * S0) > p.predict(batch=4 * B0, seq=S0)


@pytest.mark.parametrize("shape", [(2 * B0, S0), (B0, 2 * S0)], ids=["batch_x2", "seq_x2"])
def test_predict_matches_planning_at_that_shape(llama, shape):
    """predict at twice the batch (or length) against the step the planner prices when it
    plans the same model at that shape with the same decisions and placements forced.
    Measured: predict over planned 1.0036 (batch x2) and 1.0034 (length x2); from half
    to four times the batch or length 1.0032-1.0068 here, 0.997-1.003 for the
    tutorial's 1B-wide Llama on 2x8 H100s, 0.999-1.001 at batch 8 x 128 on 2 gloo
    ranks.  What is left is mostly latency: the logits' return to the caller is priced inside their op,
    whose price predict grows whole (10 us of latency per doubling here), where the
    cost model prices that latency once.  1% bounds it, with room for gradient buckets
    the two plans may choose differently."""
    model, p = llama
    q = _plan_at(model, *shape, **_forced(p))
    assert [n.out_placements for n in q.nodes.values()] == \
        [p.nodes[k].out_placements for k in q.nodes]  # the same plan, at another shape
    planned, predicted = q.decisions.step_seconds, p.predict(*shape)
    assert predicted == pytest.approx(planned, rel=0.01)
    # and it is a prediction: the step moved by far more than the tolerance
    assert planned > 1.3 * p.decisions.step_seconds


def test_explain_shapes_and_the_summary_line(llama):
    _, p = llama
    text = p.explain("shapes")
    step = p.decisions.step_seconds
    assert text.startswith(f"priced at batch {B0} x seq {S0} ({B0 * S0} tokens): "
                           f"{step * 1e3:.4g} ms per step predicted, for that shape")
    assert "serves any batch >= 1 and any length" in text
    assert "a batch not divisible by 4 (mesh axes a0, a1, which split the batch) runs " \
           "replicated" in text
    assert f"batch 1 x seq {S0} ({S0} tokens)" in text
    assert f"{p.predict(batch=2 * B0) * 1e3:.4g} ms" in text
    assert p.explain("shape") == text and "shapes" in p.explainable()
    line = next(ln for ln in p.summary().splitlines() if ln.startswith("  shapes"))
    assert f"priced at batch {B0} x seq {S0} ({B0 * S0} tokens), the step above is per that " \
           "shape; serves any batch and any length" in line


def test_a_pipelined_plan_runs_other_shapes_priced_at_its_own():
    model, ex = gpt.build(layers=2)
    p = autopar.plan(model, ex, (4,), pipeline_stages=2, micro_batches=4, schedule="1f1b")
    assert p.predict() == p.decisions.step_seconds
    assert p.predict(batch=8, seq=32) == p.decisions.step_seconds  # gpt.build's shape
    with pytest.raises(ConfigError, match="2 pipeline stages and 4 micro-batches.*to price batch 16 x seq 32, "
                                          "plan again with an example of that shape"):
        p.predict(batch=16)
    text = p.explain("shapes")
    assert "serves any length, and any batch that splits into equal micro-batches" in text
    assert "plan.predict prices the planned shape only" in text
    assert "predicted at other shapes" not in text
    assert "batches that split into equal micro-batches (priced at this shape only)" in p.summary()


def test_bad_values_and_a_model_without_token_ids():
    model, ex = mlp.build()
    p = autopar.plan(model, ex, (2,))
    assert "priced at batch 16: " in p.explain("shapes")  # float inputs: no sequence
    assert p.predict(batch=64) > p.predict(batch=16) == p.decisions.step_seconds
    with pytest.raises(ConfigError, match="no token ids"):
        p.predict(seq=8)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="batch must be a positive integer"):
            p.predict(batch=bad)


def test_local_batch_inputs_taken_as_they_arrive() -> None:
    """batch="local": the tiny Llama of the tutorial's variable-length loop, planned on 2
    CPU ranks, takes every batch input as each rank's rows (no gather), so ranks whose
    collators pad to different lengths run.  Before, the planner was indifferent and kept
    them whole (sliced later): the module gathered the local batches, which needs equal
    shapes on every rank."""
    from autopar.runtime.inputs import passthrough_inputs

    model = _tiny_llama()
    ids = torch.randint(1, 128, (4, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = autopar.plan(model, (), MeshSpec.preset("cpu-gloo", shape=(2,)), example_kwargs=batch,
                         batch="local")
    assert passthrough_inputs(p) == {"input_ids", "attention_mask", "labels"}


def _tiny_llama():
    import hf_zoo

    return hf_zoo.build("llama")[0]


def test_micro_batch_counts_divide_and_keep_the_planned_size() -> None:
    """A pipeline's other batches run as equal micro-batches: the planned count where it
    divides; else those no larger than planned, fewest first, then larger ones, smallest
    first; only counts the schedule runs (interleaved: multiples of its stages)."""
    from autopar.plans.schedules import micro_batch_counts

    assert micro_batch_counts(8, 2, "1f1b", 2) == [4, 8, 2, 1]  # 4 of 2 rows, as planned
    assert micro_batch_counts(3, 2, "1f1b", 2) == [3, 1]  # 3 of 1 row, else 1 of 3
    assert micro_batch_counts(6, 2, "gpipe", 2) == [3, 6, 2, 1]
    assert micro_batch_counts(6, 2, "interleaved-1f1b", 2, 2) == [6, 2]  # even counts only
    assert micro_batch_counts(3, 1, "interleaved-1f1b", 2, 2) == []
