"""``autopar.verify`` without a process group: the candidate shortlist (variants,
deduplication, predicted order, ``k``), the report's numbers and text, and bad input.
The measuring itself runs on real gloo ranks in tests/dist/test_verify.py."""

from __future__ import annotations

import copy
import sys

import pytest

from autopar import MeshSpec, Plan
from autopar import plan as make_plan
from autopar import verify as verify_fn
from autopar.errors import ConfigError
from autopar.verify import Row, VerifyReport, candidate_key, label, shortlist, spearman
from tests.dist.harness import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402
import mlp  # noqa: E402

MESH = MeshSpec.preset("cpu-gloo", shape=(2,))


@pytest.fixture(scope="module")
def tiny():
    return gpt.build(layers=2, dim=64, batch=8)


@pytest.fixture(scope="module")
def generated(tiny):
    model, ex = tiny
    return shortlist(model, ex, MESH, k=10)


def _with_step(p: Plan, seconds: float) -> Plan:
    q = copy.deepcopy(p)
    q.decisions.step_seconds = seconds
    return q


def test_shortlist_has_the_search_plan_and_its_variants_in_predicted_order(generated):
    cands = generated.candidates
    origins = [c.origin for c in cands]
    assert "search" in origins
    # ZeRO, accumulation and (2 repeated blocks, an even mesh) a 1F1B pipeline were priced
    assert {"zero_stage=3", "micro_batches=2", "pipeline_stages=2"} <= set(origins), origins
    pp = next(c for c in cands if c.origin == "pipeline_stages=2")
    assert pp.label == "pp2 x 1f1b x 2 mb" and pp.plan.world_size == 2
    predicted = [c.plan.decisions.step_seconds for c in cands]
    assert predicted == sorted(predicted)
    # one candidate per (decisions, placements): the forced zero_stage=0 variant is the
    # search's own plan again and is dropped, the search's origin kept
    keys = [candidate_key(c.plan) for c in cands]
    assert len(set(keys)) == len(keys)
    assert generated.duplicates >= 1 and "zero_stage=0" not in origins
    # a 1-D mesh of 2 has no 2-D fold (2 is prime); nothing failed to plan
    assert not any(o.startswith("mesh") for o in origins) and generated.skipped == {}


def test_shortlist_keeps_the_k_best_and_always_the_included_plan(generated):
    base = generated.candidates[0].plan
    others = [c.plan for c in generated.candidates[1:4]]
    given = [_with_step(p, s) for p, s in zip(others, (3.0, 1.0, 2.0))]
    worst = _with_step(base, 9.0)
    sl = shortlist(None, k=3, candidates=[*given, copy.deepcopy(given[1])], include=[worst])
    # the copy of given[1] is a duplicate; the included plan stays although it is the
    # slowest predicted; the k - 1 = 2 best of the rest fill the list, best first
    assert sl.duplicates == 1
    assert [c.plan.decisions.step_seconds for c in sl.candidates] == [1.0, 2.0, 9.0]
    assert sl.candidates[-1].origin == "verified plan"


def test_a_model_without_repeated_layers_gets_no_pipeline_variant():
    model, ex = mlp.build()
    sl = shortlist(model, ex, MESH, k=10, zero_stage=0)
    origins = [c.origin for c in sl.candidates] + list(sl.skipped)
    assert "pipeline_stages=2" not in origins
    # the caller's forced zero_stage=0 holds for the search's plan, variants override it
    assert next(c for c in sl.candidates if c.origin == "search").plan.decisions.zero_stage == 0


def test_a_variant_that_cannot_be_planned_is_skipped_with_its_reason(tiny):
    model, _ = tiny
    x, y = gpt.build(layers=2, dim=64, batch=3)[1]  # 3 samples: no 2 micro-batches
    sl = shortlist(model, (x, y), MESH, k=2, search="drec", time_limit=5.0)
    assert "micro_batches=2" in sl.skipped and "does not split" in sl.skipped["micro_batches=2"]


def _report(pred: list[float], meas: list[float], pick: str = "measured") -> VerifyReport:
    p = make_plan(*mlp.build(), MESH)
    rows = [Row(f"plan {i}", "given", a, b, [b * 0.9, b, b * 1.2], p)
            for i, (a, b) in enumerate(zip(pred, meas))]
    r = VerifyReport(rows, 0, pick, 3, 1, 2)
    r.chosen = r.measured_best if pick == "measured" else 0
    return r


def test_report_table_and_dict():
    r = _report([1.0, 2.0, 3.0], [0.3, 0.1, 0.2])
    assert r.chosen == 1 and r.plan is r.rows[1].plan
    assert r.spearman == pytest.approx(-0.5)
    text = r.table()
    assert "<- chosen" in text.splitlines()[2] and "(measured fastest)" in text
    assert "Spearman (predicted vs measured): -0.50 over 3 candidates" in text
    d = r.to_dict()
    assert d["chosen"] == 1 and d["rows"][1]["spread"] == pytest.approx(0.3)
    assert d["plan"]["mesh"]["shape"] == [2]


def test_spearman():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: ranks (0, 1.5, 1.5, 3) and (0, 2, 1, 3), Pearson of those
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1.0], [2.0]) is None and spearman([1, 1], [1, 2]) is None


def test_label_words(tiny):
    model, ex = tiny
    p = make_plan(model, ex, MESH, zero_stage=3, micro_batches=2, recompute=["blocks.0"],
                  pins={"*": "R", "input:0": "S(0)", "input:1": "S(0)"})
    assert label(p) == "dp2, zero3, 2 mb, recompute 1 layer"


@pytest.mark.parametrize("kwargs, word", [({"k": 0}, "k must be"), ({"steps": 0}, "steps must be"),
                                          ({"k": 2.5}, "k must be"), ({"warmup": -1}, "warmup"),
                                          ({"pick": "fastest"}, "pick must be"),
                                          ({"optimizer": "lbfgs"}, "optimizer must be"),
                                          ({"batch": "local"}, "global")])
def test_bad_input_is_a_clear_value_error(tiny, kwargs, word):
    model, ex = tiny
    with pytest.raises(ValueError, match=word) as e:
        verify_fn(model, ex, MESH, **kwargs)
    assert isinstance(e.value, ConfigError)


def test_verify_needs_the_live_job(tiny, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    model, ex = tiny
    with pytest.raises(ConfigError, match="under torchrun"):
        verify_fn(model, ex, MESH, k=1)


GPT = str(ROOT / "examples" / "gpt.py") + ":build"


@pytest.mark.parametrize("env, argv, message", [
    ({}, [], "run it under torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--k", "0"], "--k must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--steps", "0"], "--steps must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--mesh", "4"], "has 4 devices but torchrun started 2"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--candidates", "nowhere.json"], "cannot read plan file nowhere.json"),
])
def test_check_cli_errors_before_joining(monkeypatch, capsys, env, argv, message):
    """``autopar check``'s user errors: one line, status 2, no process group made."""
    import torch.distributed as dist

    from autopar.cli.main import main

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["check", GPT, "--factory-args", "layers=1", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()
