"""``batch="local"``: batch-shaped outputs are returned as each data-parallel rank's rows,
and the plan prices that instead of gathering them (the runtime side is in
tests/dist/test_training_loop.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar import MeshSpec
from autopar.plans.placement import R, returned_placement


def test_returned_placement_keeps_only_the_batch_split():
    s0, s1 = Shard(0), Shard(1)
    assert returned_placement((s0, s1), (8, 16), 8) == (s0, R)  # vocab-split gathered
    assert returned_placement((s0, s1), (8, 16), None) == (R, R)  # batch="global"
    assert returned_placement((s0, s0), (), 8) == (R, R)  # the scalar loss
    assert returned_placement((s0,), (4, 16), 8) == (R,)  # dim 0 is not the batch


def _llama_plans(search: str):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.zeros(64, 512, dtype=torch.long, device="meta")
    mesh = MeshSpec.preset("multinode-h100-ib", shape=(2, 8))
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in ("global", "local"):
            out[batch] = autopar.plan(model, (), mesh, example_kwargs={"input_ids": ids, "labels": ids},
                                      batch=batch, search=search, precision="bf16-mixed")
    return out


# the ILP prices 2x8 strategies in Python (~10 s for both plans): the slow CI step
@pytest.mark.parametrize("search", [pytest.param("ilp", marks=pytest.mark.slow), "drec"])
def test_local_batch_does_not_pay_for_gathering_the_logits(search):
    """Before: outputs were priced (and returned) replicated, so the planner
    either gathered 64 x 512 x 32,000 logits to every device (on 2x8 H100) or computed the LM head
    unsharded on the data-parallel axes."""
    p = _llama_plans(search)
    g, loc = p["global"].decisions, p["local"].decisions
    assert g.batch == "global" and g.local_axes is None
    assert loc.batch == "local" and loc.local_axes  # rows split over some axes
    assert loc.step_seconds < g.step_seconds / 2
    assert "batch          local" in str(p["local"]) and "batch    " not in str(p["global"])
    again = autopar.Plan.from_json(p["local"].to_json())
    assert again.decisions.local_axes == loc.local_axes


def test_a_plan_for_another_batch_mode_is_refused():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import mlp

    model, ex = mlp.build()
    p = autopar.plan(model, ex, (2,))
    with pytest.raises(autopar.errors.ConfigError, match="made for batch='global'"):
        autopar.auto_parallel(model, example_inputs=ex, plan=p, batch="local")
    with pytest.raises(autopar.errors.ConfigError, match="batch must be"):
        autopar.plan(model, ex, (2,), batch="rows")
    # before: the decorator ignored batch="local" and planned one rank's part as the
    # global batch, each rank then training on different samples as if they were one
    with pytest.raises(autopar.errors.ConfigError, match="needs the global batch"):
        autopar.auto_parallel(mesh=(2,), batch="local")
    with pytest.raises(autopar.errors.ConfigError, match="needs the global batch"):
        autopar.auto_parallel(type(model), mesh=(2,), batch="local")
