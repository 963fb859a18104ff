"""autopar/capture/side_views.py: a layer's views of shared inputs are copied per user.

Hugging Face Llama takes ``cos.unsqueeze(1)`` once per layer and feeds it to both the
query and the key rotation; after capture each of those users has its own copy, and the
captured graph still computes exactly what the model computes.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as pytree

from autopar.capture.layers import layers
from autopar.capture.side_views import VIEW_OPS, duplicate_side_views
from autopar.capture.trace import capture


def _tiny_llama():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32)
    return tf.LlamaForCausalLM(cfg).eval()


def _shared_views(gm) -> list[str]:
    """View nodes inside a repeated layer, fed from outside it, with several users."""
    out = []
    for lay in layers(gm):
        if not lay.repeated:
            continue
        inside = set(lay.nodes)
        out += [n.name for n in lay.nodes
                if n.op == "call_function" and n.target in VIEW_OPS and len(n.users) > 1
                and all(u not in inside for u in n.all_input_nodes)]
    return out


def _captured():
    """(model, input ids, its capture) of the tiny Llama, fallback warnings silenced."""
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, ids, capture(model, (), {"input_ids": ids})


def test_llama_rotary_views_are_copied_and_numbers_unchanged():
    model, ids, cap = _captured()
    assert _shared_views(cap.gm) == []
    names = {n.name for n in cap.gm.graph.nodes}
    # the copies exist: cos and sin views, one more per layer each (query and key users)
    assert sum(1 for n in names if n.startswith("unsqueeze")) >= 2 * 2 * 2
    flat = pytree.tree_leaves(((), {"input_ids": ids}))
    got = pytree.tree_leaves(cap.gm(*flat))
    want = model(input_ids=ids).logits
    # the same ops on the same numbers in the same order: bit-identical
    assert torch.equal(got[0], want)


def test_pass_is_idempotent_and_leaves_plain_models_alone():
    _, _, cap = _captured()
    assert duplicate_side_views(cap.gm) == 0  # capture already ran it
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    before = capture(mlp, (torch.randn(3, 4),))
    assert duplicate_side_views(before.gm) == 0
