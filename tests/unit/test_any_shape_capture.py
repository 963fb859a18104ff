"""One symbolic export stands for an export at every length (autopar/capture/any_shape.py):
the graph it gives at a length is the one `capture` gives there (same ops on the same
inputs, same numbers, same node names), and it computes the model's output."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture.any_shape import capture_any_shape
from autopar.capture.graph_numbers import numbers, signature
from autopar.capture.trace import capture


def _llama() -> nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))


def _gpt2() -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=128, bos_token_id=0, eos_token_id=0))


def _mixtral() -> nn.Module:
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4))


def _batch(rows: int, length: int, padded: bool, seed: int) -> dict[str, torch.Tensor]:
    """Token ids and labels (a padding mask, the last rows shorter, when ``padded``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (rows, length), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[1:, length - length // 3:] = 0
        out["attention_mask"] = mask
        out["labels"] = ids.masked_fill(mask == 0, -100)
    return out


def _val(n) -> object:
    """A node's value as planning reads it: shape, strides, dtype, grad."""
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        return tuple(_val_of(x) for x in v)
    return _val_of(v)


def _val_of(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.stride(), v.dtype, v.requires_grad
    return v if isinstance(v, (int, float, bool)) or v is None else type(v).__name__


def _flat_shapes(kw: dict) -> list:
    return [tuple(x.shape) for x in pytree.tree_leaves(((), kw))]


@pytest.mark.parametrize("make", [_llama, _gpt2, _mixtral], ids=["llama", "gpt2", "mixtral"])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padding-mask"])
def test_symbolic_graph_is_the_export_at_every_length(make, padded):
    torch.manual_seed(0)
    model = make().eval()
    planned = _flat_shapes(_batch(2, 16, padded, 0))
    second = _batch(2, 24, padded, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base, sym = capture_any_shape(model, (), second, "native", planned)
        assert sym is not None, "the symbolic export did not reproduce the export at 24"
        mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        for k, length in enumerate((5, 40)):
            kw = _batch(2, length, padded, 10 + k)
            got, ref = sym.at((), kw, mode), capture(model, (), kw)
            assert got is not None, length
            assert signature(got.gm) == signature(ref.gm), length
            assert numbers(got.gm) == numbers(ref.gm), length  # the lengths' numbers
            assert [n.name for n in got.gm.graph.nodes] == [n.name for n in ref.gm.graph.nodes]
            assert [_val(n) for n in got.gm.graph.nodes] == [_val(n) for n in ref.gm.graph.nodes]
            with torch.no_grad():
                want = model(**kw).loss
                out = pytree.tree_unflatten(got.gm(*pytree.tree_leaves(((), kw))), got.out_spec)
            # the same ops on the same inputs in the same order: bitwise equal
            assert torch.equal(out["loss"], want), length


def test_a_dim_the_symbolic_graph_fixes_is_exported():
    """Symbolic in the length only: another batch size is not given (None: export it)."""
    model = _llama().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, sym = capture_any_shape(model, (), _batch(2, 24, True, 1), "native",
                                   _flat_shapes(_batch(2, 16, True, 0)))
        mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        assert sym.at((), _batch(2, 12, True, 2), mode) is not None
        assert sym.at((), _batch(3, 12, True, 2), mode) is None
        assert sym.at((), _batch(2, 1, True, 2), mode) is None  # export's range starts at 2
