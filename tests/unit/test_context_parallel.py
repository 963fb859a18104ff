"""Context parallel without process groups (issue 14): which lowering a sequence split
gets, what it costs, the ``context_parallel=`` option, the summary's CP role, and the
golden plans (a long sequence gets CP where a short one does not).  The lowerings
themselves are checked on simulated ranks (tests/unit/test_rules.py, ``sdpa_cp_*``) and
on real gloo ranks (tests/dist/test_context_parallel.py)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from autopar.cost_models import all_to_all_time, send_recv_time
from torch import nn
from torch.distributed.tensor import Shard

import autopar
from autopar import MeshSpec
from autopar.capture.annotate import annotate
from autopar.capture.trace import capture
from autopar.errors import ConfigError, PlanError
from autopar.plans.placement import R
from autopar.plans.roles import axis_roles
from autopar.search.node_prices import CostModel
from autopar.sharding.rules import OpStrategy, RuleCtx, op_strategies
from autopar.sharding.rules.attention import SDPA, CPImpl, context_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402


class _Attn(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa(heads: int, seq: int = 16, d: int = 8):
    x = torch.randn(2, heads, seq, d)
    gm = capture(_Attn(), (x, x.clone(), x.clone())).gm
    annotate(gm)
    return next(n for n in gm.graph.nodes if n.target is SDPA)


def _cp(node, mesh: tuple[int, ...]) -> OpStrategy:
    s = Shard(2)
    return next(st for st in op_strategies(node, RuleCtx(mesh))
                if st.inputs == ((s,),) * 3 and st.outputs == ((s,),))


def test_ulysses_when_heads_divide_ring_otherwise():
    assert context_layout(_sdpa(4), _cp(_sdpa(4), (2,)).inputs, (2,)).impl is CPImpl.ULYSSES
    node = _sdpa(3)
    assert context_layout(node, _cp(node, (2,)).inputs, (2,)).impl is CPImpl.RING
    # rows on one axis, the CP exchange on the other: no lowering, so never offered
    mixed = ((Shard(2), Shard(2)), (R, Shard(2)), (R, Shard(2)))
    assert context_layout(node, mixed, (2, 2)) is None
    assert all(context_layout(node, s.inputs, (2, 2)) is not None
               for s in op_strategies(node, RuleCtx((2, 2))))


def test_ulysses_price_is_four_all_to_alls_each_way():
    mesh = MeshSpec.preset("cpu-gloo", shape=(2,))
    node = _sdpa(4)
    local = 2 * 4 * 8 * 8 * 4  # [2, 4, 16/2, 8] fp32
    expected = 2 * 4 * all_to_all_time(mesh, 0, local)
    assert CostModel(mesh).attention_comm(node, _cp(node, (2,))) == pytest.approx(expected)


class _SharedKV(nn.Module):
    def forward(self, q, kv, mask):
        return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)


class _GQA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _node(module: nn.Module, *xs: torch.Tensor):
    gm = capture(module, xs).gm
    annotate(gm)
    return next(n for n in gm.graph.nodes if n.target is SDPA)


def test_shared_kv_priced_by_its_own_placement():
    # before: v's bytes were read from the mask's placement (the strategy lists kv once)
    mesh = MeshSpec.preset("cpu-gloo", shape=(2,))
    x = torch.randn(2, 4, 16, 8)
    node = _node(_SharedKV(), x, x.clone(), torch.randn(2, 4, 16, 16))
    s = next(st for st in op_strategies(node, RuleCtx((2,)))
             if st.inputs[:2] == ((Shard(2),), (Shard(2),)))
    local = 2 * 4 * 8 * 8 * 4  # q, kv and the output: [2, 4, 16/2, 8] fp32
    expected = 2 * 4 * all_to_all_time(mesh, 0, local)
    assert CostModel(mesh).attention_comm(node, s) == pytest.approx(expected)


def test_ring_relayout_priced_by_q_and_output_under_gqa():
    # 6 query heads, 3 key/value heads on 4 ranks: ring; 16/4 rows halve: zigzag.  The
    # re-layout moves q, k, v and the output (2 block-equivalents on 4 ranks); q and the
    # output are twice k's size here (before: priced as if they were k's size)
    mesh = MeshSpec.preset("cpu-gloo", shape=(4,))
    node = _node(_GQA(), torch.randn(2, 6, 16, 8), torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8))
    s = _cp(node, (4,))
    kv_block = 2 * 3 * 4 * 8 * 4
    q_block = 2 * kv_block
    expected = 2 * (3 * send_recv_time(mesh, 0, 2 * kv_block)
                    + 2 * send_recv_time(mesh, 0, (q_block + 2 * kv_block + q_block) / 2))
    assert CostModel(mesh).attention_comm(node, s) == pytest.approx(expected)


def test_causal_query_rows_pay_the_whole_score_matrix():
    # row_attention computes every block under an explicit mask: twice a fused causal
    # kernel's work, which the batch and heads splits keep
    node = _sdpa(4)
    rows = next(st for st in op_strategies(node, RuleCtx((2,)))
                if st.inputs == ((Shard(2),), (R,), (R,)))
    cm = CostModel(MeshSpec.preset("cpu-gloo", shape=(2,)))
    assert cm.attention_compute_factor(node, rows) == 2.0
    assert cm.attention_compute_factor(node, _cp(node, (2,))) == 1.0


def test_ring_price_counts_block_shifts_and_balance():
    mesh = MeshSpec.preset("cpu-gloo", shape=(4,))
    node = _sdpa(3)  # 3 heads on 4 ranks: ring; 16/4 = 4 rows each halve: zigzag
    cm = CostModel(mesh)
    s = _cp(node, (4,))
    kv = 2 * (2 * 3 * 4 * 8 * 4)
    # 3 shifts + the zigzag re-layout (2 block-equivalents on 4 ranks), again backward
    assert cm.attention_comm(node, s) == pytest.approx(2 * 5 * send_recv_time(mesh, 0, kv))
    # zigzag: every rank does the same share, priced like any even split
    assert cm.attention_compute_factor(node, s) == pytest.approx(1.0)
    odd = _sdpa(3, seq=12)  # 3 rows each: no zigzag, the last rank does (2n-1)/n of a share
    assert cm.attention_compute_factor(odd, _cp(odd, (4,))) == pytest.approx(7 / 4)


def _seq_plan(**kw):
    model, ex = gpt.build(layers=2, dim=32, heads=4, seq=16)
    pins = {"*": "R", "input:0": "S(1)", "input:1": "S(1)"}
    return autopar.plan(model, ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)), pins=pins,
                        search="ilp", **kw)


@pytest.mark.parametrize("mode,fn,says", [("exchange", "ulysses_attention", "Ulysses"),
                                           ("gather-kv", "row_attention", "query rows")])
def test_context_parallel_option_and_summary(mode, fn, says):
    plan = _seq_plan(context_parallel=mode)
    attn = [n for n in plan.nodes.values() if n.op == "scaled_dot_product_attention"]
    assert attn and all(n.in_placements[0] == "S(2)" for n in attn)
    want_k = "S(2)" if mode == "exchange" else "R"
    assert all(n.in_placements[1] == want_k for n in attn)
    assert axis_roles(plan)[0].kind.endswith("CP"), axis_roles(plan)
    assert "CP2" in str(plan)
    # explain names the lowering; Ulysses's all-to-alls are its own exchanges, priced
    text = plan.explain(attn[0].name)
    assert f"runs as: {'context parallel over a0 (2), ' if mode == 'exchange' else ''}{says}" \
        in text, text
    assert (attn[0].own_comm > 0) == (mode == "exchange"), attn[0].own_comm
    assert ("its own exchanges" in text) == (mode == "exchange")
    assert type(plan).from_json(plan.to_json()).nodes[attn[0].name].lowering == attn[0].lowering
    off = _seq_plan(context_parallel="off")
    assert all(n.in_placements[0] != "S(2)" for n in off.nodes.values()
               if n.op == "scaled_dot_product_attention")


def test_context_parallel_option_errors():
    model, ex = gpt.build(layers=1, dim=32, heads=4, seq=16)
    mesh = MeshSpec.preset("cpu-gloo", shape=(2,))
    with pytest.raises(ConfigError, match="context_parallel must be one of"):
        autopar.plan(model, ex, mesh=mesh, context_parallel="ring-ish")
    with pytest.raises(PlanError, match="use search='ilp'"):
        autopar.plan(model, ex, mesh=mesh, search="drec", context_parallel="exchange")


def _llama_8b_shape_plan(seq: int, batch: int):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=2, num_attention_heads=32,
                                   num_key_value_heads=8, max_position_embeddings=seq)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mask's and rotary ops' replicated fallbacks
        return autopar.plan(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                            mesh=MeshSpec.preset("8xH100-nvlink"), precision="bf16-mixed")


@pytest.mark.slow
def test_golden_llama_8b_long_sequence_gets_context_parallel():
    """Llama-3 8B's layer shape (GQA, HF's materialised causal mask) on 8 H100: at
    131,072 tokens attention runs on sequence chunks (the mask, 16 GiB whole, is split
    by rows with the queries); at 4,096 tokens it splits the heads instead."""
    long = _llama_8b_shape_plan(131072, 1)
    assert "CP" in axis_roles(long)[0].kind, str(long)
    short = _llama_8b_shape_plan(4096, 1)
    assert "CP" not in axis_roles(short)[0].kind, str(short)
