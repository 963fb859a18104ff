"""``pm.generate`` (issue 65): Hugging Face's ``generate`` of the model passed to
``auto_parallel`` with the trained weights, on 2 gloo ranks against the single process,
under data-parallel, tensor-parallel (pins), ZeRO-3 and 2-stage pipeline plans.

Before: ``pm.generate`` was an ``AttributeError`` ('ParallelModule' object has no
attribute 'generate') and ``model.generate`` decodes with the weights from before
``auto_parallel``.  Now every rank returns the single process's tokens.

Tolerance: none, the tokens are compared exactly.  Greedy decoding takes an argmax per
step; the trained weights differ from the single process's by reordered sums only
(~1e-7 relative after three AdamW steps at lr 1e-3, test_hf_models.py bounds them by
3e-5), far inside the gap between the two largest logits here, and the computation is
deterministic on CPU, so an equal argmax is stable, not luck of a run.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_fn_cases

FN = "tests.dist.generate_cases:run"
PLANS = ("dp", "tp", "zero3", "pp")
CASES = [*({"id": f"hf-{p}", "fn": "hf_generate", "plan": p} for p in PLANS),
         {"id": "not-hf", "fn": "not_generative"}]


@pytest.fixture(scope="module")
def two():
    return run_fn_cases(2, FN, CASES)


def _ok(r: dict) -> None:
    assert "error" not in r, r.get("error")


@pytest.mark.parametrize("plan", PLANS)
def test_generate_gives_the_single_process_tokens(two, plan):
    r = two[f"hf-{plan}"]
    _ok(r)
    assert r["dp_size"] == (1 if plan in ("tp", "pp") else 2)
    assert r["use_cache"] is True
    a, b = r["pm"]
    assert "value" in a and "value" in b, r["pm"]
    assert a["value"] == b["value"] == r["ref"]
    assert len(r["ref"][0]) == 6 + 16
    assert r["ref"] != r["untrained"]  # training moved the tokens: stale weights would fail
    assert r["pm_training"] is True and r["model_training"] is True  # modes left as they were
    # the weights did not change: the working copy is reused, nothing gathered
    assert r["again"] == r["ref"] and r["gathers_again"] == 0 and r["kept"]
    # a forward with gradients (training resumed) frees the whole-model copy; the next
    # call gathers the unchanged weights again
    assert r["freed"] and r["mid"] == r["ref"] and r["gathers_mid"] == 1
    # an optimizer step (on the local tensors) changed them: gathered again
    assert r["after_step"] == r["ref_after_step"] and r["gathers_after_step"] == 2
    assert r["ref_after_step"] != r["ref"]
    # lm_head negated in place through its DTensor, outside a step: gathered again
    assert r["flipped"] == r["ref_flipped"] and r["gathers_flipped"] == 3
    assert r["ref_flipped"] != r["ref_after_step"]
    if plan in ("dp", "zero3"):  # the user's model gone: built from the structure copy
        assert r["model_freed"] and r["without_model"] == r["ref_flipped"]


def test_generate_of_a_copy_uses_the_copys_weights(two):
    r = two["hf-dp"]
    _ok(r)
    # deepcopy(pm) (AveragedModel's) negates its lm_head back: pm's tokens before the flip
    assert r["twin"] == r["after_step"]
    assert r["pm_after_twin"] == r["flipped"]  # pm's own weights are untouched


def test_model_without_generate_or_gone_raises_on_every_rank(two):
    r = two["not-hf"]
    _ok(r)
    a, b = r["generate"]
    assert a.get("error") == b.get("error") == "GenerateError", r["generate"]
    assert a["message"] == b["message"]
    assert "Three" in a["message"] and "pm.full_state_dict()" in a["message"]
    assert all("value" in o for o in r["forward"]), r["forward"]
    assert r["freed"]
    a, b = r["gone"]
    assert a.get("error") == b.get("error") == "GenerateError", r["gone"]
    assert "Three" in a["message"] and "pm.full_state_dict()" in a["message"]
