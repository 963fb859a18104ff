"""Every ```python and ```bash block in README.md and docs/*.md runs as written.

Each block runs in a scratch directory that holds a link to ``examples/``, so files the
block writes land there, and files written by earlier blocks of the same page
(``plan.json`` from a python block, read by a shell block) are there too: a page's
blocks run in order in one directory.  A python block whose first line is ``# torchrun
--nproc-per-node N`` runs as torchrun runs it, with N ranks (marked slow); others as
plain ``python`` runs them.  Both on processes forked from a server that imported torch
and autopar once (:mod:`tests.dist.scripts`), each its own interpreter from there on.

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

from tests.dist.scripts import run_script

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


def _run_block(where: str, lang: str, code: str, cwd: Path) -> None:
    """Run one block in ``cwd`` (its page's directory) and fail with its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if lang == "bash":
        cmds = shell_commands(code)
        if not cmds:
            pytest.skip("only set-up commands, which .ci/run runs (test_setup_commands_...)")
        cmd = ["bash", "-e", "-c", "\n".join(cmds)]
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=400)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        return
    script = cwd / "block.py"
    script.write_text(code)
    m = TORCHRUN.match(code.splitlines()[0])
    # as `python block.py` / `torchrun --nproc-per-node N block.py`, on processes forked
    # from a server that imported torch and autopar once (tests/dist/scripts.py)
    status, out = run_script(script, cwd, env, nproc=None if m is None else int(m.group(1)))
    assert status == 0, out[-4000:]


def _page_class(page: str, params: list) -> type:
    """A test class for one page: its blocks in page order, in one scratch directory
    (made on the first block) that holds a link to ``examples/``.  A class, because
    CI's ``--dist loadscope`` keeps a class on one worker (a page's blocks share files)
    while different pages run on different workers."""

    @pytest.mark.parametrize("where, lang, code", params)
    def test_block_runs(self, where: str, lang: str, code: str, tmp_path_factory) -> None:
        cls = type(self)
        if cls.cwd is None:
            cls.cwd = tmp_path_factory.mktemp(page.replace("/", "_"))
            (cls.cwd / "examples").symlink_to(ROOT / "examples")
        _run_block(where, lang, code, cls.cwd)

    name = "TestPage" + "".join(w.capitalize() for w in re.split(r"[^A-Za-z0-9]+", page) if w)
    return type(name, (), {"__doc__": f"The blocks of {page}, in order.", "cwd": None,
                           "test_block_runs": test_block_runs})


def _pages() -> dict[str, list]:
    pages: dict[str, list] = {}
    for where, lang, code in blocks():
        pages.setdefault(where.rsplit(":", 1)[0], []).append(_param(where, lang, code))
    return pages


for _page, _params in _pages().items():
    _cls = _page_class(_page, _params)
    globals()[_cls.__name__] = _cls


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


def test_no_block_sets_the_environment() -> None:
    """python blocks run forked from a process that imported torch already
    (tests/dist/scripts.py): a block that set an environment variable torch reads at
    import would not see it take effect there, so none may (it would need a fresh
    ``python``)."""
    for where, lang, code in blocks():
        if lang == "python":
            assert "os.environ" not in code and "putenv" not in code, where
