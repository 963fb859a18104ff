"""``compile=``'s default and its fallback: compiled by default where the module computes
on a GPU (NCCL), eager on a CPU (gloo); a compile that fails runs eagerly with one
:class:`CompileFallbackWarning`, never a crash.  On a one-rank gloo group in this
process (the module's collectives are those of tests/dist)."""

from __future__ import annotations

import datetime
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.api import compiles
from autopar.errors import CompileFallbackWarning
from autopar.runtime.compile_fallback import CompiledOrEager
from autopar.runtime.mesh import reset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import mlp  # noqa: E402


def _boom(gm, example_inputs):
    """A ``torch.compile`` backend that fails, as a missing compiler does."""
    raise RuntimeError("no compiler here")


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "0")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    reset()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    reset()


def test_default_compiles_on_a_gpu_mesh_and_not_on_a_cpu(one_rank, monkeypatch) -> None:
    assert compiles(None) is False  # gloo: the CPU
    assert compiles(True) is True and compiles(False) is False
    model, (x, y) = mlp.build()
    pm = autopar.auto_parallel(model, example_inputs=(x, y), mesh=(1,))
    assert not pm.compiled  # the default on a CPU
    pm.shutdown()
    # a CUDA process group (what torchrun on GPUs gives): compiled unless compile=False
    with monkeypatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(dist, "is_initialized", lambda: True)
        mp.setattr(dist, "get_backend", lambda *a, **k: "nccl")
        assert compiles(None) is True and compiles(False) is False


def test_a_failing_compile_runs_eagerly_with_one_warning(one_rank) -> None:
    model, (x, y) = mlp.build()
    pm = autopar.auto_parallel(model, example_inputs=(x, y), mesh=(1,), compile=False)
    want = pm(x, y)
    want.backward()
    grads = [p.grad.full_tensor().clone() for p in pm.parameters()]
    pm.zero_grad(set_to_none=True)
    pm.compile(backend=_boom)
    assert pm.compiled
    with pytest.warns(CompileFallbackWarning, match="no compiler here"):
        got = pm(x, y)
    got.backward()
    # the same eager graph on the same numbers: bit-identical, no tolerance needed
    assert torch.equal(got.detach(), want.detach())
    assert all(torch.equal(p.grad.full_tensor(), g) for p, g in zip(pm.parameters(), grads))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the next call runs eagerly, quietly
        pm(x, y)
    assert pm._compiled.failure and "no compiler here" in pm._compiled.failure
    assert not pm.compiled  # it says what runs now: the eager graph
    pm.shutdown()


def test_the_users_error_is_raised_as_it_is() -> None:
    def bad(x):
        return x @ torch.ones(3, 3)  # wrong inner size for a (2, 2) input: eager fails too

    f = CompiledOrEager(bad, "a test function", backend=_boom)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied|size mismatch|mat1"):
            f(torch.ones(2, 2))
    assert f.failure is None  # not blamed on the compiler
    ok = CompiledOrEager(torch.sin, "sin", backend=_boom)
    with pytest.warns(CompileFallbackWarning):
        assert torch.equal(ok(torch.ones(2)), torch.sin(torch.ones(2)))


def test_the_plan_is_priced_as_compile_resolves(one_rank) -> None:
    """The plan records what runs (decision ``compile``): eager by default on a CPU,
    compiled under ``compile=True``, and a given plan runs as ``compile=`` says."""
    model, (x, y) = mlp.build()
    eager = autopar.auto_parallel(model, example_inputs=(x, y), mesh=(1,))
    assert not eager.plan.decisions.compile and not eager.compiled
    model, (x, y) = mlp.build()
    pm = autopar.auto_parallel(model, example_inputs=(x, y), mesh=(1,), compile=True)
    assert pm.plan.decisions.compile and pm.compiled
    model, (x, y) = mlp.build()
    given = autopar.auto_parallel(model, example_inputs=(x, y), plan=eager.plan, compile=True)
    assert given.plan.decisions.compile and given.compiled
    assert not eager.plan.decisions.compile  # the caller's plan is left as it was
    # plan.explain("compile") says what runs: the searched plans and the re-marked one
    assert eager.plan.explain("compile").startswith("eager")
    assert pm.plan.explain("compile").startswith("compiled")
    assert given.plan.explain("compile").startswith("compiled")
    assert eager.plan.explain("compile").startswith("eager")
    given.shutdown()  # the process group, which the three share
