"""Device selection for the CUDA path, checked on the CPU: under NCCL each process
computes on ``cuda:LOCAL_RANK`` (torchrun's local rank) and selects it before the
process group starts; under gloo everything stays on the CPU.  (The path itself ran on
one H100 through benchmarks/gpu_smoke.py; see docs/benchmarks.md.)"""

from __future__ import annotations

import pytest
import torch

from autopar.runtime import mesh


def test_local_device_follows_local_rank(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mesh.local_device("nccl") == torch.device("cuda", 3)
    assert mesh.local_device("gloo") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    assert mesh.local_device("nccl") == torch.device("cuda", 0)


def test_nccl_selects_the_gpu_before_the_process_group(monkeypatch) -> None:
    calls = []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))

    def fake_init(backend, **kw):
        calls.append(("init", backend))
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch.distributed, "init_process_group", fake_init)
    with pytest.raises(RuntimeError, match="stop here"):
        mesh.init_mesh((2,), backend="nccl")
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "nccl")]


def test_captured_device_arguments_follow_the_rank_device() -> None:
    import sys

    sys.path.insert(0, "examples")
    import hf_zoo
    from autopar.passes.device import set_device

    from autopar.capture.trace import capture

    model, batch = hf_zoo.build("llama")
    gm = capture(model, (), batch).gm
    devices = lambda: {n.kwargs["device"] for n in gm.graph.nodes if "device" in n.kwargs}  # noqa: E731
    assert devices() == {torch.device("cpu")}  # export baked the capture device in
    assert set_device([gm], torch.device("cuda", 1)) == 1
    assert devices() == {torch.device("cuda", 1)}
    assert "device(type='cuda', index=1)" in gm.code
