"""The mesh shape searched from a device count, and the scaling curve (issue 47).

The search's promise is checked against what a user would otherwise do: plan each shape
they could have named and keep the fastest.  Every shape's plan here is a real search on
a small GPT; nothing is mocked.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar import MeshSpec
from autopar.cli.main import main as cli_main
from autopar.errors import ConfigError
from autopar.plans import Plan
from autopar.scaling import scaling_curve, scaling_table
from autopar.search.mesh_shapes import _respects_nodes, shape_options, three_axis_splits

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402

H100 = "multinode-h100-ib"


def _gpt(batch: int = 16):
    return gpt.build(layers=2, dim=64, heads=4, seq=32, batch=batch)


def test_shapes_respect_nodes():
    m = MeshSpec.preset(H100, devices=64)
    assert m.search_shape and m.shape == (64,)
    assert shape_options(m) == [(64,), (32, 2), (16, 4), (8, 8), (4, 16), (2, 32), (8, 4, 2)]
    # a node of 8 cuts through a group of 3 (4x3) or of 12: not shapes of this cluster
    assert not _respects_nodes((4, 3), 8) and not _respects_nodes((12,), 8)
    assert _respects_nodes((4, 16), 8) and _respects_nodes((2, 4), 8)
    with pytest.raises(ConfigError, match="12 devices on nodes of 8"):
        shape_options(MeshSpec.preset(H100, devices=12))
    # one host (cpu-gloo): no node boundary, every factorisation
    assert shape_options(MeshSpec.preset("cpu-gloo", devices=6)) == [(6,), (3, 2), (2, 3)]


def test_three_axis_shapes_keep_stages_of_several_nodes():
    """A three-axis shape is the node count by a node's two axes (the larger outer), and
    is searched only for pipelines from its outer axis with more than one node a stage:
    none on two nodes (two stages of one node each are (16, 2)'s split)."""
    def three(n):
        return [s for s in shape_options(MeshSpec.preset(H100, devices=n)) if len(s) == 3]

    assert three(8) == [] and three(16) == [] and three(24) == []  # 3 nodes: no stage of several
    assert three(32) == [(4, 4, 2)] and three(1024) == [(128, 4, 2)]
    assert three_axis_splits((4, 4, 2)) == {(2, 0)}
    assert three_axis_splits((8, 4, 2)) == {(2, 0), (4, 0)}
    # one host (cpu-gloo) has no nodes to carve a pipeline across
    assert not [s for s in shape_options(MeshSpec.preset("cpu-gloo", devices=8)) if len(s) == 3]


def test_preset_devices_flag_round_trips():
    m = MeshSpec.preset(H100, devices=16)
    assert MeshSpec.from_dict(json.loads(m.to_json())) == m
    assert not m.with_shape((2, 8)).search_shape  # a named shape is not searched
    for bad in (0, -8, True, 2.5):
        with pytest.raises(ValueError, match="devices="):
            MeshSpec.preset(H100, devices=bad)
    with pytest.raises(ValueError, match="no shape with it"):
        MeshSpec.preset(H100, shape=(2, 8), devices=16)


def test_searched_shape_beats_every_named_one():
    """The chosen plan is never predicted slower than the best plan of any shape the user
    could have named (each planned by its own search), and the plan says which shapes it
    weighed."""
    model, inputs = _gpt()
    p = autopar.plan(model, inputs, MeshSpec.preset(H100, devices=16), time_limit=10)
    named = {s: autopar.plan(model, inputs, MeshSpec.preset(H100, shape=s), time_limit=10)
             for s in shape_options(MeshSpec.preset(H100, devices=16))}
    best = min(q.decisions.step_seconds for q in named.values())
    assert p.decisions.step_seconds <= best * (1 + 1e-9)
    chosen = tuple(p.request.mesh_shape)
    assert chosen in named and math.prod(chosen) == 16
    # the chosen shape's own search finds the same step: the plan is that shape's plan
    assert p.decisions.step_seconds == pytest.approx(named[chosen].decisions.step_seconds, rel=1e-9)
    rows = p.decisions.mesh_shapes
    assert [tuple(r["shape"]) for r in rows if r["note"] == "chosen"] == [chosen]
    assert {tuple(r["shape"]) for r in rows} == set(named)
    steps = [r["step_seconds"] for r in rows if r["step_seconds"] is not None]
    assert steps == sorted(steps) and steps[0] == p.decisions.step_seconds
    text = p.explain("mesh")
    assert f"of the {len(named)} shapes of 16 devices" in text
    for s in named:
        assert "x".join(map(str, s)) in text
    # the record survives JSON
    q = Plan.from_json(p.to_json())
    assert q.decisions.mesh_shapes == rows and q.explain("mesh") == text


def test_forced_split_skips_shapes_that_cannot_hold_it():
    """pipeline_axis=1 has no meaning on the one-axis shape: that shape is skipped and
    said so, the others are searched."""
    model, inputs = _gpt()
    p = autopar.plan(model, inputs, MeshSpec.preset(H100, devices=8), time_limit=10,
                     pipeline_stages=2, pipeline_axis=1, micro_batches=2)
    assert len(p.request.mesh_shape) == 2 and p.decisions.pipeline_stages == 2
    notes = {tuple(r["shape"]): r["note"] for r in p.decisions.mesh_shapes}
    assert notes[(8,)].startswith("not searched")


def test_preset_without_shape_under_torchrun_is_the_world(monkeypatch):
    from autopar import validate

    monkeypatch.setenv("WORLD_SIZE", "4")
    m = validate.mesh("cpu-gloo")
    assert m.search_shape and m.size == 4
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(ConfigError, match="with 16 ranks"):
        validate.mesh("8xH100-nvlink")
    monkeypatch.delenv("WORLD_SIZE")
    assert not validate.mesh("cpu-gloo").search_shape  # planning alone: the preset's shape


def test_scaling_curve_keeps_rows_per_device():
    model, inputs = _gpt(batch=8)
    pts = scaling_curve(model, inputs, preset=H100, devices=[8, 16, 32], time_limit=15)
    assert [p.devices for p in pts] == [8, 16, 32]
    assert [p.batch for p in pts] == [8, 16, 32]
    assert all(math.prod(p.shape) == p.devices for p in pts)
    assert pts[0].efficiency == 1.0 and all(0 < p.efficiency <= 1.5 for p in pts)
    # tokens/s is the batch's tokens over the step, the first count planned at full depth
    assert pts[0].tokens_per_second == pytest.approx(8 * 32 / pts[0].step_seconds)
    assert not pts[0].estimated
    table = scaling_table(pts)
    assert all(f"{n:>7}" in table for n in (8, 16, 32))
    with pytest.raises(ConfigError, match="whole number of rows"):
        scaling_curve(model, inputs, preset=H100, devices=[16, 3], time_limit=5)
    with pytest.raises(ConfigError, match="positive device counts"):
        scaling_curve(model, inputs, preset=H100, devices=[], time_limit=5)


def test_cli_devices(tmp_path, capsys):
    target = f"{ROOT / 'examples' / 'gpt.py'}:build"
    small = ["--factory-args", "layers=2", "dim=64", "batch=16", "--time-limit", "10", "-q"]
    assert cli_main(["plan", target, "--preset", H100, "--devices", "16", "--explain", "mesh",
                     *small]) == 0
    assert "of the 4 shapes of 16 devices" in capsys.readouterr().out
    assert cli_main(["plan", target, "--preset", H100, "--devices", "16", "--mesh", "2x8", *small]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli_main(["plan", target, "--preset", H100, "--devices", "8,x", *small]) == 2
    out = tmp_path / "curve.json"
    png = tmp_path / "curve.png"
    assert cli_main(["plan", target, "--preset", H100, "--devices", "8,16", "--json", str(out),
                     "--scaling", str(png), *small]) == 0
    text = capsys.readouterr().out
    assert "efficiency" in text
    rows = json.loads(out.read_text())
    assert [r["devices"] for r in rows] == [8, 16] and png.stat().st_size > 1000
    assert torch.tensor([r["efficiency"] for r in rows])[0] == 1.0


@pytest.mark.parametrize("devices", [8, 1024])
def test_every_shape_of_a_cluster_is_weighed(devices):
    """Plans only, as on the issue's 8 and 1,024 devices: every shape of the count is in
    the record, each with a plan or a reason, and the chosen one is the fastest."""
    model, inputs = _gpt(batch=devices)
    p = autopar.plan(model, inputs, MeshSpec.preset(H100, devices=devices), time_limit=20)
    rows = p.decisions.mesh_shapes
    assert sorted(tuple(r["shape"]) for r in rows) == sorted(
        shape_options(MeshSpec.preset(H100, devices=devices)))
    assert math.prod(p.request.mesh_shape) == devices
    finite = [r["step_seconds"] for r in rows if r["step_seconds"] is not None]
    assert min(finite) == p.decisions.step_seconds
    assert all(r["layout"] or r["note"] for r in rows)


@pytest.mark.slow
def test_a_shape_whose_pipeline_wins_is_widened():
    """A shape is widened by a bound on its pipelined splits, not by its plain candidate.
    A 4-block GPT of width 4,096 on 16 V100s (two nodes, 25 Gbit/s between them): every
    plain candidate pays for tensor or data parallelism across the slow link, and a
    pipeline of one stage per node does not.  8x2's plain candidate (TP8 across nodes) is
    1.17x 4x4's, so a rule on plain candidates alone (within 15%) never searched its
    pipelines, while 8x2's own search finds the fastest plan: a two-stage pipeline of TP+SP4 x TP+SP2 in each node."""
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(vocab=1024, seq=256, dim=4096, heads=32, layers=2))
    tokens = torch.zeros(16, 256, dtype=torch.long, device="meta")
    kw = dict(blocks=4, precision="bf16-mixed", time_limit=60, explore=True)
    named = autopar.plan(model, (tokens, tokens.clone()), MeshSpec.preset("p3.16xlarge", shape=(8, 2)), **kw)
    p = autopar.plan(model, (tokens, tokens.clone()), MeshSpec.preset("p3.16xlarge", devices=16), **kw)
    assert named.decisions.pipeline_stages > 1
    assert p.decisions.step_seconds <= named.decisions.step_seconds * (1 + 1e-9)
    rows = {tuple(r["shape"]): r for r in p.decisions.mesh_shapes}
    assert "first candidate only" not in rows[(8, 2)]["note"]
    assert rows[(8, 2)]["step_seconds"] == pytest.approx(named.decisions.step_seconds, rel=1e-9)


@pytest.mark.slow
def test_a_stage_of_three_axes_is_searched():
    """Mist's GPT-22B layer (width 6,144, 64 heads, 4,096 tokens; 2 blocks standing for 48)
    on 4 nodes of 8 A100-40GB, batch 256: the fastest plan is PP2 across nodes with each
    stage DP2 x FSDP4 x TP2 (three axes in a stage, which no pipeline carved from a one- or
    two-axis shape gives).  The shape search must find it: no slower than the named 4x4x2
    shape's own search of that split.  A search of one- and two-axis shapes alone picks a
    slower plan."""
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(vocab=50304, seq=4096, dim=6144, heads=64, layers=2))
    tokens = torch.zeros(256, 4096, dtype=torch.long, device="meta")
    kw = dict(blocks=48, precision="bf16-mixed", time_limit=120, explore=True)
    preset = "multinode-a100-40gb"
    named = autopar.plan(model, (tokens, tokens.clone()), MeshSpec.preset(preset, shape=(4, 4, 2)),
                         pipeline_stages=2, pipeline_axis=0, **kw)
    p = autopar.plan(model, (tokens, tokens.clone()), MeshSpec.preset(preset, devices=32), **kw)
    assert p.decisions.step_seconds <= named.decisions.step_seconds * (1 + 1e-9)
    assert tuple(p.request.mesh_shape) == (4, 4, 2) and p.decisions.pipeline_stages == 2
    two_axis = [r["step_seconds"] for r in p.decisions.mesh_shapes
                if len(r["shape"]) < 3 and r["step_seconds"] is not None]
    assert min(two_axis) > p.decisions.step_seconds
