"""Every ```python and ```bash block in README.md and docs/*.md runs as written.

Each block runs in a fresh process, in a scratch directory that holds a link to
``examples/``, so files the block writes land there, and files written by earlier
blocks of the same page (``plan.json`` from a python block, read by a shell block)
are there too: a page's blocks run in order in one directory.  A python block whose
first line is ``# torchrun --nproc-per-node N`` runs under ``torch.distributed.run``
with N ranks (marked slow); others run with plain ``python``.

Shell blocks run with ``bash -e`` and this interpreter's ``bin`` first on ``PATH``
(``autopar``, ``torchrun``).  Their environment set-up commands (``python3 -m venv``,
activating it, the pinned ``pip install`` lines) and the test command itself are what
``.ci/run`` runs verbatim, which :func:`test_setup_commands_are_what_ci_runs` checks;
they are taken out of the block, the rest runs.  A shell block that starts a
multi-rank job (``torchrun``, ``--nproc-per-node``, ``autopar run``) is marked slow.
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
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)
TORCHRUN = re.compile(r"#\s*torchrun --nproc-per-node (\d+)")
SETUP = ("python3 -m venv .venv", ". .venv/bin/activate", "pip install torch==2.13.0",
         'pip install -e ".[test]"', "HF_HUB_OFFLINE=1 python -m pytest -q")
"""Shell commands the docs give that ``.ci/run`` itself runs (set-up and the tests)."""


def blocks() -> list[tuple[str, str, str]]:
    """(``file:line``, language, code) of every python and bash block, page by page."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1), m.group(2)))
    return out


def shell_commands(code: str) -> list[str]:
    """The commands of a bash block left to run: set-up commands (:data:`SETUP`) out."""
    cmds = [c.strip() for line in code.replace("\\\n", " ").splitlines()
            for c in line.split(" && ") if c.strip() and not c.strip().startswith("#")]
    return [c for c in cmds if c not in SETUP]


SLOW_PAGES = ("docs/tutorial.md", "docs/launch.md", "docs/timeline.md")
"""Pages run whole in CI's slow step: the first two plan a 1B-wide Llama and start
multi-rank jobs (~1.5 min together), and their blocks share files, so they cannot be
split; the timeline's draw pictures of pipelined plans (~15 s on 2 cores)."""


def _slow(lang: str, code: str, where: str = "") -> bool:
    if where.startswith(SLOW_PAGES):
        return True
    if lang == "python":
        return TORCHRUN.match(code.splitlines()[0]) is not None
    return any("torchrun" in c or "--nproc-per-node" in c or c.startswith("autopar run")
               for c in shell_commands(code))


def _param(where: str, lang: str, code: str):
    marks = [pytest.mark.slow] if _slow(lang, code, where) else []
    return pytest.param(where, lang, code, id=where, marks=marks)


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory) -> dict[str, Path]:
    """One scratch directory per page, shared by its blocks (run in page order)."""
    return {}


def _workdir(page_dirs: dict[str, Path], where: str, factory) -> Path:
    page = where.rsplit(":", 1)[0]
    if page not in page_dirs:
        d = factory.mktemp(page.replace("/", "_"))
        (d / "examples").symlink_to(ROOT / "examples")
        page_dirs[page] = d
    return page_dirs[page]


@pytest.mark.parametrize("where, lang, code", [_param(*b) for b in blocks()])
def test_doc_block_runs(where: str, lang: str, code: str, page_dirs, tmp_path_factory) -> None:
    cwd = _workdir(page_dirs, where, tmp_path_factory)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if lang == "bash":
        cmds = shell_commands(code)
        if not cmds:
            pytest.skip("only set-up commands, which .ci/run runs (test_setup_commands_...)")
        cmd = ["bash", "-e", "-c", "\n".join(cmds)]
    else:
        script = cwd / "block.py"
        script.write_text(code)
        m = TORCHRUN.match(code.splitlines()[0])
        cmd = [sys.executable, str(script)] if m is None else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", m.group(1),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]


def test_setup_commands_are_what_ci_runs() -> None:
    """The set-up and test commands the docs give are run by .ci/run, in order."""
    ci = (ROOT / ".ci" / "run").read_text()
    flat = ci.replace("pip install -q ", "pip install ").replace("python -m pytest -q\n",
                                                                  "HF_HUB_OFFLINE=1 python -m pytest -q\n")
    assert "export HF_HUB_OFFLINE=1" in ci
    for cmd in SETUP:
        assert cmd in flat, cmd


def test_blocks_are_found() -> None:
    found = [w for w, _, _ in blocks()]
    assert any(w.startswith("README.md") for w in found)
    assert any(w.startswith("docs/training.md") for w in found)
