"""Run a user's script as ``python script.py`` or ``torchrun --nproc-per-node N
script.py`` would, on ranks forked from the harness's fork server.

The docs' blocks are scripts a user runs.  Started fresh, each process (and torchrun's
launcher) spends 4-8 s of CPU importing torch, autopar and transformers before the
block's first line; on CI's 2 cores that was most of the docs' time.  Here each process
forks from the server that imported them once (:func:`tests.dist.harness.forkserver`) and
then is what torchrun makes: its own interpreter state from there on, ``__main__`` run
from the file, the working directory, the environment torchrun sets (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*``;
rank 0 hosts the store, as under torchrun's ``--no-agent-store`` path), its exit status
and its output.  As torchrun does, when a rank fails the others are stopped.  The real
``torchrun`` and ``autopar run`` are still what the docs' shell blocks start, and
``tests/dist/test_torchrun.py`` covers the launcher.

What a forked process cannot show: a script that sets something torch reads when it is
first imported (an environment variable such as ``TORCH_LOGS``) before its own ``import
torch``.  No block of the docs does; one that did would run with ``python`` instead.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from tests.dist.harness import forkserver, free_port


def _rank_main(script: str, cwd: str, env: dict[str, str], log: str,
               args: tuple[str, ...] = ()) -> None:
    """One process: output to ``log``, the script as ``__main__``, its status as the
    process's exit code."""
    import runpy
    import traceback

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[0:0] = [os.path.dirname(os.path.abspath(script))]  # as python puts it first
    code = 0
    try:
        import torch
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the script's error is its output, as python prints it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # no C++ static destructors (see tests.dist.harness._worker)
    os._exit(code)


def run_script(script: Path, cwd: Path, env: dict[str, str], nproc: int | None = None,
               timeout: float = 400.0, args: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run ``script`` in ``cwd`` with ``env`` and command-line ``args``: one plain
    process (``nproc`` None) or ``nproc`` ranks set up as torchrun sets them up.
    Returns the exit status (the first failing rank's, else 0) and the processes'
    output, rank by rank."""
    ctx = forkserver()
    world = nproc or 1
    envs = []
    port = str(free_port())
    for rank in range(world):
        e = dict(env)
        if nproc is not None:
            e.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                     ROLE_NAME="default", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                     ROLE_WORLD_SIZE=str(world), GROUP_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                     TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0",
                     TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_USE_AGENT_STORE="False")
        envs.append(e)
    with tempfile.TemporaryDirectory() as d:
        logs = [os.path.join(d, f"rank{r}.log") for r in range(world)]
        procs = [ctx.Process(target=_rank_main,
                             args=(str(script), str(cwd), envs[r], logs[r], tuple(args)))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline, status, note = time.monotonic() + timeout, 0, ""
        while any(p.is_alive() for p in procs):
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed and not status:
                status = failed[0]
                # torchrun stops the rest; a few seconds to print their own errors
                deadline = min(deadline, time.monotonic() + 5)
            if time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                if not status:
                    status, note = -9, f"[stopped: still running after {timeout:g} s]\n"
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        status = status or next((p.exitcode for p in procs if p.exitcode), 0)
        # a process that died before it opened its log (its start failed) has none
        out = "".join((f"[rank {r}]\n" if nproc else "")
                      + (Path(log).read_text() if os.path.exists(log) else "(no output)\n")
                      for r, log in enumerate(logs)) + note
    return status, out
