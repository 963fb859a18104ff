"""What the multi-rank benchmarks share: joining the gloo group in a spawned worker and
handing rank 0's rows back to the parent."""

from __future__ import annotations

import json
import os
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
