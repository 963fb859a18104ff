"""Learning from measured steps (``cost_models.refine``): the scales that make stored
predictions match their measurements, and the mesh they rescale."""

from __future__ import annotations

import json
import random

import pytest
from autopar.cost_models import (
    LinkSpec,
    MeshSpec,
    all_reduce_time,
    blocking_time,
    collective_time,
    compute_time,
)
from autopar.cost_models.refine import fit_scales, read_rows, refine


def _row(mesh: MeshSpec, compute: float, comm: float, measured: float, fixed: float = 0.01) -> dict:
    return {"mesh": mesh.to_dict(), "measured_seconds": measured,
            "predicted_breakdown": {"compute_seconds": compute, "exposed_comm_seconds": comm,
                                    "bubble_seconds": fixed / 2, "optimizer_seconds": fixed / 2}}


def _calibrated() -> MeshSpec:
    link = LinkSpec(1e-3, 1e9, kinds=(("reduce_scatter", 2e-3, 5e8),))
    return MeshSpec(shape=(4,), axis_names=(), links=(link,), peak_flops=4e10,
                    mem_bandwidth=8e9, mem_capacity=2**33, flops_efficiency=1.0,
                    name="calibrated", sync_seconds=2e-3)


def test_fit_recovers_the_scales_of_a_noiseless_machine() -> None:
    mesh = _calibrated()
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        c, x = rng.uniform(0.05, 0.3), rng.uniform(0.0, 0.2)
        rows.append(_row(mesh, c, x, 1.5 * c + 2.0 * x + 0.01))
    a, b = fit_scales(rows)
    assert a == pytest.approx(1.5, rel=1e-9) and b == pytest.approx(2.0, rel=1e-9)


def test_scales_stay_non_negative() -> None:
    """Measurements that fall as communication grows would ask for a negative scale;
    non-negative least squares drops that term instead."""
    mesh = _calibrated()
    rows = [_row(mesh, 0.1, 0.0, 0.2), _row(mesh, 0.1, 0.1, 0.15), _row(mesh, 0.2, 0.2, 0.3)]
    a, b = fit_scales(rows)
    assert a > 0 and b >= 0
    assert fit_scales([_row(mesh, 0.1, 0.0, 0.21)]) == (pytest.approx(2.0), 1.0)  # no comm: b stays


def test_refined_mesh_prices_compute_and_every_link_by_the_scales() -> None:
    mesh = _calibrated()
    rng = random.Random(1)
    rows = [_row(mesh, c, x, 1.25 * c + 3.0 * x + 0.01)
            for c, x in ((rng.uniform(0.05, 0.3), rng.uniform(0.01, 0.2)) for _ in range(6))]
    other = MeshSpec.preset("cpu-gloo", shape=(4,))
    rows += [_row(other, 0.1, 0.1, 5.0)] * 3  # another machine: ignored
    r = refine(mesh, rows)
    assert r.rows == 6 and r.compute_scale == pytest.approx(1.25) and r.comm_scale == pytest.approx(3.0)
    assert r.error_after < 1e-9 < r.error_before
    s = r.spec
    assert compute_time(s, 1e9, 0.0) == pytest.approx(1.25 * compute_time(mesh, 1e9, 0.0))
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        assert collective_time(kind, s, 0, 2.0**20) == pytest.approx(
            3.0 * collective_time(kind, mesh, 0, 2.0**20))
        # the drift a blocking collective waits out is communication, scaled alike
        assert blocking_time(kind, s, 0, 2.0**20) == pytest.approx(
            3.0 * blocking_time(kind, mesh, 0, 2.0**20))
    # a plan on the same machine reshaped (2x2) still counts as priced with it
    reshaped = [_row(mesh.with_shape((2, 2)), 0.1, 0.05, 0.1 * 1.25 + 0.05 * 3 + 0.01)] * 3
    assert refine(mesh, reshaped).rows == 3


def test_hierarchical_links_scale_at_every_level() -> None:
    mesh = MeshSpec.preset("multinode-h100-ib", shape=(16,))
    rows = [_row(mesh, c, x, 1.0 * c + 2.0 * x + 0.01) for c, x in ((0.1, 0.05), (0.2, 0.02), (0.05, 0.1))]
    s = refine(mesh, rows).spec
    assert all_reduce_time(s, 0, 2.0**26) == pytest.approx(2.0 * all_reduce_time(mesh, 0, 2.0**26))
    assert MeshSpec.from_json(s.to_json()) == s


def test_too_few_rows_and_bad_files_are_clear_errors(tmp_path) -> None:
    mesh = _calibrated()
    with pytest.raises(ValueError, match="at least 3 measured plans"):
        refine(mesh, [_row(mesh, 0.1, 0.1, 0.3)] * 2)
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps(_row(mesh, 0.1, 0.1, 0.3)) + "\nnot json\n")
    with pytest.raises(ValueError, match="m.jsonl:2"):
        read_rows(p)


def test_cli_refines_a_mesh_from_stored_measurements(tmp_path) -> None:
    from autopar.cli.main import main

    mesh = _calibrated()
    mesh.to_json(tmp_path / "mesh.json")
    rows = [_row(mesh, c, x, 2.0 * c + 1.0 * x + 0.01) for c, x in ((0.1, 0.05), (0.2, 0.02), (0.05, 0.1))]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mesh2.json"
    assert main(["calibrate", "--refine", str(tmp_path / "mesh.json"), "--measurements",
                 str(tmp_path / "m.jsonl"), "--out", str(out)]) == 0
    refined = MeshSpec.from_json(out)
    assert refined.peak_flops == pytest.approx(mesh.peak_flops / 2) and refined.name == "calibrated+refined"
    assert main(["calibrate", "--refine", str(tmp_path / "mesh.json")]) == 2  # no measurements
