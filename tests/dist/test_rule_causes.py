"""Two op rules that trained silently wrong on e.g. 49853ca (issue 64), on 2 gloo ranks
against the single-process model.

Before: ``cross_entropy`` with probability targets under data-parallel pins divided each
rank's sum by N x C (loss 0.27 for 2.17); the vocabulary-parallel embedding gave its
padding row a gradient (nn.Embedding's ``padding_idx`` keeps it zero).

Tolerances: the loss and gradients are the single process's up to the order of sums
over at most 48 float32 terms (rel 1e-5, abs 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_fn_cases

FN = "tests.dist.rule_cases:run"
CASES = [
    {"id": "soft-dp", "fn": "soft_targets", "pins": {"*": "R", "input:0": "S(0)", "input:1": "S(0)"}},
    {"id": "pad-vocab", "fn": "padded_embedding",
     "pins": {"*": "R", "emb.weight": "S(0)", "embedding": "P"}},  # vocab-parallel
]


@pytest.fixture(scope="module")
def two():
    return run_fn_cases(2, FN, CASES)


@pytest.mark.parametrize("case", ["soft-dp", "pad-vocab"])
def test_loss_and_grads_match_single_process(two, case):
    r = two[case]
    assert "error" not in r, r.get("error")
    assert r["loss"] == pytest.approx(r["ref"], rel=1e-5)
    for name, ref in r["ref_grads"].items():
        torch.testing.assert_close(torch.tensor(r["grads"][name]), torch.tensor(ref),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_padding_row_takes_no_gradient(two):
    r = two["pad-vocab"]
    assert "error" not in r, r.get("error")
    assert torch.tensor(r["grads"]["emb.weight"])[0].abs().max().item() == 0.0
    assert torch.tensor(r["grads"]["emb.weight"]).abs().max().item() > 0.0
