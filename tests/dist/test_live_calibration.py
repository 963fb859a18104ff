"""Live calibration by default (``autopar.cost_models.live``) on 2 real gloo ranks.

``auto_parallel`` with no mesh description named measures the running job once, keeps
the numbers on disk, plans on rank 0's copy on every rank and says so in the summary;
``calibrate=False``, ``AUTOPAR_CALIBRATE=0`` or a named preset plan on the preset; a
cache file that cannot be used is measured again, never planned on.  (The rest of the
suite runs with ``AUTOPAR_CALIBRATE=0``: tests/conftest.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.dist.harness import run_fn_cases


def _numbers(spec) -> dict:
    """A MeshSpec's numbers without its name (which says where they came from)."""
    d = spec.to_dict()
    d.pop("name")
    return d


def _gathered(value) -> list:
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def live_cases(case: dict) -> dict:
    """One of the cases below, on every rank; rank 0 returns what the test checks."""
    import mlp
    import torch
    import torch.distributed as dist
    from autopar.cost_models import MeshSpec
    from autopar.cost_models.live import cache_path, cluster_key, live_mesh

    from autopar import auto_parallel
    from autopar.runtime.mesh import reset

    reset()
    os.environ.pop("AUTOPAR_CALIBRATE", None)  # the user's default
    cache = Path(case["dir"]) / f"rank{dist.get_rank()}" if case.get("per_rank") else Path(case["dir"])
    os.environ["AUTOPAR_CACHE_DIR"] = str(cache)
    torch.manual_seed(0)
    model, (x, y) = mlp.build()
    expected = float(model(x, y))
    out: dict = {}
    if case["id"] == "default":
        first = auto_parallel(model, example_inputs=(x, y))
        loss = float(first(x, y))
        path = cache_path(cluster_key((2,)))
        kept = json.loads(path.read_text()) if path.exists() else {}
        second = auto_parallel(model, example_inputs=(x, y))
        out = {"first": first.plan.mesh.name, "second": second.plan.mesh.name,
               "same_numbers": _numbers(first.plan.mesh) == _numbers(second.plan.mesh),
               "kept_numbers": bool(kept) and _numbers(MeshSpec.from_dict(kept)) == _numbers(first.plan.mesh),
               "kept_quick": kept.get("calibration", {}).get("quick"),
               "kept_key": kept.get("calibration", {}).get("key") == cluster_key((2,)),
               "summary": first.plan.summary(), "loss": loss, "expected": expected,
               "meshes": _gathered(first.plan.mesh.to_json())}
    elif case["id"] == "rank0":
        # each rank its own cache directory; rank 1's holds a file for this very cluster
        # whose numbers are off by 1000x: only rank 0's may be planned on
        key = cluster_key((2,))
        live_mesh((2,))  # measured on both, kept in rank 0's directory only
        if dist.get_rank() == 1:
            bogus = MeshSpec.preset("cpu-gloo", shape=(2,)).to_dict()
            bogus["peak_flops"] *= 1000.0
            bogus["calibration"] = {"key": key, "when": "never"}
            cache_path(key).parent.mkdir(parents=True, exist_ok=True)
            cache_path(key).write_text(json.dumps(bogus))
        dist.barrier()
        spec = live_mesh((2,))
        out = {"numbers": _gathered(_numbers(spec)), "name": spec.name}
    elif case["id"] == "opt-out":
        names = {}
        names["calibrate=False"] = auto_parallel(model, example_inputs=(x, y), calibrate=False).plan.mesh.name
        names["preset"] = auto_parallel(model, example_inputs=(x, y), mesh="cpu-gloo").plan.mesh.name
        os.environ["AUTOPAR_CALIBRATE"] = "0"
        names["env"] = auto_parallel(model, example_inputs=(x, y), mesh=2).plan.mesh.name
        out = {"names": names, "files": sorted(p.name for p in cache.glob("*")) if cache.exists() else []}
    elif case["id"] == "kept":
        # what `autopar calibrate --keep` keeps (measured here quick, for time) is what the
        # default then plans on, without measuring
        from autopar.cost_models import measure_cluster
        from autopar.cost_models.live import keep
        record = measure_cluster(repeats=1, quick=True)
        path = keep(record, (2,))
        spec = auto_parallel(model, example_inputs=(x, y)).plan.mesh
        out = {"path": str(path), "name": spec.name,
               "same": _numbers(spec) == _numbers(MeshSpec.from_dict(record.spec.to_dict()))}
    elif case["id"] == "corrupt":
        path = cache_path(cluster_key((2,)))
        if dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{not json")
        dist.barrier()
        spec = live_mesh((2,))
        out = {"name": spec.name, "rewritten": MeshSpec.from_json(str(path)).peak_flops == spec.peak_flops}
    return out


def test_live_calibration(tmp_path) -> None:
    cases = [{"id": "default", "dir": str(tmp_path / "default")},
             {"id": "rank0", "dir": str(tmp_path / "rank0"), "per_rank": True},
             {"id": "opt-out", "dir": str(tmp_path / "opt-out")},
             {"id": "kept", "dir": str(tmp_path / "kept")},
             {"id": "corrupt", "dir": str(tmp_path / "corrupt")}]
    out = run_fn_cases(2, "tests.dist.test_live_calibration:live_cases", cases)
    for c in cases:
        assert "error" not in out[c["id"]], out[c["id"]].get("error")

    d = out["default"]
    # measured the first time, read back the second, the same numbers both times
    assert d["first"].startswith("calibrated on this job's 2 gloo ranks in"), d["first"]
    assert d["second"].startswith("calibrated on this cluster's 2 gloo ranks at"), d["second"]
    assert "kept in" in d["second"] and d["same_numbers"]
    # the file holds what the plan was priced on, measured quick, for this cluster's key
    assert d["kept_numbers"] and d["kept_quick"] is True and d["kept_key"]
    # the summary names the numbers; every rank planned on the same mesh
    assert "priced on      calibrated on this job's 2 gloo ranks" in d["summary"], d["summary"]
    assert "preset cpu-gloo" not in d["summary"]
    assert d["meshes"][0] == d["meshes"][1]
    # the module trains the model it was given (float32 mean over the batch: 1e-5)
    assert abs(d["loss"] - d["expected"]) <= 1e-5 * max(1.0, abs(d["expected"]))

    r = out["rank0"]
    # rank 1's own (bogus) file was not read: both ranks hold rank 0's kept numbers
    assert r["numbers"][0] == r["numbers"][1]
    assert "kept in" in r["name"] and r["numbers"][1]["peak_flops"] < 1e13

    o = out["opt-out"]
    assert o["names"] == {"calibrate=False": "cpu-gloo", "preset": "cpu-gloo", "env": "cpu-gloo"}
    assert o["files"] == []  # nothing measured, nothing kept

    k = out["kept"]
    assert k["path"].startswith(str(tmp_path / "kept")) and k["same"]
    assert k["name"].startswith("calibrated on this cluster's 2 gloo ranks at") and k["path"] in k["name"]

    c = out["corrupt"]
    # the unreadable file was measured again (not planned on, not fatal) and replaced
    assert c["name"].startswith("calibrated on this job's 2 gloo ranks in") and c["rewritten"]
