"""Live calibration by default: measure the running job once, keep it on disk, plan on rank 0's numbers.

``auto_parallel`` in a process group, with no mesh description named (no mesh, or only a
shape), plans on :func:`live_mesh`: a quick :func:`~autopar.cost_models.calibrate.measure_cluster`
of the running group (about 10 s on 4 ranks of a 2-core CPU host), cached on disk under
:func:`cache_dir` and keyed by what identifies the cluster (:func:`cluster_key`: every
rank's host, device and threads, the world size, the mesh shape, the backend, torch's
version and this module's :data:`VERSION`), so a second run on the same cluster measures
nothing.  Only rank 0 reads and writes the cache, and its numbers are broadcast: every
rank plans on the same ones even where the ranks do not share a file system.

``AUTOPAR_CALIBRATE`` sets the default: ``0`` (or ``off``) plans on the presets, as
without a process group (the test suite does this, for plans that do not depend on the
machine's load); ``refresh`` measures again and replaces the cached file.
``AUTOPAR_CACHE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/autopar``, else
``~/.cache/autopar``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .calibrate import measure_cluster
from .mesh import MeshSpec

__all__ = ["ENV", "VERSION", "cache_dir", "cache_path", "cluster_key", "cpu_model", "default_on",
           "keep", "key_digest", "live_mesh"]

VERSION = 3
"""Part of the cache key: raised when what calibration measures changes, so files written
by an older autopar are measured again rather than planned on."""

ENV = "AUTOPAR_CALIBRATE"
"""The environment variable that sets the default: ``0``/``off``, ``refresh``, or unset."""

_log = logging.getLogger("autopar")


_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes", "refresh")


def _setting() -> str:
    """``AUTOPAR_CALIBRATE``, normalised; any value but those of ``_OFF`` and ``_ON`` is a
    ValueError: a typo must not silently decide which numbers a plan is priced on."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in _OFF + _ON:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 0/off (plan on the presets), "
                         "1/on (the default) or refresh (measure again)")
    return value


def default_on() -> bool:
    """Whether live calibration is on by default (``AUTOPAR_CALIBRATE`` unset, ``1``/``on``
    or ``refresh``; ``0``/``off`` turn it off; anything else is a ValueError)."""
    return _setting() not in _OFF


def cache_dir() -> Path:
    """Where calibrations are kept: ``AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``,
    else ``~/.cache/autopar``."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar"


def cpu_model() -> str:
    """This host's CPU model (``/proc/cpuinfo``'s ``model name``, else what ``platform``
    says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - no procfs (macOS)
        pass
    return platform.processor() or platform.machine()


def _device_name() -> str:
    """This rank's device: the GPU's name under CUDA, else the CPU's model and cores."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"{cpu_model()} x{os.cpu_count()}"


def cluster_key(shape: Sequence[int], group: Any = None) -> dict[str, Any]:
    """What identifies the cluster a calibration was measured on; every rank calls it (one
    ``all_gather_object``) and gets the same dict: each rank's host, device and torch
    threads in rank order (which ranks share a host, and so cores or a node's links),
    the world size, the mesh shape (each axis is measured on its own groups), the
    backend, torch's version and :data:`VERSION`."""

    world = dist.get_world_size(group)
    mine = (socket.gethostname(), _device_name(), torch.get_num_threads())
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    return {"version": VERSION, "world": world, "shape": [int(n) for n in shape],
            "backend": str(dist.get_backend(group)), "torch": torch.__version__,
            "ranks": [list(r) for r in every]}


def key_digest(key: dict[str, Any]) -> str:
    """A short, stable name for ``key`` (16 hex digits of its canonical JSON's SHA-256)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: dict[str, Any]) -> Path:
    """The file ``key``'s calibration is kept in."""
    return cache_dir() / f"calibration-{key_digest(key)}.json"


def _read(path: Path, key: dict[str, Any]) -> tuple[MeshSpec, str] | None:
    """The cached MeshSpec at ``path`` and when it was measured, if the file is there,
    readable and for ``key``; else None (a file that cannot be used is measured again,
    with a warning, never planned on)."""
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        if d.get("calibration", {}).get("key") != key:
            raise ValueError("it was measured on another cluster")
        return MeshSpec.from_dict(d), str(d["calibration"].get("when", "an unknown time"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        _log.warning("autopar: the cached calibration %s is unusable (%s); measuring again", path, e)
        return None


def _write(path: Path, record: dict[str, Any]) -> bool:
    """Write ``record`` to ``path`` atomically (a temporary file renamed over it, so a
    reader never sees half a file); a failure is a warning: the plan does not need it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
        return True
    except OSError as e:
        _log.warning("autopar: could not keep the calibration in %s (%s); the next run "
                     "measures again", path, e)
        return False


def _record(record: Any, key: dict[str, Any]) -> dict[str, Any]:
    """What is kept for ``key``: the :class:`~autopar.cost_models.calibrate.Calibration`'s
    MeshSpec JSON with the key in its ``"calibration"`` record."""
    d = record.to_dict()
    d["calibration"]["key"] = key
    return d


def keep(record: Any, shape: Sequence[int], group: Any = None) -> Path | None:
    """Keep ``record`` (a :class:`~autopar.cost_models.calibrate.Calibration`, e.g. the full
    one ``autopar calibrate --keep`` measures) as this cluster's calibration for a mesh
    of ``shape``: :func:`live_mesh`, and so ``auto_parallel``, then plans on it instead of
    measuring its quick one.  Every rank calls it (:func:`cluster_key`); rank 0 writes and
    gets the path back (None elsewhere, or where the file could not be written)."""
    key = cluster_key(MeshSpec.parse_shape(tuple(shape)), group)
    if dist.get_rank(group) != 0:
        return None
    path = cache_path(key)
    return path if _write(path, _record(record, key)) else None


def live_mesh(shape: Sequence[int], base: MeshSpec | None = None, refresh: bool | None = None,
              group: Any = None) -> MeshSpec:
    """The MeshSpec of the running job for a mesh of ``shape``: rank 0's cached
    calibration when there is one for this cluster (:func:`cluster_key`), else a quick
    :func:`~autopar.cost_models.calibrate.measure_cluster` on every rank, kept by rank 0;
    either way rank 0's numbers are broadcast.  Every rank of ``group`` (default the
    world) calls it.  ``base`` supplies what is not measured (as in ``measure_cluster``);
    ``refresh`` (default: ``AUTOPAR_CALIBRATE=refresh``) measures even when a file is
    kept.  The MeshSpec's ``name`` says where its numbers came from, for the summary."""
    if refresh is None:
        refresh = _setting() == "refresh"
    shape = MeshSpec.parse_shape(tuple(shape))
    key = cluster_key(shape, group)
    path = cache_path(key)
    rank0 = dist.get_rank(group) == 0
    world, backend = key["world"], key["backend"]
    cached = _read(path, key) if rank0 and not refresh else None
    found: list[Any] = [None]
    if cached is not None:
        _log.info("autopar: planning on the calibration kept in %s", path)
        found = [{"mesh": cached[0].to_dict(),
                  "name": f"calibrated on this cluster's {world} {backend} ranks at "
                          f"{cached[1]}, kept in {path}"}]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(found, src=src, group=group)
    if found[0] is not None:
        return _named(MeshSpec.from_dict(found[0]["mesh"]), found[0]["name"])
    record = measure_cluster(group=group, shape=shape if len(shape) > 1 else None, repeats=5,
                             base=base, quick=True)
    ours: list[Any] = [None]
    if rank0:
        where = f", kept in {path}" if _write(path, _record(record, key)) else ""
        _log.info("autopar: calibrated %d %s ranks in %.1f s%s", world, backend, record.seconds, where)
        ours = [{"mesh": record.spec.to_dict(),
                 "name": f"calibrated on this job's {world} {backend} ranks in "
                         f"{record.seconds:.1f} s at {record.when}{where}"}]
    # every rank measured the same numbers (measure_cluster all-reduces each timing), but
    # rank 0's are the ones kept: the plan is priced on what the next run reads back
    dist.broadcast_object_list(ours, src=src, group=group)
    return _named(MeshSpec.from_dict(ours[0]["mesh"]), ours[0]["name"])


def _named(spec: MeshSpec, source: str) -> MeshSpec:
    """``spec`` named for the summary (the plan says which numbers it was priced on)."""
    return replace(spec, name=source)
