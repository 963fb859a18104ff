"""Our joint search against Megatron-LM's published plan for the 1.7B GPT on 32 A100s
(benchmarks/reference_plans.py): under our own cost model, the free search must never
predict a slower step than the published (TP 1, PP 1, DP 32) layout, on the same mesh.

Planning only, on the meta device (two blocks captured, extrapolated to 24).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "reference_plans", ROOT / "benchmarks" / "reference_plans.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("reference_plans", mod)
    spec.loader.exec_module(mod)
    return mod


rp = _load()


def _job(name: str, kind: str, shape: tuple, time_limit: float) -> tuple:
    return (name, kind, shape, time_limit)


def test_one_pool_runs_the_longest_first_and_returns_outcomes_in_task_order() -> None:
    # both suites' jobs go to one pool (reference_plans.main): free searches on 3-axis
    # meshes first, then the most devices, pinned plans last
    tasks = [(_job, ("a", "megatron", (192, 8))), (_job, ("b", "ours", (4, 8))),
             (_job, ("c", "ours", (4, 2, 4))), (_job, ("d", "ours", (192, 8))),
             (_job, ("e", "published", (2, 2, 4)))]
    order = [j[0] for _, j in sorted(tasks, key=lambda t: rp.longest_first(t[1]))]
    assert order == ["c", "d", "b", "e", "a"]
    seen = []
    out = rp.run_tasks(tasks, 1, 9.0, seen.append)
    assert [o[0] for o in out] == [j[0] for _, j in tasks] and all(o[3] == 9.0 for o in out)
    assert seen == out


def test_megatron_pins_put_tp_on_the_last_axis() -> None:
    ref = rp.BY_NAME["7.5B"]
    assert ref.megatron_shape() == (16, 2, 4) and ref.dp == 32
    pins = rp.megatron_pins(ref, 3)
    assert pins["*"] == "RRR"
    assert pins["*q_proj.weight"] == "RRS(0)" and pins["*fc2.weight"] == "RRS(1)"
    assert pins["input:0"] == "S(0)S(0)R"
    # pattern pins apply in order: the catch-all must come before the specific ones
    assert next(iter(pins)) == "*"
    assert rp.megatron_pins(rp.BY_NAME["1.7B"], 2) == {
        "*": "RR", "input:0": "S(0)S(0)", "input:1": "S(0)S(0)"}
    # every count dividing the batch of 1,536 whose micro-batch still splits over the 32
    # data-parallel ranks, at least one per stage (2)
    assert rp.BY_NAME["39.1B"].megatron_micro_batches() == [2, 3, 4, 6, 8, 12, 16, 24, 48]


@pytest.mark.slow  # four joint searches at 1.7B width: ~35 s
def test_ours_never_slower_than_megatron_1_7b() -> None:
    ref = rp.BY_NAME["1.7B"]
    shape = ref.megatron_shape()
    meg = [rp.run_job(ref.name, "megatron", shape, m, 120.0) for m in (2, 4, 8)]
    ours = rp.run_job(ref.name, "ours", shape, None, 120.0)
    for o in (*meg, ours):
        assert not o.error, o.error
        # the budget: 80 GiB less the preset's reserve (1.5 GiB + 5%)
        assert math.isfinite(o.step_seconds) and o.memory_gib <= 80.0 * 0.95 - 1.5
    published = rp.best(meg)
    # Megatron's layout really is pure data parallelism on both axes
    assert published.roles == ["dp", "dp"] and (published.tp, published.dp) == (1, 32)
    assert not ours.stopped
    # ours searches a superset of what the pinned plans can choose (placements, ZeRO,
    # pipelines, micro-batches): never slower; 1e-9 relative covers float summation order
    assert ours.step_seconds <= published.step_seconds * (1 + 1e-9), (ours, published)


@pytest.mark.parametrize("name", [r.name for r in rp.REFERENCES])
def test_reference_shapes(name: str) -> None:
    ref = rp.BY_NAME[name]
    assert ref.tp * ref.pp * ref.dp == ref.gpus
    assert math.prod(ref.megatron_shape()) == ref.gpus
    assert ref.megatron_shape() in ref.shapes(all_meshes=False)


# ---- Alpa's and Mist's published plans (benchmarks/published_suites.py) ----
sys.path.insert(0, str(ROOT / "benchmarks"))
import published_suites as ps  # noqa: E402

from autopar.plans.placement import parse_placements  # noqa: E402


@pytest.mark.parametrize("key", [r.key for r in ps.RUNS])
def test_published_runs_are_consistent(key: str) -> None:
    run = ps.BY_KEY[key]  # sizes that do not multiply out fail Run.__post_init__ at import
    if run.unsupported:
        return
    # each micro-batch splits over the data-parallel ranks (Mist: one sequence per rank)
    assert (run.batch // run.micro) % run.dp == 0
    sub = run.shape[1:] if run.pp > 1 else run.shape
    pins = run.pins()
    assert all(len(parse_placements(p)) == len(sub) for p in pins.values())
    if run.tp > 1:  # TP on the last axis of the stage mesh, the batch on the others
        assert pins["*fc1.weight"].endswith("S(0)") and pins["input:0"].endswith("R")
        assert sub[-1] == run.tp


def test_mist_22b_pins() -> None:
    pins = ps.BY_KEY["Mist 22B"].pins()  # PP4 x DP4 x TP2 on (4, 4, 2): stage mesh (4, 2)
    assert pins["*"] == "RR" and pins["input:0"] == "S(0)R" and pins["*fc2.weight"] == "RS(1)"


@pytest.mark.slow  # two joint searches at 39B width on 64 V100s: ~20 s
def test_ours_no_slower_than_alpa_39b() -> None:
    pub = ps.run_job("Alpa 39B", "published", (16, 4), 120.0)
    # a 20 s limit (the search explored for ~50 s under 120 s and chose the same plan,
    # 8 stages x 256 micro-batches, as under 15 or 30 s): beating the published plan
    # within it is the stronger claim
    ours = ps.run_job("Alpa 39B", "ours", (16, 4), 20.0)
    for o in (pub, ours):
        assert not o.error, o.error
        # V100 16 GB less the preset's reserve (1.5 GiB + 5%): 13.7 GiB
        assert math.isfinite(o.step_seconds) and o.memory_gib <= 16 * 0.95 - 1.5 + 1e-9
    assert (pub.stages, pub.micro_batches, pub.tp) == (16, 1024, 4)
    # the search reaches micro-batch counts above 32 (it stopped there before); it
    # covers the published split, so it can only be faster (1e-9: summation order)
    assert ours.micro_batches > 32
    assert ours.step_seconds <= pub.step_seconds * (1 + 1e-9), (ours, pub)


def test_published_summary_breaks_ties_by_mesh() -> None:
    """Two meshes planned at the same step: the row names the same one whatever order
    the workers finished in (Alpa 1.3B plans 38.105 s on 2x2 and on 4)."""
    from reference_plans import Outcome

    run = ps.RUNS[0]
    a = Outcome(run.key, "ours", (4,), step_seconds=38.0)
    b = Outcome(run.key, "ours", (2, 2), step_seconds=38.0)
    for results in ([a, b], [b, a]):
        (row,) = ps.summarise(results, [run])
        assert row["ours"].shape == (2, 2)
