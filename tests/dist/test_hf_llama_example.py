"""examples/hf_llama.py as torchrun runs it (2 ranks, tests/dist/scripts.py: forked
from a server that imported torch, autopar and transformers once, with torchrun's
environment): trains a Hugging Face Llama with an ordinary loop, writes DCP
checkpoints, and a second run resumes from the last one.  The real launcher starts it
in docs/tutorial.md (``autopar run --nproc-per-node 2 examples/hf_llama.py``) and in
tests/dist/test_torchrun.py.

Resuming must be exact: steps 4-6 of a run that stopped after step 3 and resumed equal
steps 4-6 of one uninterrupted run (same sampler order, LR schedule, optimizer state and
weights), up to fp32 reordering between processes (rtol 1e-5)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.dist.harness import ROOT
from tests.dist.scripts import run_script


def _run(steps: int, ckpt: Path, nproc: int = 2, said: list[str] | None = None) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    status, out = run_script(ROOT / "examples/hf_llama.py", ROOT, env, nproc=nproc, timeout=300,
                             args=("--steps", str(steps), "--every", "3", "--ckpt", str(ckpt)))
    assert status == 0, out[-4000:]
    assert "eval loss" in out
    if said is not None:
        said.append(out)
    return [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", out, re.M)]


@pytest.mark.slow
def test_llama_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    full = _run(6, tmp_path / "a")
    assert len(full) == 6 and full[-1] < full[0]  # it learns
    first = _run(3, tmp_path / "b")
    resumed = _run(6, tmp_path / "b")  # starts from the step-3 checkpoint
    assert first == pytest.approx(full[:3], rel=1e-5)
    assert resumed == pytest.approx(full[3:], rel=1e-5)
    # a rank lost: the step-3 checkpoint of 2 ranks resumes on 1, its plan made for one
    # device.  The sampler's global batches are the same in both worlds (2 ranks take
    # alternate indices of the same shuffled order), so steps 4-6 equal the uninterrupted
    # run's up to fp32 sums in another order (rel 1e-5)
    _run(3, tmp_path / "c")
    said: list[str] = []
    alone = _run(6, tmp_path / "c", nproc=1, said=said)
    assert alone == pytest.approx(full[3:], rel=1e-5)
    assert "saved on 2 ranks, resumed on 1" in said[0] and "keeping the global batch of 8" in said[0]
