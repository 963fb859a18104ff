"""``autopar calibrate`` under torchrun: rank 0 writes a MeshSpec JSON that ``--mesh-json``
takes, with the calibration record; outside torchrun it is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from autopar.cost_models import MeshSpec

from tests.dist.harness import ROOT, free_port, run_fn_cases


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow  # ~10 s: torchrun start-up and one calibration on 2 ranks
def test_calibrate_under_torchrun_writes_a_mesh_plan_reads(tmp_path: Path) -> None:
    out = tmp_path / "mesh.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "autopar.cli",
           "calibrate", "--out", str(out), "--repeats", "2", "--sizes", "4KiB,256KiB", "--keep"]
    cache = tmp_path / "cache"
    p = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), "AUTOPAR_CACHE_DIR": str(cache)},
                       timeout=240, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert p.stdout.count("mesh written to") == 1, p.stdout  # rank 0 only
    spec = MeshSpec.from_json(out)
    assert spec.name == "calibrated" and spec.shape == (2,)
    record = json.loads(out.read_text())["calibration"]
    assert record["world"] == 2 and record["backend"] == "gloo"
    assert sorted(record["curves"]) == sorted(f"axis0/{k}" for k in (
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"))
    # --keep: the same calibration kept as this cluster's, for auto_parallel's default
    assert p.stdout.count("kept as this cluster's calibration") == 1, p.stdout
    (kept,) = cache.glob("calibration-*.json")
    kept_d = json.loads(kept.read_text())
    assert kept_d["calibration"]["key"]["world"] == 2 and kept_d["calibration"]["quick"] is False
    assert MeshSpec.from_dict(kept_d) == spec
    # the file plans: autopar plan --mesh-json takes it as it is
    plan = subprocess.run([sys.executable, "-m", "autopar.cli", "plan",
                           str(ROOT / "examples/gpt.py:build"), "--factory-args", "layers=1",
                           "dim=32", "--mesh-json", str(out), "--quiet"],
                          capture_output=True, text=True, env=_env(), timeout=240, cwd=tmp_path)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-4000:]
    assert "calibrated" in plan.stdout


def test_calibrate_outside_torchrun_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    # in this process (a fresh interpreter spent 6 s importing torch for one message)
    from autopar.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--out", "m.json"]) == 2
    assert "run it under torchrun" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def measure_two_axes(_case: dict) -> list[str]:
    """On each of 4 ranks (tests/dist/harness.py's group): calibrate a 2x2 mesh; every
    rank's MeshSpec JSON, gathered."""
    import torch.distributed as dist
    from autopar.cost_models import measure_cluster

    record = measure_cluster(sizes=(2**12, 2**16), repeats=2, shape=(2, 2))
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, record.spec.to_json())
    return out


@pytest.mark.slow  # 4 ranks, two axes of two groups each
def test_two_axis_calibration_is_the_same_on_every_rank() -> None:
    """Each rank times its own axis group (for axis 0, ranks {0, 2} and {1, 3}); the
    numbers are still taken over the whole job, so every rank plans with the same mesh
    (a difference would make ranks plan differently and hang)."""
    r = run_fn_cases(4, "tests.dist.test_calibrate_cli:measure_two_axes", [{"id": "m"}])["m"]
    assert not (isinstance(r, dict) and "error" in r), r
    specs = [MeshSpec.from_json(j) for j in r]
    assert all(s == specs[0] for s in specs[1:])
    assert specs[0].shape == (2, 2) and len(specs[0].links) == 2
    assert all(len(link.kinds) == 4 for link in specs[0].links)
