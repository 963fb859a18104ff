"""Pipeline stages carved from an inner mesh axis (issue 10), on 4 real gloo ranks.

On a 2x2 mesh (rows as nodes), ``pipeline_axis=1`` puts the two stages inside each
"node": ranks 0 and 2 run stage 0, ranks 1 and 3 stage 1 (axis 0 gave blocks 0-1 and
2-3), and each stage is a data-parallel (or tensor-parallel) pair across the rows.

* equivalence with the single-process model under 1F1B, data- and tensor-parallel
  stages: loss, every gradient, parameters after two SGD and two AdamW steps, with
  tests/dist/test_parallelism_kinds.py's tolerances (fp32, same products summed in
  another order); every rank's measured memory within 10% of the model;
* export and load: the live module's export, and one written without a process group
  (the exporter numbers the rank files itself, by the same layout), trained bitwise
  like the live module.

Slow CI step (~60 s: two spawns of 4 ranks).
"""

from __future__ import annotations

import pytest

from tests.dist.harness import ROOT, Case, run_cases, run_fn_cases
from tests.dist.test_equivalence import MEGATRON, check
from tests.dist.test_parallelism_kinds import check_decisions

pytestmark = pytest.mark.slow

DP = {"*": "R", "input:0": "S(0)"}
INNER = {"pipeline_stages": 2, "pipeline_axis": 1, "micro_batches": 4, "schedule": "1f1b"}
CASES = [
    Case("pp2-axis1-x-dp2", "gpt", (2, 2), DP, {"layers": 2}, options=INNER, measure_memory=True),
    Case("pp2-axis1-x-tp2", "gpt", (2, 2), MEGATRON["gpt"], {"layers": 2}, options=INNER,
         measure_memory=True),
]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_cases(4, CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_stages_inside_a_node_train_like_the_model(results: dict, case: Case) -> None:
    res = results.get(case.id, {"error": "not run (an earlier case failed)"})
    check(res)
    check_decisions(res, case)
    assert res["decisions"]["pipeline_axis"] == 1
    # the stages interleave inside every row: rank r runs stage r % 2
    stages = [m["stage"] for m in sorted(res["memory"], key=lambda m: m["rank"])]
    assert stages == [0, 1, 0, 1]
    bad = [(m["rank"], m["measured"] / m["predicted"]) for m in res["memory"]
           if not 0.9 <= m["measured"] / m["predicted"] <= 1.1]
    assert not bad, bad


def test_export_and_load_keep_the_rank_layout(tmp_path) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    from autopar import MeshSpec, auto_parallel

    case = {"id": "pp2-axis1-dp2", "mesh": (2, 2), "pins": DP, "dir": str(tmp_path),
            "options": {**INNER, "zero_stage": 0}}
    # planning only (no process group): the exporter writes all four rank files; before,
    # it numbered them stage-major (rank 1 got stage 0's second replica, not stage 1)
    model, ex = gpt.build(layers=2)
    planned = auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2, 2)),
                            pins=DP, search="ilp", **case["options"])
    case["planned_dir"] = str(planned.export(tmp_path / "planned"))
    res = run_fn_cases(4, "tests.dist.test_export_decisions:export_case", [case])[case["id"]]
    assert "error" not in res, res.get("error")
    assert res["rank_file_targets"] == res["live_targets"]
    for k, err in res["err_vs_live"].items():
        assert err == 0.0, (k, err)
        assert res["losses"][k] == res["losses"]["live"], k
    # tolerances of tests/dist/test_export_decisions.py (AdamW: 2% of one lr=1e-3 step)
    for k, err in res["err_vs_ref"].items():
        assert err <= 2e-5, (k, err)
        assert res["losses"][k] == pytest.approx(res["losses"]["ref"], rel=1e-5), k
