"""autopar/capture/causal_mask.py: masks built from shapes alone become SDPA's own forms.

A Hugging Face decoder's captured graph used to hand SDPA a ``batch x 1 x seq x seq``
boolean mask (ruling out the fused causal kernels a GPU has) where the eager model calls
SDPA with ``is_causal=True``.  After capture, a mask that is exactly causal is
``is_causal=True``, one that blocks nothing is dropped, and every other mask (padding
from the user's ``attention_mask``, a sliding window, a buffer's values) stays; the
captured graph still computes what the model computes.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture.batch import capture_any_batch
from autopar.capture.causal_mask import SDPA
from autopar.capture.trace import capture

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_zoo  # noqa: E402

# the folded graph runs SDPA's causal path where the model ran the same scores through
# an explicit mask (or, in eager HF, the same causal path): the same sums in another
# order at most, a few float32 ulps on logits of size ~1
TOL = dict(atol=1e-5, rtol=1e-5)


def _sdpa(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _has_mask(n: torch.fx.Node) -> bool:
    return len(n.args) > 3 or "attn_mask" in n.kwargs


def _capture(model: nn.Module, args: tuple = (), kwargs: dict | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, args, kwargs or {})


def _run(cap, args: tuple = (), kwargs: dict | None = None) -> list[torch.Tensor]:
    return pytree.tree_leaves(cap.gm(*pytree.tree_leaves((args, kwargs or {}))))


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "mixtral"])
def test_hf_decoder_mask_becomes_is_causal(name):
    model, batch = hf_zoo.build(name)
    model.eval()
    cap = _capture(model, (), batch)
    calls = _sdpa(cap.gm)
    assert calls and all(n.kwargs.get("is_causal") and not _has_mask(n) for n in calls)
    # the mask's ops went with it: no full-size boolean tensor is built any more
    assert not any(n.op == "call_function" and n.target is torch.ops.aten.cumsum.default
                   for n in cap.gm.graph.nodes)
    got = _run(cap, (), batch)
    want = model(**batch)
    torch.testing.assert_close(got[0], want.loss, **TOL)
    torch.testing.assert_close(got[1], want.logits, **TOL)


def test_symbolic_batch_capture_folds_too():
    model, batch = hf_zoo.build("llama")
    ab = capture_any_batch(model, ((), batch), "native")
    assert ab is not None
    calls = _sdpa(ab.base.gm)
    assert calls and all(n.kwargs.get("is_causal") and not _has_mask(n) for n in calls)
    size = ab.at(3)
    assert size is not None and all(n.kwargs.get("is_causal") for n in _sdpa(size.gm))


def test_padding_and_sliding_window_masks_stay():
    model, batch = hf_zoo.build("llama")
    model.eval()
    pad = torch.ones_like(batch["input_ids"])
    pad[:, -3:] = 0  # right padding: not causal alone
    kw = {**batch, "attention_mask": pad}
    cap = _capture(model, (), kw)
    assert all(_has_mask(n) for n in _sdpa(cap.gm))
    torch.testing.assert_close(_run(cap, (), kw)[1], model(**kw).logits, **TOL)
    # Mistral's window (8) is shorter than the sequence (16): a band, not causal
    model, batch = hf_zoo.build("mistral")
    cap = _capture(model.eval(), (), batch)
    assert all(_has_mask(n) for n in _sdpa(cap.gm))


class Attn(nn.Module):
    """One attention whose mask comes from ``make(seq)``, computed in ``forward``."""

    def __init__(self, make, from_buffer: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.make = make
        if from_buffer:
            self.register_buffer("mask", make(6))
        self.from_buffer = from_buffer

    def forward(self, x):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = self.mask if self.from_buffer else self.make(x.shape[1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _causal_bool(s):
    return torch.ones(s, s, dtype=torch.bool).tril()


def _causal_add(s):
    return torch.zeros(s, s).masked_fill(~_causal_bool(s), -math.inf)


def _causal_min(s):
    return torch.zeros(s, s).masked_fill(~_causal_bool(s), torch.finfo(torch.float32).min)


def _everything(s):
    return torch.ones(s, s, dtype=torch.bool)


def _band(s):
    return _causal_bool(s) & torch.ones(s, s, dtype=torch.bool).triu(-2)


def _bias(s):
    return torch.arange(s).float().view(1, s) * 0.1  # a bias, not a mask


@pytest.mark.parametrize("make,mask,causal", [
    (_causal_bool, False, True), (_causal_add, False, True), (_causal_min, False, True),
    (_everything, False, False), (_band, True, False), (_bias, True, False),
])
def test_mask_forms(make, mask, causal):
    torch.manual_seed(0)
    model = Attn(make)
    x = torch.randn(2, 6, 8)
    cap = _capture(model, (x,))
    (n,) = _sdpa(cap.gm)
    assert _has_mask(n) == mask
    assert bool(n.kwargs.get("is_causal", False)) == causal
    torch.testing.assert_close(_run(cap, (x,))[0], model(x), **TOL)


def test_a_buffer_mask_is_read_each_call():
    # a causal mask held in a buffer is the model's state: a user may change it
    torch.manual_seed(0)
    model = Attn(_causal_bool, from_buffer=True)
    cap = _capture(model, (torch.randn(2, 6, 8),))
    (n,) = _sdpa(cap.gm)
    assert _has_mask(n) and not n.kwargs.get("is_causal", False)


def test_a_large_batch_is_checked_at_batches_of_two_and_three(monkeypatch):
    # the global batch of many data-parallel ranks makes the mask too large to build at
    # capture; it is built at batches of 2 and 3 instead (here: 4 x 16 x 16 = 1,024
    # elements against a limit of 800, 3 x 16 x 16 = 768 under it)
    import autopar.capture.causal_mask as cm

    monkeypatch.setattr(cm, "MAX_ELEMENTS", 800)
    model, batch = hf_zoo.build("llama")
    model.eval()
    cap = _capture(model, (), batch)
    calls = _sdpa(cap.gm)
    assert calls and all(n.kwargs.get("is_causal") and not _has_mask(n) for n in calls)
    torch.testing.assert_close(_run(cap, (), batch)[1], model(**batch).logits, **TOL)
    ab = capture_any_batch(model, ((), batch), "native")
    assert all(n.kwargs.get("is_causal") for n in _sdpa(ab.base.gm))
    # a padding mask is still kept: it reads the input
    kw = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    assert all(_has_mask(n) for n in _sdpa(_capture(model, (), kw).gm))
    # under the limit of 3 rows too: kept as a tensor, with a word in the log
    monkeypatch.setattr(cm, "MAX_ELEMENTS", 700)
    assert all(_has_mask(n) for n in _sdpa(_capture(model, (), batch).gm))
