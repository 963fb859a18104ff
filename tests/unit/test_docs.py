"""Every ```python and ```bash block in README.md and docs/*.md runs as written.

Each block runs in a scratch directory that holds a link to ``examples/``, so files the
block writes land there, and files written by earlier blocks of the same page
(``plan.json`` from a python block, read by a shell block) are there too: a page's
blocks run in order in one directory.  A python block whose first line is ``# torchrun
--nproc-per-node N`` runs as torchrun runs it, with N ranks (marked slow); others as
plain ``python`` runs them.  Both on processes forked from a server that imported torch
and autopar once (:mod:`tests.dist.scripts`), each its own interpreter from there on.

Shell blocks run command by command, stopping at the first failure as ``bash -e``
does, with this interpreter's ``bin`` first on ``PATH`` (``autopar``, ``torchrun``): an
``autopar`` command, ``python X.py`` or ``torchrun --nproc-per-node N`` of either on
forked processes too (:func:`forkable`), anything else with ``bash``.  Their
environment set-up commands (``python3 -m venv``, activating it, the pinned ``pip
install`` lines) and the test command itself are what ``.ci/run`` runs verbatim, which
:func:`test_setup_commands_are_what_ci_runs` checks; they are taken out of the block,
the rest runs.  A shell block that starts a multi-rank job (``torchrun``,
``--nproc-per-node``, ``autopar run``) is marked slow.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
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


@functools.cache
def _cli_script() -> Path:
    """A file that runs the ``autopar`` console script's entry point, named ``autopar``
    (argparse names the program after it); made once per process."""
    script = Path(tempfile.mkdtemp(prefix="autopar-cli-")) / "autopar"
    script.write_text("import sys\nfrom autopar.cli import main\nsys.exit(main())\n")
    return script


def forkable(cmd: str, cwd: Path) -> tuple[Path, int | None, tuple[str, ...]] | None:
    """``(script, nproc, args)`` when shell command ``cmd`` is one plain process of
    ``autopar`` (not ``autopar run``, which starts torchrun itself) or ``python X.py``, or
    ``torchrun --nproc-per-node N`` of a script or (``--no-python``) of ``autopar``; it
    then runs on processes forked from the preloaded server (:mod:`tests.dist.scripts`)
    as it would from the shell.  Each fresh interpreter cost 5-8 s of CPU importing
    torch and autopar: 17 in the docs' shell blocks.  ``None``: run it with bash (shell
    syntax, other programs).  The launchers themselves are tested by
    tests/dist/test_torchrun.py and the ``autopar run`` blocks."""
    if any(ch in cmd for ch in "|<>;$`&*?()"):
        return None
    argv = shlex.split(cmd)
    nproc = None
    if argv[0] == "torchrun":
        if len(argv) < 4 or argv[1] != "--nproc-per-node" or not argv[2].isdigit():
            return None
        nproc, argv = int(argv[2]), argv[3:]
        if argv[0] == "--no-python":
            argv = argv[1:]
            if argv[0] != "autopar":
                return None
        elif argv[0].startswith("-"):
            return None  # another torchrun option: the real launcher
        else:
            argv = ["python", *argv]
    if argv[0] == "python" and len(argv) > 1 and argv[1].endswith(".py"):
        return cwd / argv[1], nproc, tuple(argv[2:])
    if argv[0] == "autopar" and argv[1:2] != ["run"]:
        return _cli_script(), nproc, tuple(argv[1:])
    return None


def _run_block(where: str, lang: str, code: str, cwd: Path) -> None:
    """Run one block in ``cwd`` (its page's directory) and fail with its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if lang == "bash":
        cmds = shell_commands(code)
        if not cmds:
            pytest.skip("only set-up commands, which .ci/run runs (test_setup_commands_...)")
        for c in cmds:  # in order, stopping at the first failure, as bash -e does
            forked = forkable(c, cwd)
            if forked is not None:
                status, out = run_script(forked[0], cwd, env, nproc=forked[1], args=forked[2])
                assert status == 0, f"$ {c}\n{out[-4000:]}"
                continue
            p = subprocess.run(["bash", "-e", "-c", c], cwd=cwd, capture_output=True, text=True,
                               env=env, timeout=400)
            assert p.returncode == 0, f"$ {c}\n{(p.stdout + p.stderr)[-4000:]}"
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


def test_forkable_takes_only_plain_commands(tmp_path: Path) -> None:
    """What runs forked and what still goes to bash (pipes, variables, other programs,
    ``autopar run`` and torchrun options beyond the rank count)."""
    cli = _cli_script()
    assert forkable("autopar plan x.py:build --mesh 2 --json p.json", tmp_path) == (
        cli, None, ("plan", "x.py:build", "--mesh", "2", "--json", "p.json"))
    assert forkable("torchrun --nproc-per-node 2 --no-python autopar calibrate --out m.json",
                    tmp_path) == (cli, 2, ("calibrate", "--out", "m.json"))
    assert forkable("torchrun --nproc-per-node 4 examples/gpt.py --mesh 2x2", tmp_path) == (
        tmp_path / "examples/gpt.py", 4, ("--mesh", "2x2"))
    assert forkable('autopar launch --setup "source a b" -o j.sbatch', tmp_path)[2] == (
        "launch", "--setup", "source a b", "-o", "j.sbatch")
    for cmd in ("autopar run --plan p.json x.py", "autopar plan x | head", "cat job.yaml",
                "bash -n job.sbatch", "torchrun --nnodes 2 --nproc-per-node 2 x.py",
                "torchrun --nproc-per-node 2 --no-python echo hi", "autopar plan $X"):
        assert forkable(cmd, tmp_path) is None, cmd
    assert cli.name == "autopar" and "from autopar.cli import main" in cli.read_text()
