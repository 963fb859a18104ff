"""What the multi-rank benchmarks share: spawning the ranks, joining the gloo group,
timing a step on the slowest rank, counting its collectives, and handing rank 0's rows
back to the parent."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist


def join(rank: int, world: int, port: int) -> None:
    """Join a ``world``-rank gloo group on 127.0.0.1:``port``, one thread per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def finish(rank: int, rows: list[dict], out: str) -> None:
    """Rank 0 writes ``rows`` to ``out`` as JSON; every rank leaves the group and exits
    (``os._exit``: no atexit handler may touch the destroyed group)."""
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def timed(step: Callable[[], None]) -> float:
    """Seconds ``step`` takes on the slowest rank (every rank starts together)."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def gloo_events(step: Callable[[], None]) -> list[str]:
    """Names of the collectives one ``step`` issues on this rank (gloo profiler events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return [e.name for e in prof.events() if e.name.startswith("gloo:")]


def spawn_rows(worker: Callable, world: int, params: dict) -> tuple[list[dict], tuple[float, float]]:
    """Run ``worker(rank, world, port, params, out)`` on ``world`` spawned ranks; return
    the rows rank 0 wrote (via :func:`finish`) and the load average before and after."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.dist.harness import free_port

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        load0 = os.getloadavg()[0]
        mp.spawn(worker, args=(world, free_port(), params, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text()), (load0, os.getloadavg()[0])


def run_section(worker: Callable, world: int, a, ratios: Callable[[list[dict]], None],
                section: Callable[..., str], command: str) -> list[dict]:
    """Run ``worker`` on ``world`` ranks with ``a``'s steps, seq and batch, add the
    ratios, print the ``docs/benchmarks.md`` section, ending with ``command`` (the line
    ``plan_time.regenerate`` gives), and with ``a.write`` write it there; return the rows."""
    from plan_time import write_section

    rows, load = spawn_rows(worker, world, {"steps": a.steps, "seq": a.seq, "batch": a.batch})
    ratios(rows)
    text = section(rows, a, load, command)
    print(text)
    if a.write:
        write_section(text)
    return rows


@contextlib.contextmanager
def throttled_loopback(rate: str | None) -> Iterator[None]:
    """Limit the loopback interface to ``rate`` (a ``tc`` rate such as ``"1gbit"``) while
    the block runs, then restore it; ``None`` leaves it alone.

    Why: the ranks here talk over loopback, where a collective is a memory copy that
    competes with the backward for the same two cores, so nothing can overlap.  Behind
    a token bucket the bytes wait for the wire instead of a core, as on a real network,
    so a reduction started during the backward does hide behind it.  Needs root and the
    kernel's ``tbf`` queueing discipline; the burst is above loopback's 64 KiB packets
    (``tbf`` drops a packet larger than its burst)."""
    if rate is None:
        yield
        return
    if shutil.which("tc") is None or os.geteuid() != 0:
        raise SystemExit("--link-rate needs root and tc (iproute2) to shape the loopback link")
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                    "burst", "2mb", "latency", "500ms"], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=True)


def interleaved_args(doc: str, rounds: int = 7, steps: int = 3) -> argparse.ArgumentParser:
    """The options of the benchmarks that time plans side by side on gloo ranks:
    ``--world``, ``--rounds`` rounds of ``--steps`` steps, ``--calibrate``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--calibrate", action="store_true")
    return ap
