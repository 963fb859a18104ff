"""``pack=True``'s packing (autopar/runtime/packing.py) on a tiny Hugging Face Llama in
one process: a right-padded batch packed into a few rows gives the padded batch's loss,
its logits at every real token and their gradients; what packing would not run exactly
is refused.  The multi-rank runs are in tests/dist/test_any_shape.py (``*-autopack``).

Tolerances: fp32 sums over the same tokens in another order (rows of other widths) give
losses within rel 1e-6 and logits within 1e-5 (O(1) values)."""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.errors import ConfigError
from autopar.runtime.inputs import InputMismatchError
from autopar.runtime.packing import _deal, check_model, pack

VOCAB = 128


@pytest.fixture(scope="module")
def llama():
    import transformers as tf
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False)
    return tf.LlamaForCausalLM(cfg)


def padded(lengths: list[int], seed: int = 0) -> dict:
    """Right-padded rows (pad id 0, labels -100 at padding), as DataCollatorWithPadding."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    mask = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(lengths), n), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_packed_batch_is_the_padded_one(llama, rows):
    batch = padded([5, 12, 3, 9, 7, 1])
    real = batch["attention_mask"].bool()
    ref = llama(**batch)
    kwargs, packed = pack(batch, rows)
    assert "attention_mask" not in kwargs and kwargs["input_ids"].shape[0] == min(rows, 6)
    # the padding is gone: the rows hold the 37 real tokens and at most one sequence's slack
    assert kwargs["input_ids"].numel() < 37 + 12 * kwargs["input_ids"].shape[0]
    out = llama(**kwargs)
    back = packed.unpack(out)
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-6 * ref.loss.item()
    assert back.logits.shape == ref.logits.shape
    assert float((back.logits - ref.logits)[real].abs().max()) < 1e-5
    assert float(back.logits[~real].abs().max()) == 0.0


def test_gradients_through_unpacked_logits(llama):
    """A loss the user writes outside the model from the unpacked logits trains the same."""
    batch = padded([6, 2, 9])
    mine = copy.deepcopy(llama)
    kwargs, packed = pack({k: v for k, v in batch.items() if k != "labels"}, 2)
    real = batch["attention_mask"].bool()
    ce = torch.nn.functional.cross_entropy
    ce(packed.unpack(mine(**kwargs)).logits[real], batch["input_ids"][real]).backward()
    ce(llama(**batch).logits[real], batch["input_ids"][real]).backward()
    gap = max(float((a.grad - b.grad).abs().max()) for a, b in zip(mine.parameters(), llama.parameters()))
    llama.zero_grad()
    assert gap < 1e-5


def test_labels_restart_at_each_sequence():
    """Each sequence's first label is -100 in the pack: no sequence's last token is
    trained to predict the next one's first."""
    kwargs, _ = pack(padded([3, 2]), 1)
    assert kwargs["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert kwargs["labels"][0, 0] == -100 and kwargs["labels"][0, 3] == -100
    assert (kwargs["labels"][0, [1, 2, 4]] != -100).all()


def test_rows_are_balanced_and_deterministic():
    lengths = [50, 3, 40, 7, 22, 22, 9, 1, 0, 30]
    rows, width = _deal(lengths, 4)
    loads = [sum(lengths[i] for i in r) for r in rows]
    assert width == max(loads) and max(loads) - min(loads) <= max(lengths)
    assert sorted(i for r in rows for i in r) == [i for i, k in enumerate(lengths) if k]
    assert _deal(lengths, 4) == (rows, width)


@pytest.mark.parametrize("bad, words", [
    ("left", "right-padded"), ("labels", "labels of -100"), ("positions", "position_ids"),
    ("empty", "no real token")])
def test_what_packing_would_change_is_refused(bad, words):
    batch = padded([4, 2])
    if bad == "left":
        batch["attention_mask"] = batch["attention_mask"].flip(1)
    elif bad == "labels":
        batch["labels"] = batch["input_ids"]  # the pad id as a label: the padded loss counts it
    elif bad == "positions":
        batch["position_ids"] = torch.arange(4).expand(2, 4)
    else:
        batch["attention_mask"] = torch.zeros_like(batch["attention_mask"])
    with pytest.raises(InputMismatchError, match=words):
        pack(batch, 2)


class Leaky(torch.nn.Module):
    """A model that reads no ``position_ids``: its packed sequences see each other."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids=None, labels=None, use_cache=None):
        return self.inner(input_ids=input_ids, labels=labels, use_cache=False)


def test_a_model_whose_packs_leak_is_refused(llama):
    kwargs = pack(padded([8, 8]), 1)[0]
    check_model(llama, kwargs)  # a Hugging Face Llama keeps them apart
    assert llama.training
    with pytest.raises(ConfigError, match="see each other"):
        check_model(Leaky(llama), kwargs)
    assert llama.training  # the check's eval mode is undone


def test_plan_is_priced_packed(llama):
    """``plan(..., pack=True)`` captures the packed example: 4 sequences of 16, 8, 5 and
    11 tokens (64 padded) on 2 devices are rows of 16 + 5 and 11 + 8 tokens, and the plan
    records the decision."""
    import autopar
    from autopar import MeshSpec

    p = autopar.plan(llama, example_kwargs=padded([16, 8, 5, 11]), pack=True,
                     mesh=MeshSpec.preset("cpu-gloo", shape=(2,)))
    assert p.decisions.pack and p.decisions.global_batch == 2
    assert "priced at batch 2 x seq 21 (42 tokens)" in p.explain("shapes"), p.explain("shapes")
    assert "pack=True" in p.explain("shapes")


def test_copies_are_refused_with_pack(llama):
    """Copies run the planned shape only; a packed call's width is its own."""
    import autopar
    from autopar import MeshSpec

    with pytest.raises(ConfigError, match="plan without copies"):
        autopar.plan(llama, example_kwargs=padded([16, 8]), pack=True, copies=2,
                     mesh=MeshSpec.preset("cpu-gloo", shape=(2,)))
