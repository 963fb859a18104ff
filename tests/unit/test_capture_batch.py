"""One symbolic-batch capture stands for an export at every micro-batch size
(autopar/capture/batch.py): the joint search prices its shallow estimates on it."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from torch import nn

from autopar import MeshSpec
from autopar.capture.annotate import annotate
from autopar.capture.batch import capture_any_batch
from autopar.capture.trace import capture
from autopar.plans.decisions import PlanOptions
from autopar.search.op_placement import make_plan
from autopar.search.stages.layer_stats import layer_stats

MESH = MeshSpec.preset("multinode-h100-ib", shape=(2, 4))


def _llama() -> nn.Module:  # GQA: 8 query heads over 2 key/value heads
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2))


def _mixtral() -> nn.Module:
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=4))


def _gpt2() -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=4096, n_embd=512, n_layer=2, n_head=8,
                                            n_positions=128, bos_token_id=0, eos_token_id=0))


def _priced(cap, precision: str) -> list[tuple]:
    """What the joint search reads from a capture: each layer's time, compute, activation
    and parameter bytes under the plan the ILP chooses for it."""
    annotate(cap.gm)
    plan = make_plan(cap.gm, MESH, cap.aliases, PlanOptions(precision=precision))
    return [(s.key, s.seconds, s.compute, s.activations, s.out_bytes,
             sum(p.bytes for p in s.params)) for s in layer_stats(cap.gm, plan)]


# Llama (GQA, shared rotary tables and mask) in the default suite; MoE and GPT-2 in the
# slow step (8 s together)
@pytest.mark.parametrize("make", [
    pytest.param(_llama, id="llama"),
    pytest.param(_mixtral, id="mixtral", marks=pytest.mark.slow),
    pytest.param(_gpt2, id="gpt2", marks=pytest.mark.slow)])
def test_a_size_of_the_symbolic_capture_prices_like_an_export_at_that_size(make):
    warnings.simplefilter("ignore")
    with torch.device("meta"):
        model = make()
    ids = torch.zeros(8, 64, dtype=torch.long, device="meta")
    gen = capture_any_batch(model, ((), {"input_ids": ids, "labels": ids}), "bf16-mixed")
    assert gen is not None
    for size in (8, 2, 6):  # the traced size, the smallest, one that divides nothing traced
        at = gen.at(size)
        ref = capture(model, (), {"input_ids": ids[:size], "labels": ids[:size]},
                      precision="bf16-mixed")
        ins = [n.meta["val"].shape for n in at.gm.graph.nodes if n.op == "placeholder"]
        assert ins == [n.meta["val"].shape for n in ref.gm.graph.nodes if n.op == "placeholder"]
        assert ins[0][0] == size
        # exact equality: the copy's extra nodes are no-op slices export drops at a fixed size
        assert _priced(at, "bf16-mixed") == _priced(ref, "bf16-mixed")


def test_one_tensor_passed_twice_stays_two_inputs():
    # the benchmarks pass input_ids as labels: one fake tensor would feed both reads
    warnings.simplefilter("ignore")
    with torch.device("meta"):
        model = _gpt2()
    ids = torch.zeros(4, 32, dtype=torch.long, device="meta")
    at = capture_any_batch(model, ((), {"input_ids": ids, "labels": ids}), "native").at(4)
    used = [n.name for n in at.gm.graph.nodes if n.op == "placeholder" and n.users]
    assert used == ["input_ids", "labels"]


class _BranchesOnBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) * 2 if x.shape[0] > 4 else self.lin(x)


def test_a_model_that_fixes_its_batch_is_exported_per_size():
    warnings.simplefilter("ignore")
    x = torch.randn(8, 16)
    assert capture_any_batch(_BranchesOnBatch(), ((x,), {}), "native") is None


def test_size_one_is_exported_not_derived():
    # export specializes sizes 0 and 1, so the symbolic graph cannot stand for them
    warnings.simplefilter("ignore")
    lin = nn.Linear(16, 16)
    gen = capture_any_batch(lin, ((torch.randn(8, 16),), {}), "native")
    assert gen is not None and gen.at(1) is None and gen.at(3) is not None
