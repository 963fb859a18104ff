"""Llama-3 70B on one node of 8 H100s (meta device, bf16-mixed) does not fit the devices
(131.9 GiB a device, ZeRO-3 and recomputation considered): the planner offloads, the
plan fits, and it states the host memory it takes (issue 48)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from autopar.cost_models import format_bytes

import autopar
from autopar import MeshSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


@pytest.mark.slow
def test_llama3_70b_on_8_h100_plans_with_offload() -> None:
    import hf_llama

    # Llama-3 70B: 80 layers, 8192 wide, 64 heads over 8 KV heads, MLP 28672, 128256 tokens;
    # one 2,048-token sequence per device
    model, _, batch = hf_llama.build(hidden=8192, layers=80, heads=64, kv_heads=8, vocab=128256,
                                  batch=8, seq=2048, meta=True, ffn=28672)
    mesh = MeshSpec.preset("8xH100-nvlink")
    p = autopar.plan(model, example_kwargs=batch, mesh=mesh, precision="bf16-mixed", batch="local")
    d = p.decisions
    assert d.offload in ("optimizer", "params")
    assert p.memory["total"] <= mesh.usable_memory
    assert 0 < d.host_memory <= mesh.host_memory
    why = p.explain("offload")
    assert why.startswith("nothing fits the devices without offload")
    assert f"{format_bytes(d.host_memory)} of host memory per device" in why
    assert "offload='none' needs" in why and "over the budget" in why
    assert "  offload        " in p.summary()
