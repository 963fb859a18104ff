"""examples/hf_llama.py under a real torchrun: trains a Hugging Face Llama with an
ordinary loop, writes DCP checkpoints, and a second run resumes from the last one.

Resuming must be exact: steps 4-6 of a run that stopped after step 3 and resumed equal
steps 4-6 of one uninterrupted run (same sampler order, LR schedule, optimizer state and
weights), up to fp32 reordering between processes (rtol 1e-5)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import ROOT, free_port


def _run(steps: int, ckpt: Path) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "examples/hf_llama.py"), "--steps", str(steps), "--every", "3",
           "--ckpt", str(ckpt)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "eval loss" in p.stdout
    return [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", p.stdout, re.M)]


@pytest.mark.slow
def test_llama_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    full = _run(6, tmp_path / "a")
    assert len(full) == 6 and full[-1] < full[0]  # it learns
    first = _run(3, tmp_path / "b")
    resumed = _run(6, tmp_path / "b")  # starts from the step-3 checkpoint
    assert first == pytest.approx(full[:3], rel=1e-5)
    assert resumed == pytest.approx(full[3:], rel=1e-5)
