"""``benchmarks/cost_fidelity.py --reprice``: a stored run priced again with the current
cost model.  The measured side is kept; a case the model now plans differently than
the plan that was measured is left out with its reason, since its step was never
measured (comparing it would judge one plan by another's time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import autopar
from autopar import MeshSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cost_fidelity as cf  # noqa: E402


def _plan(case: str):
    model, _, _, call = cf.case_call("gpt", case, MeshSpec.preset("cpu-gloo", shape=(4,)), 4)
    return autopar.plan(model, **call)


def test_reprice_keeps_the_measured_plan_and_leaves_out_a_changed_one(tmp_path: Path) -> None:
    dp = _plan("dp")
    row = {"model": "gpt", "preset": "cpu-gloo preset", "predicted_ms": -1.0, "measured_ms": 250.0,
           "spread": 0.05, "halves_ms": [249.0, 251.0]}
    stored = {"rows": [{**row, "case": "dp", "plan": cf.signature(dp)},
                       # as if ZeRO-3 had been measured running data parallel's plan
                       {**row, "case": "zero3", "plan": cf.signature(dp)}],
              "load": [0.5, 4.0], "world": 4, "steps": 15, "when": "2026-11-26", "warmup": 1}
    (tmp_path / "rows.json").write_text(json.dumps(stored))
    (tmp_path / "calibrated-mesh.json").write_text(MeshSpec.preset("cpu-gloo", shape=(4,)).to_json())
    (tmp_path / "calibration.txt").write_text("calibrated ...")
    rows, calibration, load = cf.reprice(tmp_path, ["cpu-gloo preset"])
    assert calibration == "calibrated ..." and load == (0.5, 4.0)
    kept, changed = rows
    assert kept["predicted_ms"] == pytest.approx(dp.decisions.step_seconds * 1e3)
    assert kept["measured_ms"] == 250.0 and "error" not in kept
    assert "planned differently" in changed["error"] and "predicted_ms" not in changed
    text = cf.section(rows, 4, 15, load, calibration, repriced=tmp_path.name, when="2026-11-26")
    assert f"`{tmp_path.name}` (`--reprice`)" in text and "Measured 2026-11-26" in text
    assert "| cpu-gloo preset | 1 |" in text  # the changed case is not counted
    assert cf.reprice(tmp_path, ["calibrated"])[0] == []  # only the presets asked for


def test_the_table_is_rewritten_and_the_history_under_it_kept(tmp_path: Path) -> None:
    """A run rewrites its section's generated part (heading to the line that says how to
    regenerate it) and keeps the runs of earlier stops written by hand below it, up to
    the next section.  ``plan_time.write_section`` replaced the whole section and took
    that history with it (stop 39 restored it by hand)."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{cf.SECTION}\n\nold table\n\n{cf.REGENERATE}\n\n"
                   "**Stop 38.** history\n\n## Context parallel\n\nkept\n")
    new = f"{cf.SECTION}\n\nnew table\n\n{cf.REGENERATE}\n"
    cf.write_table(new, doc)
    text = doc.read_text()
    assert "old table" not in text and "new table" in text
    assert "**Stop 38.** history" in text and text.endswith("## Context parallel\n\nkept\n")
    assert text.index("new table") < text.index("history") < text.index("## Context parallel")
    assert text.count(cf.SECTION) == 1 and text.count(cf.REGENERATE) == 1
    # a doc without the section gets it appended
    other = tmp_path / "other.md"
    other.write_text("# Benchmarks\n\n## Something else\n\nx\n")
    cf.write_table(new, other)
    assert other.read_text().endswith(new)
