"""Export and plan-file faults in one process (no process group): plan.json versions,
unknown keys and placements that do not fit the mesh; the atomic export protocol with a
simulated crash at every point (the on-disk state a killed process leaves behind); every
export file truncated or corrupted.  Real killed ranks: tests/dist/test_export_faults.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from autopar import MeshSpec, auto_parallel
from autopar.errors import ExportError, LoadError
from autopar.module import export_io as io
from autopar.module.load import _build_inner, _read_export
from autopar.plans.data import SCHEMA_VERSION, Plan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
TP = {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)", "input:0": "R"}
FILES = ["plan.json", "meta.json", "module.py", "rank0.pt", "rank1.pt", "MANIFEST.json"]


@pytest.fixture(scope="module")
def pm():
    import mlp
    model, ex = mlp.build()
    return auto_parallel(model, example_inputs=ex, mesh=MeshSpec.preset("cpu-gloo", shape=(2,)),
                         pins=TP, search="ilp")


@pytest.fixture
def good(pm, tmp_path: Path) -> Path:
    return pm.export(tmp_path / "exp")


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _read(d: Path, rank: int = 0):
    parts = _read_export(d, rank, None)
    return _build_inner(parts, d)


# ---------------------------------------------------------------- plan.json
def test_plan_json_records_versions_and_round_trips(pm) -> None:
    d = json.loads(pm.plan.to_json())
    assert d["schema_version"] == SCHEMA_VERSION
    assert d["torch_version"] == torch.__version__ and d["autopar_version"]
    assert Plan.from_json(pm.plan.to_json()).params() == pm.plan.params()


@pytest.mark.parametrize("where,key", [("", "future_field"), ("decisions", "overlap"),
                                       ("solver", "gpu_hours"), ("node", "color")])
def test_unknown_key_names_key_and_file(pm, tmp_path: Path, where: str, key: str) -> None:
    d = pm.plan.to_dict()
    target = {"": d, "decisions": d["decisions"], "solver": d["solver"],
              "node": next(iter(d["nodes"].values()))}[where]
    target[key] = 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(LoadError, match=rf"{path}: unknown key '{key}' in .*newer autopar"):
        Plan.from_json(path)


def test_truncated_plan_json_names_the_file(pm, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    text = pm.plan.to_json()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(LoadError, match=rf"{path} is not valid JSON .*truncated"):
        Plan.from_json(path)
    with pytest.raises(LoadError, match="cannot read plan file"):
        Plan.from_json(tmp_path / "missing.json")


def test_schema_mismatch_says_reexport_and_torch_mismatch_warns(pm, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(pm.plan.to_dict() | {"schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(LoadError, match=r"schema_version 2 .*re-export"):
        Plan.from_json(path)
    path.write_text(json.dumps({k: v for k, v in pm.plan.to_dict().items() if k != "schema_version"}))
    with pytest.raises(LoadError, match="schema_version None"):
        Plan.from_json(path)
    path.write_text(json.dumps(pm.plan.to_dict() | {"torch_version": "1.0"}))
    with pytest.warns(UserWarning, match="torch 1.0"):
        Plan.from_json(path)


@pytest.mark.parametrize("shape,match", [
    ((1, 2), r"field out_placements\[0\] = '.*' has 1 entries but the plan's mesh \(1, 2\)"),
    ((3,), r"field out_placements\[0\] = 'S\(0\)': mesh \(3,\) cuts dim \d+ \(size \d+\) into 3 pieces"),
])
def test_edited_mesh_names_node_and_field(pm, tmp_path: Path, shape, match: str) -> None:
    path = tmp_path / "plan.json"
    d = pm.plan.to_dict()
    d["mesh"]["shape"] = list(shape)
    d["mesh"]["axis_names"] = []
    d["mesh"]["links"] = d["mesh"]["links"] * len(shape)
    path.write_text(json.dumps(d))
    with pytest.raises(LoadError, match=rf"{path}: node '\w+' {match}"):
        Plan.from_json(path)


def test_shard_dim_out_of_range(pm) -> None:
    d = pm.plan.to_dict()
    node = next(n for n in d["nodes"].values() if n["param"] == "fc1.bias")
    node["out_placements"] = ["S(3)"]
    with pytest.raises(LoadError, match=r"node 'fc1_bias' field out_placements\[0\] = 'S\(3\)' "
                                        r"shards dim 3 of a tensor of shape \[128\]"):
        Plan.from_dict(d, "x.json")


# ---------------------------------------------------------------- export files
def test_export_has_manifest_with_checksums(good: Path) -> None:
    m = json.loads((good / "MANIFEST.json").read_text())
    assert set(m["files"]) == {"plan.json", "meta.json", "module.py", "README.md", "rank0.pt", "rank1.pt"}
    assert m["files"]["rank1.pt"]["sha256"] == io.sha256_file(good / "rank1.pt")
    assert (m["mesh"], m["world_size"], m["schema_version"]) == ([2], 2, SCHEMA_VERSION)
    for r in (0, 1):
        _read(good, r)  # the whole export reads back
    assert not [p for p in good.parent.iterdir() if p.name.startswith(".")]  # no leftovers


@pytest.mark.parametrize("name", FILES)
def test_truncated_file_is_named(good: Path, name: str) -> None:
    path = good / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    rank = 1 if name == "rank1.pt" else 0
    match = (r"MANIFEST.json is unreadable or not valid JSON" if name == "MANIFEST.json"
             else rf"{path} has \d+ bytes but the manifest records \d+: the file is truncated, or")
    with pytest.raises(LoadError, match=match):
        _read(good, rank)


@pytest.mark.parametrize("name", FILES[:-1])
def test_corrupt_byte_is_named(good: Path, name: str) -> None:
    path = good / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=rf"{path} does not match its sha256"):
        _read(good, 1 if name == "rank1.pt" else 0)


@pytest.mark.parametrize("name,garbage,match", [
    ("plan.json", b'{"nodes": ', r"plan.json is not valid JSON"),
    ("meta.json", b"[1, 2", r"meta.json is not valid JSON"),
    ("module.py", b"def (:\n", r"module.py does not run \(SyntaxError"),
    ("rank0.pt", b"not a zip file", r"rank0.pt cannot be read by torch.load"),
])
def test_signed_garbage_is_named(good: Path, name: str, garbage: bytes, match: str) -> None:
    """Files that pass the checksum (re-signed after a deliberate edit) but do not parse."""
    (good / name).write_bytes(garbage)
    io.sign(good)
    with pytest.raises(LoadError, match=match):
        _read(good)


def test_missing_manifest_or_directory(good: Path) -> None:
    (good / "MANIFEST.json").unlink()
    with pytest.raises(LoadError, match=r"has no MANIFEST.json: it is an incomplete export"):
        _read(good)
    with pytest.raises(LoadError, match="no export at"):
        _read(good.parent / "nowhere")


# ---------------------------------------------------------------- crashes mid-export
class _Crash(BaseException):
    """Stands in for a killed process: no ``except Exception`` cleanup runs."""


def _crash_at(point: str):
    def hook(p: str, path: Path) -> None:
        if p == point:
            if p == "rank-file-written" and path.name == "rank1.pt":
                path.write_bytes(path.read_bytes()[:100])  # died while writing it
                raise _Crash(p)
            if p != "rank-file-written":
                raise _Crash(p)
    return hook


@pytest.mark.parametrize("point,survivor", [("rank-file-written", "old"), ("manifest-written", "old"),
                                            ("old-moved", "new"), ("new-moved", "new")])
def test_crash_at_every_point_leaves_a_loadable_export(pm, good: Path, point: str, survivor: str,
                                                       monkeypatch) -> None:
    old_sha = json.loads((good / "MANIFEST.json").read_text())["files"]["rank0.pt"]["sha256"]
    with torch.no_grad():
        pm._full_state["fc1.weight"].add_(1.0)  # a different model, so the files differ
    try:
        monkeypatch.setattr(io, "_fault_hook", _crash_at(point))
        with pytest.raises(_Crash):
            pm.export(good)
        monkeypatch.setattr(io, "_fault_hook", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found, _ = io.resolve(good)
            parts = _read_export(good, 0, None)
        sha = json.loads((found / "MANIFEST.json").read_text())["files"]["rank0.pt"]["sha256"]
        assert (sha == old_sha) == (survivor == "old")
        assert parts.state["fc1.weight"][0].shape == (64, 64)
        assert any("interrupted" in str(w.message) for w in caught) == (point == "old-moved")
        # the next export finishes or discards the interrupted one and tidies up
        pm.export(good)
        _read(good)
        assert sorted(p.name for p in good.parent.iterdir()) == ["exp"]
    finally:
        with torch.no_grad():
            pm._full_state["fc1.weight"].sub_(1.0)


def test_export_refuses_to_replace_a_foreign_directory(pm, tmp_path: Path) -> None:
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "train.py").write_text("precious")
    with pytest.raises(ExportError, match="is not an autopar export"):
        pm.export(mine)
    assert (mine / "train.py").read_text() == "precious" and len(list(tmp_path.iterdir())) == 1


def test_reexport_over_an_old_format_export(pm, good: Path) -> None:
    (good / "MANIFEST.json").unlink()  # what an autopar without manifests wrote
    shutil.copy(good / "plan.json", good / "extra.txt")
    pm.export(good)
    assert not (good / "extra.txt").exists()
    _read(good)
