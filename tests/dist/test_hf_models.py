"""Hugging Face models passed as they are (no wrapper), called as ``model(**batch)``, on
real gloo ranks (Llama with GQA, Mistral with a sliding window, Qwen2, Mixtral, BERT, T5,
ViT, GPT-2 from tiny configs in examples/hf_zoo.py), in a loop with ``clip_grad_norm_(max_norm=0.1)`` and two AdamW steps
(tests/dist/hf_case.py): the planner's choice, forced tensor parallelism, ZeRO-3 and a
2-stage pipeline where the model allows one (tied input/output embeddings rule it out
for BERT, T5 and GPT-2); Llama also under interleaved 1F1B and zero-bubble.

Fails on the main before the issue "Real models, real training loops": every case
(Llama and Mixtral: KeyError on the non-persistent ``rotary_emb.inv_freq``; BERT on
``position_ids``; all: ``micro-batching needs a tensor input`` for kwargs-only models,
and ``clip_grad_norm_`` returned a different norm per rank under tensor parallelism).

Tolerances (fp32, the parallel module sums the same products in another order): loss
rtol 1e-5; gradients 2e-5 + 1e-4 x the largest gradient; the clipped norm rtol 1e-5
(the same sums of squares); parameters after two clipped AdamW steps (lr 1e-3) 3e-5:
clipping to 0.1 makes the updates lr * m / sqrt(v) with v ~ 1e-6, where reordered sums
perturb m / sqrt(v) most (observed up to 1.4e-5 under TP).
"""

from __future__ import annotations

import pytest

from tests.dist import test_mixed_precision as bf16
from tests.dist.harness import run_fn_cases

FN = "tests.dist.hf_case:run_hf_case"
ALLOWED_PP = {"llama", "mixtral", "vit"}  # no weights tied across the model's ends


def _cases(models, modes, mesh) -> list[dict]:
    return [{"id": f"{m}-{mode}-{'x'.join(map(str, mesh))}", "model": m, "mode": mode, "mesh": list(mesh)}
            for m in models for mode in modes if not mode.startswith("pp2") or m in ALLOWED_PP]


# the default suite keeps two Llama cases; the rest run in CI's slow step
DEFAULT = _cases(["llama"], ["auto", "tp"], (2,))
SLOW2 = _cases(["llama"], ["zero3", "pp2"], (2,)) + _cases(["bert"], ["tp"], (2,)) \
    + _cases(["mixtral", "t5", "vit", "gpt2"], ["auto", "tp", "zero3", "pp2"], (2,)) \
    + _cases(["bert"], ["auto", "zero3"], (2,)) + _cases(["mistral", "qwen2"], ["tp"], (2,)) \
    + _cases(["llama"], ["zero2", "pp2-interleaved", "pp2-zero-bubble"], (2,))
# left out at stop 54 as duplicates: Mistral's and Qwen2's planner's choice (Llama's
# layers, which llama-auto-2 covers; their tensor parallel cases stay for Qwen2's biases
# and Mistral's own attention) and Llama's ZeRO-1 (ZeRO-2 runs its optimizer-state
# sharding too; tests/dist/test_parallelism_kinds.py runs ZeRO-1 itself)
# data x tensor parallel on 2x2: a decoder (Llama: GQA, rotary tables) and the
# encoder-decoder (T5).  Mixtral, BERT, ViT and GPT-2 ran it too until stop 54: what 2x2
# adds to their 2-rank tensor parallel cases (the batch split and the gradient sync on
# the other axis) does not depend on the model, and Mixtral's experts on 2x2 are
# tests/dist/test_mixtral_ep.py's.  Llama's ZeRO-3 over 4 ranks and 2 stages of 2 ranks
# run in bf16-mixed (bf16.FOUR, below): native precision ran them too until stop 54, the
# same layouts without the casts, which its 2-rank ZeRO-3 and pipeline cases cover
SLOW4 = _cases(["llama", "t5"], ["tp"], (2, 2))


def check(r: dict) -> None:
    """The tolerances of the module docstring."""
    assert "error" not in r, r.get("error")
    assert r["out_type"] == r["ref_type"]
    for loss in r["losses"]:  # every rank returns the single-process loss
        assert loss == pytest.approx(r["ref_loss"], rel=1e-5)
    assert r["grad_err"] <= 2e-5 + 1e-4 * r["grad_scale"], (r["grad_worst"], r["grad_err"])
    assert r["ref_norm"] > 0.1  # clipping is active
    for n in r["norms"]:  # every rank clips by the global norm
        assert n == pytest.approx(r["ref_norm"], rel=1e-5)
    assert r["adam_err"] <= 3e-5, (r["adam_worst"], r["adam_err"])
    assert r["keys_match"]
    if r["mode"] == "pp2-interleaved":  # the forced schedule ran
        assert (r["schedule"], r["virtual_stages"]) == ("interleaved-1f1b", 2)
    if r["mode"] == "pp2-zero-bubble":
        assert (r["schedule"], r["virtual_stages"]) == ("zero-bubble", 1)
    if r["stages"] == 1:  # a pipeline stage holds only its own parameters
        # before: the user's full-size copy of a tied weight stayed in pm.parameters()
        assert r["n_params"] == r["ref_n_params"]


@pytest.fixture(scope="module")
def default_results():
    # the bf16-mixed default case (tests/dist/test_mixed_precision.py) rides on this
    # process group: one group start less in the default suite
    return run_fn_cases(2, FN, DEFAULT + bf16.DEFAULT)


@pytest.mark.parametrize("case", [c["id"] for c in DEFAULT])
def test_hf_two_ranks(default_results, case):
    check(default_results[case])


def test_bf16_mixed_two_ranks(default_results):
    for c in bf16.DEFAULT:
        bf16.check(default_results[c["id"]])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c["id"] for c in SLOW2])
def test_hf_two_ranks_more(case, slow2_results):
    check(slow2_results[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c["id"] for c in SLOW4])
def test_hf_four_ranks(case, slow4_results):
    check(slow4_results[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c["id"] for c in bf16.SLOW])
def test_bf16_mixed_two_ranks_more(case, slow2_results):
    """tests/dist/test_mixed_precision.py's slow 2-rank cases, in this module's group."""
    bf16.check(slow2_results[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c["id"] for c in bf16.FOUR])
def test_bf16_mixed_four_ranks(slow4_results, case):
    """tests/dist/test_mixed_precision.py's 4-rank cases, in this module's group."""
    r = slow4_results[case]
    bf16.check(r)
    # the plan is the kind the case names
    assert r["decisions"] == (3 if "-zero3-" in case else 0)
    assert r["stages"] == (2 if "-pp2-" in case else 1)
    if "-tp-" in case:
        assert any("S(" in pl for pl in r["params"].values()), r["params"]


@pytest.fixture(scope="module")
def slow2_results():
    return run_fn_cases(2, FN, SLOW2 + bf16.SLOW)


@pytest.fixture(scope="module")
def slow4_results():
    return run_fn_cases(4, FN, SLOW4 + bf16.FOUR)
