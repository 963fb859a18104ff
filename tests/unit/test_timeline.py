"""The predicted step as events, a Chrome trace and a PNG (autopar.report.timeline)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import autopar
from autopar import MeshSpec
from autopar.cli.main import main
from autopar.report.timeline import (
    Kind,
    Lane,
    chrome_trace,
    draw_timeline,
    predicted_events,
    step_end,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402

A100 = MeshSpec.preset("8xA100-nvlink", shape=(4,))


@pytest.fixture(scope="module")
def model():
    return gpt.build(layers=4, dim=64)


def _plan(model, **kw):
    m, ex = model
    return autopar.plan(m, ex, A100, **kw)


def _compute(events, stage):
    return [e for e in events if e.stage == stage and e.lane == Lane.COMPUTE and e.kind != Kind.BUBBLE]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_schedule_order_and_step(model, schedule):
    p = _plan(model, pipeline_stages=4, micro_batches=8, schedule=schedule)
    ev = predicted_events(p)
    for s in range(4):
        seq = [(e.kind, e.micro) for e in _compute(ev, s)]
        fwd = [i for k, i in seq if k == Kind.FORWARD]
        bwd = [i for k, i in seq if k == Kind.BACKWARD]
        assert fwd == list(range(8)) and bwd == list(range(8))
        if schedule == "gpipe":
            assert seq.index((Kind.BACKWARD, 0)) == 8  # every forward first
        else:  # 1F1B: 3 - s warm-up forwards before the first backward
            assert seq.index((Kind.BACKWARD, 0)) == 4 - s
        # no two boxes of one lane overlap, and bubbles fill the gaps exactly
        lane = sorted((e for e in ev if e.stage == s and e.lane == Lane.COMPUTE), key=lambda e: e.start)
        for a, b in zip(lane, lane[1:]):
            assert a.end <= b.start + 1e-15
    # dependencies: a micro-batch's forward on stage s starts after stage s-1's ends
    fw = {(e.stage, e.micro): e for e in ev if e.kind == Kind.FORWARD}
    for (s, i), e in fw.items():
        if s:
            assert e.start >= fw[(s - 1, i)].end - 1e-15
    # the search's formula and the dependency-driven layout differ a little with
    # unequal stages (pre/post make the outer ones heavier here), either way
    end = step_end(ev)
    assert end == pytest.approx(p.decisions.step_seconds, rel=0.1)
    bubbles = sum(e.duration for e in ev if e.kind == Kind.BUBBLE and e.stage == 3)
    assert bubbles > 0


def test_no_pipeline_is_gradient_accumulation_ending_at_the_step(model):
    p = _plan(model, pipeline_stages=1, micro_batches=4, zero_stage=0)
    ev = predicted_events(p)
    seq = [(e.kind.value[0], e.micro) for e in _compute(ev, 0)]
    # four forward/backward pairs, then the optimizer's one update of the step and the
    # gradients' copies into their buckets (priced once a step)
    assert seq == [(k, i) for i in range(4) for k in "fb"] + [("o", -1), ("c", -1)]
    copies = [e for e in ev if e.kind == Kind.COPY]
    assert len(copies) == 1 and copies[0].duration == p.decisions.stage_parts[0]["copy_step"] > 0
    opt = [e for e in ev if e.kind == Kind.OPTIMIZER]
    assert len(opt) == 1 and opt[0].duration == p.decisions.breakdown["optimizer_seconds"] > 0
    # one stage: the layout is exactly the cost model's step
    assert step_end(ev) == pytest.approx(p.decisions.step_seconds, rel=1e-9)
    assert not [e for e in ev if e.kind == Kind.BUBBLE]


def test_zero3_shows_its_gathers_in_line_with_compute(model):
    p = _plan(model, pipeline_stages=1, micro_batches=2, zero_stage=3)
    ev = predicted_events(p)
    comm = [e for e in ev if e.kind == Kind.COMM]
    assert len(comm) == 4  # forward and backward of each micro-batch carry gathers
    assert sum(e.duration for e in comm) == pytest.approx(2 * p.decisions.stage_parts[0]["comm"])
    assert step_end(ev) == pytest.approx(p.decisions.step_seconds, rel=1e-9)


def test_chrome_trace_is_well_formed(model):
    p = _plan(model, pipeline_stages=2, micro_batches=4, schedule="1f1b")
    t = json.loads(json.dumps(chrome_trace(p)))
    xs = [e for e in t["traceEvents"] if e["ph"] == "X"]
    assert xs and all({"ts", "dur", "pid", "tid", "name"} <= set(e) for e in xs)
    names = {(e["pid"], e["args"]["name"]) for e in t["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "stage 0 (ranks 0-1) (predicted)"), (1, "stage 1 (ranks 2-3) (predicted)")}
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(step_end(predicted_events(p)) * 1e6)


def test_png_and_cli_flags(model, tmp_path, capsys):
    p = _plan(model, pipeline_stages=2, micro_batches=4)
    png = draw_timeline(p, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    code = main(["plan", str(ROOT / "examples" / "gpt.py"), "--mesh", "2", "-q", "--timeline",
                 str(tmp_path / "c.png"), "--trace", str(tmp_path / "c.json"),
                 "--factory-args", "layers=1", "dim=32", "heads=2", "vocab=64", "seq=8", "batch=4"])
    err = capsys.readouterr().err
    assert code == 0 and "predicted timeline written to" in err
    assert (tmp_path / "c.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "c.json").read_text())["traceEvents"]
