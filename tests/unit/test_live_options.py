"""What decides whether ``auto_parallel`` calibrates the running job, and where it keeps it
(``autopar.cost_models.live``; the measuring itself: tests/dist/test_live_calibration.py)."""

from __future__ import annotations

import pytest
from autopar.cost_models import MeshSpec
from autopar.cost_models.live import cache_dir, default_on, key_digest

from autopar.api import _calibration
from autopar.errors import ConfigError
from autopar.validate import describes_machine, mesh

KEY = {"version": 1, "world": 4, "shape": [4], "backend": "gloo", "torch": "2.13.0",
       "ranks": [["vm", "cpu x2", 1]] * 4}


@pytest.mark.parametrize("value, described", [
    (None, False), (4, False), ("2x2", False), ((2, 2), False), ("8", False),
    ("cpu-gloo", True), ('{"shape": [2]}', True), ("mesh.json", True),
    (MeshSpec.preset("cpu-gloo", shape=(2,)), True)])
def test_a_shape_names_no_machine(value, described) -> None:
    assert describes_machine(value) is described


def test_calibration_follows_the_argument_the_mesh_and_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("AUTOPAR_CALIBRATE", raising=False)
    assert default_on()
    shape = mesh("2x2")
    assert _calibration(None, "2x2", shape) is not None  # a shape: measured
    assert _calibration(None, None, shape) is not None
    assert _calibration(None, "cpu-gloo", mesh("cpu-gloo")) is None  # a preset: as given
    assert _calibration(False, None, shape) is None
    given = MeshSpec.preset("cpu-gloo", shape=(2,))
    forced = _calibration(True, given, given)
    assert forced is not None and forced.base is given  # what is not measured comes from it
    for off in ("0", "off", "OFF"):
        monkeypatch.setenv("AUTOPAR_CALIBRATE", off)
        assert not default_on() and _calibration(None, None, shape) is None
        assert _calibration(True, None, shape) is not None  # the argument wins
    with pytest.raises(ConfigError, match="calibrate='yes'"):
        _calibration("yes", None, shape)
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "refresh")
    assert default_on()
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "nope")  # a typo decides nothing silently
    with pytest.raises(ConfigError, match="AUTOPAR_CALIBRATE='nope'"):
        _calibration(None, None, shape)


def test_the_cache_key_names_the_cluster(monkeypatch, tmp_path) -> None:
    assert key_digest(KEY) == key_digest(dict(reversed(list(KEY.items()))))  # order-free
    for field, other in (("world", 8), ("shape", [2, 2]), ("torch", "2.12.0"), ("backend", "nccl"),
                         ("ranks", [["vm", "cpu x2", 2]] * 4), ("version", 2)):
        assert key_digest({**KEY, field: other}) != key_digest(KEY), field
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "here"))
    assert cache_dir() == tmp_path / "here"
    monkeypatch.delenv("AUTOPAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "autopar"


def test_a_shape_on_a_gpu_is_priced_as_that_gpu(monkeypatch) -> None:
    # a shape named on a CUDA host was priced on cpu-gloo (8 GiB, CPU rates), and live
    # calibration kept that memory: now the GPU's preset figures with its memory, as None is
    import types

    import torch
    monkeypatch.delenv("AUTOPAR_CALIBRATE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30))
    for value, shape in (("2x4", (2, 4)), (8, (8,)), (None, (1,))):
        m = mesh(value)
        assert m.shape == shape and m.mem_capacity == 141 * 2**30, (value, m)
        assert "H200" in m.name and m.name.startswith("8xH100-nvlink figures")
    assert _calibration(None, "2x4", mesh("2x4")).base.mem_capacity == 141 * 2**30
