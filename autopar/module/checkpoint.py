"""Checkpoints that resume on another world: :func:`save_checkpoint` and
:func:`load_checkpoint` around ``torch.distributed.checkpoint``.

They save what a training loop needs (the module, the optimizer, an LR scheduler and any
plain values such as the step) through :meth:`ParallelModule.checkpoint_state`, the form
that loads into any plan: a job restarted on fewer or more ranks (a lost node, an
elastic ``torchrun --nnodes MIN:MAX``) plans for the world it finds and loads the last
checkpoint into that plan, ZeRO's optimizer state included.  The checkpoint also records
how it was saved (world, layout, data-parallel ranks, global batch), and loading logs what
changed, at WARNING so it shows without logging configured.

A job can die while it saves (that is when nodes are lost), so a save never overwrites the
checkpoint a restart would load: each goes into a numbered directory under ``path``
(``000001``, ``000002``, ...), and only once DCP has written all of it does rank 0 point
``path/latest`` at it (written to a temporary file and renamed: never half a pointer)
and remove the ones before the last ``keep``.  Loading reads ``latest``; a directory
holding a DCP checkpoint of its own (``.metadata``) loads as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.log import log
from autopar.plans.roles import layout

if TYPE_CHECKING:
    from autopar.module.parallel import ParallelModule

__all__ = ["load_checkpoint", "save_checkpoint"]

_RECORD = "autopar"  # the key of how the checkpoint was saved (JSON text)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _record(pm: ParallelModule, extra: dict[str, Any]) -> str:
    """How this job saves: its world and layout, and the user's plain values."""
    d = pm.plan.decisions
    return json.dumps({"world": _world(), "layout": layout(pm.plan), "batch": d.batch,
                       "global_batch": d.global_batch, "data_parallel_size": pm.data_parallel_size,
                       "micro_batches": d.micro_batches, "extra": extra})


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (it alone reads the pointer: one answer)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _latest(path: Path) -> int | None:
    """The number ``path/latest`` names, on every rank; None without one."""
    n = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            n = int((path / "latest").read_text().strip())
        except (OSError, ValueError):
            n = None
    return _from_rank0(n)


def save_checkpoint(pm: ParallelModule, optimizer: torch.optim.Optimizer, path: str | os.PathLike,
                    scheduler: Any = None, keep: int = 2, **extra: Any) -> None:
    """Save ``pm``, ``optimizer`` (and ``scheduler``) with DCP under directory ``path``, in
    the form any plan loads, as the next numbered checkpoint, keeping the last ``keep``
    (module docstring); ``extra``: plain JSON values (``step=100``) that
    :func:`load_checkpoint` returns.  Collective: every rank calls it."""
    # start-up: torch.distributed.checkpoint costs ~0.15 s to import
    import torch.distributed.checkpoint as dcp

    if keep < 1:
        raise ValueError(f"keep={keep}: at least the checkpoint just saved is kept")
    path = Path(path)
    n = (_latest(path) or 0) + 1
    msd, osd = pm.checkpoint_state(optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd, _RECORD: _record(pm, extra)}
    if scheduler is not None:
        state["sched"] = scheduler.state_dict()
    dcp.save(state, checkpoint_id=str(path / f"{n:06d}"))  # returns once the metadata is written
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = path / f".latest.{os.getpid()}"
        tmp.write_text(f"{n}\n")
        os.replace(tmp, path / "latest")
        for old in path.iterdir():
            if old.is_dir() and old.name.isdigit() and int(old.name) <= n - keep:
                shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(pm: ParallelModule, optimizer: torch.optim.Optimizer, path: str | os.PathLike,
                    scheduler: Any = None) -> dict[str, Any] | None:
    """Load the checkpoint :func:`save_checkpoint` wrote in ``path`` into ``pm``,
    ``optimizer`` (and ``scheduler``), whatever plan and world saved it; returns its
    ``extra`` values, or None when ``path`` holds no checkpoint (a first start).  When the
    world or the layout changed, says what changed (the ``autopar`` logger, WARNING).
    Collective."""
    # start-up: torch.distributed.checkpoint costs ~0.15 s to import
    import torch.distributed.checkpoint as dcp

    given = path = Path(path)
    if not (path / ".metadata").exists():
        n = _latest(path)
        if n is None:
            return None
        path = path / f"{n:06d}"

    msd, osd = pm.checkpoint_state(optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd, _RECORD: ""}
    if scheduler is not None:
        state["sched"] = scheduler.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    pm.load_checkpoint_state(optimizer, state["model"], state["optim"])
    if scheduler is not None:
        scheduler.load_state_dict(state["sched"])
    saved = json.loads(state[_RECORD])
    message = changes(saved, json.loads(_record(pm, {})))
    if message and pm.rank == 0:
        log.warning("resumed %s from %s: %s", given, path.name, message)
    return saved["extra"]


def changes(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between the job that saved (``saved``) and this one, in words; ""
    when nothing the loop sees changed."""
    parts = []
    if saved["world"] != now["world"]:
        parts.append(f"saved on {saved['world']} ranks, resumed on {now['world']}")
    if saved["layout"] != now["layout"]:
        parts.append(f"layout {saved['layout']} -> {now['layout']}")
    if saved["data_parallel_size"] != now["data_parallel_size"]:
        rows = [saved["global_batch"] // n for n in (saved["data_parallel_size"], now["data_parallel_size"])]
        what = f"data-parallel ranks {saved['data_parallel_size']} -> {now['data_parallel_size']}"
        if now["batch"] == "local" and saved["global_batch"] == now["global_batch"]:
            what += (f": each passes {rows[1]} rows instead of {rows[0]}, keeping the global batch "
                     f"of {now['global_batch']}")
        parts.append(what)
    if saved["global_batch"] != now["global_batch"]:
        parts.append(f"global batch {saved['global_batch']} -> {now['global_batch']} (the plan's "
                     "example batch changed: the loss scale and the learning-rate schedule may not fit)")
    if saved["micro_batches"] != now["micro_batches"]:
        parts.append(f"micro-batches {saved['micro_batches']} -> {now['micro_batches']}")
    return "; ".join(parts)
