"""The runner the docs' blocks use (tests/dist/scripts.py) behaves as ``python`` and
``torchrun`` do where a block can tell: exit status, output, working directory, the
ranks' environment and process group, and a failing rank stopping the others."""

from __future__ import annotations

import os
import time

from tests.dist.scripts import run_script

ENV = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}


def _script(tmp_path, code: str):
    p = tmp_path / "block.py"
    p.write_text(code)
    return p


def test_status_output_and_directory(tmp_path):
    s = _script(tmp_path, "import os, sys\nprint('cwd', os.getcwd())\n"
                          "print('main', __name__, sys.argv[0].endswith('block.py'))\n"
                          "open('out.txt', 'w').write('x')\nsys.exit(3)\n")
    status, out = run_script(s, tmp_path, ENV)
    assert status == 3
    assert f"cwd {tmp_path}" in out and "main __main__ True" in out
    assert (tmp_path / "out.txt").read_text() == "x"


def test_an_error_is_printed_and_fails(tmp_path):
    s = _script(tmp_path, "import sys\nprint('to stderr', file=sys.stderr)\nraise ValueError('boom')\n")
    status, out = run_script(s, tmp_path, ENV)
    assert status == 1
    assert "to stderr" in out and "ValueError: boom" in out


def test_ranks_get_torchruns_environment_and_a_group(tmp_path):
    s = _script(tmp_path, "import os, torch, torch.distributed as dist\n"
                          "assert 'RANK' in os.environ and os.environ['LOCAL_WORLD_SIZE'] == '2'\n"
                          "dist.init_process_group('gloo')\n"
                          "t = torch.tensor([dist.get_rank() + 1.0])\n"
                          "dist.all_reduce(t)\n"
                          "print('rank', os.environ['RANK'], 'sum', t.item())\n")
    status, out = run_script(s, tmp_path, ENV, nproc=2)
    assert status == 0, out
    assert "rank 0 sum 3.0" in out and "rank 1 sum 3.0" in out


def test_a_failing_rank_stops_the_others(tmp_path):
    # rank 1 fails; rank 0 would sleep for minutes: it is stopped (5 s after the failure)
    s = _script(tmp_path, "import os, sys, time\n"
                          "if os.environ['RANK'] == '1': sys.exit(5)\n"
                          "time.sleep(600)\n")
    t0 = time.monotonic()
    status, _ = run_script(s, tmp_path, ENV, nproc=2)
    assert status == 5
    assert time.monotonic() - t0 < 60


def test_a_script_past_its_timeout_is_stopped_and_said_so(tmp_path):
    s = _script(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    t0 = time.monotonic()
    status, out = run_script(s, tmp_path, ENV, timeout=3)
    assert status == -9 and time.monotonic() - t0 < 60
    assert "started" in out and "still running after 3 s" in out
