"""Every ```python block in README.md and docs/*.md runs as written.

Each block runs in a fresh process, in a scratch directory that holds a link to
``examples/``, so files the block writes land there.  A block whose first line is
``# torchrun --nproc-per-node N`` runs under ``torch.distributed.run`` with N ranks
(those are marked slow); others run with plain ``python``.  Shell blocks are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
TORCHRUN = re.compile(r"#\s*torchrun --nproc-per-node (\d+)")


def blocks() -> list[tuple[str, str]]:
    """(``file:line``, code) of every python block."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1)))
    return out


def _param(where: str, code: str):
    marks = [pytest.mark.slow] if TORCHRUN.match(code.splitlines()[0]) else []
    return pytest.param(code, id=where, marks=marks)


@pytest.mark.parametrize("code", [_param(w, c) for w, c in blocks()])
def test_doc_block_runs(code: str, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = tmp_path / "block.py"
    script.write_text(code)
    m = TORCHRUN.match(code.splitlines()[0])
    cmd = [sys.executable, str(script)] if m is None else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", m.group(1),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]


def test_blocks_are_found() -> None:
    found = [w for w, _ in blocks()]
    assert any(w.startswith("README.md") for w in found)
    assert any(w.startswith("docs/training.md") for w in found)
