"""autopar/sharding/strategies.py: nodes with one signature share one enumeration.

The 32 layers of a Llama repeat the same ops on the same shapes; enumerating each
node's strategies took 4.2 s of a 26 s Llama-3 8B plan on 64 devices.  The cache must
never change what a node gets: checked against enumerating every node alone, on real
Hugging Face graphs and on the attention forms whose inputs alias.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture.annotate import annotate
from autopar.capture.grad_regions import KEEP_REPLICATED
from autopar.capture.trace import capture
from autopar.sharding.rules import RuleCtx, op_strategies
from autopar.sharding.strategies import enumerate_strategies, signature

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_zoo  # noqa: E402


def _graph(model: nn.Module, args: tuple = (), kwargs: dict | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = capture(model, args, kwargs).gm
    annotate(gm)
    return gm


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_shared_enumeration_equals_each_node_alone(name: str) -> None:
    model, batch = hf_zoo.build(name)
    gm = _graph(model, (), batch)
    for mesh in [(2,), (2, 2)]:
        got = enumerate_strategies(gm, mesh)
        ctx = RuleCtx(mesh)
        ops = [n for n in got if n.op == "call_function" and n.target.__name__ != "getitem"
               and not n.meta.get(KEEP_REPLICATED)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert all(got[n] == op_strategies(n, ctx) for n in ops)
        # the repeated layers really do share (else the cache would save nothing)
        assert len({signature(n) for n in ops}) < 0.6 * len(ops)
        # each node owns its list (pins and options narrow them node by node)
        assert len({id(got[n]) for n in ops}) == len(ops)


class _Attn(nn.Module):
    def forward(self, q, k, v):
        return (F.scaled_dot_product_attention(q, q, q, is_causal=True),
                F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_which_arguments_alias_is_part_of_the_key() -> None:
    x = torch.randn(1, 4, 8, 4)
    gm = _graph(_Attn(), (x, x.clone(), x.clone()))
    same, distinct = [n for n in gm.graph.nodes if "scaled_dot" in str(n.target)]
    assert signature(same) != signature(distinct)
    got = enumerate_strategies(gm, (2,))
    assert got[same] == op_strategies(same, RuleCtx((2,)))
    assert got[distinct] == op_strategies(distinct, RuleCtx((2,)))
    assert len(got[same][0].inputs) == 1 and len(got[distinct][0].inputs) == 3
