"""Writing an export atomically and reading it back only when it is whole.

An export directory ``out/`` is written in a *staging* sibling
``.out.autopar-new-<token>/`` (same parent, so the same filesystem and ``rename`` is
atomic).  Every rank writes its own ``rank{r}.pt`` there and reports the file's sha256;
after all ranks succeeded, rank 0 writes ``MANIFEST.json`` last (the completion marker:
versions, mesh, world size, every file's size and sha256) and swaps directories:

1. ``out/`` (if any) is renamed to ``.out.autopar-old-<token>/``;
2. the staging directory is renamed to ``out/``;
3. the backup is removed.

What a crash leaves behind, and what :func:`resolve` (used by ``autopar.load``) makes
of it:

* before the manifest is written: ``out/`` is untouched; the staging directory has no
  manifest and is ignored (the next export removes it);
* after the manifest, before step 1: ``out/`` is untouched and is loaded;
* between steps 1 and 2: ``out/`` is missing; the complete staging directory (the new
  export) is loaded with a warning, and the next export finishes the swap first;
* after step 2: ``out/`` is the new export; a leftover backup is removed next time.

A directory without a manifest never loads (:class:`~autopar.errors.LoadError`
saying so), and an existing directory that is no autopar export is never replaced.

Under a process group every decision goes through :func:`exchange` (an all-gather of
each rank's result), so all ranks raise the same error with the same message.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from autopar.errors import AutoparError, ExportError, LoadError, MeshMismatchError, user_stacklevel
from autopar.plans.data import SCHEMA_VERSION, Plan, versions

MANIFEST = "MANIFEST.json"
_NEW = ".autopar-new-"  # staging directory: .<name>.autopar-new-<token>
_OLD = ".autopar-old-"  # the previous export during the swap
_MANIFEST_KEYS = {"schema_version", "autopar_version", "torch_version", "mesh",
                  "pipeline_stages", "world_size", "files"}
_AGREE_TIMEOUT = datetime.timedelta(seconds=120)

# Test-only fault injection: called with a point name ("rank-file-written",
# "manifest-written", "old-moved", "new-moved") and the path just written.  Tests set it
# in a child process to kill that process at the point; nothing in autopar sets it.
_fault_hook: Callable[[str, Path], None] | None = None


def _fault(point: str, path: Path) -> None:
    if _fault_hook is not None:
        _fault_hook(point, path)


# ---------------------------------------------------------------- files
def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """What the manifest records of a written file (read back from disk after fsync, so
    the checksum is of what the disk holds, not of what was meant to be written)."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_durably(path: Path, data: bytes | str | Callable[[Any], None]) -> dict[str, Any]:
    """Write ``data`` (bytes, text, or a function writing to a binary file object) to
    ``path``, fsync it and return its manifest record."""
    with open(path, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    return file_record(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- manifest
def write_manifest(directory: Path, files: dict[str, dict], plan: Plan) -> None:
    """Write ``MANIFEST.json`` into ``directory`` atomically (a part file renamed)."""
    d = plan.decisions
    manifest = versions() | {"mesh": list(plan.mesh.shape), "pipeline_stages": d.pipeline_stages,
                             "world_size": plan.world_size, "files": dict(sorted(files.items()))}
    part = directory / (MANIFEST + ".part")
    write_durably(part, json.dumps(manifest, indent=1))
    os.rename(part, directory / MANIFEST)
    _fsync_dir(directory)


def sign(directory: str | Path) -> None:
    """Recompute the manifest's checksums from the files now in ``directory``, keeping its
    other fields: for an export edited by hand on purpose (load checks what it loads)."""
    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"] = {p.name: file_record(p) for p in sorted(directory.iterdir())
                         if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def read_manifest(directory: Path) -> dict[str, Any]:
    """``directory``'s manifest, checked: JSON, schema version, known keys.  Warns when
    the export was written with another torch version."""
    path = directory / MANIFEST
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise LoadError(f"{directory} has no {MANIFEST}: it is an incomplete export (the "
                        "export was interrupted) or one written by an autopar without "
                        "manifests; export the module again") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path} is unreadable or not valid JSON ({e}): the export is corrupt; "
                        "export the module again") from e
    if not isinstance(m, dict):
        raise LoadError(f"{path}: expected a JSON object; the export is corrupt: export again")
    if m.get("schema_version") != SCHEMA_VERSION:
        raise LoadError(
            f"{path}: schema_version {m.get('schema_version')!r}, but this autopar reads schema "
            f"{SCHEMA_VERSION}; the export was written by autopar {m.get('autopar_version')}: "
            "re-export with this autopar, or load with the autopar that wrote it")
    unknown = sorted(set(m) - _MANIFEST_KEYS)
    if unknown:
        raise LoadError(f"{path}: unknown key {unknown[0]!r}; it was probably written by a "
                        "newer autopar: upgrade autopar or re-export with this one")
    missing = sorted(_MANIFEST_KEYS - set(m))
    if missing or not isinstance(m["files"], dict):
        raise LoadError(f"{path}: field {(missing or ['files'])[0]!r} is missing or malformed: "
                        "the export is corrupt; export again")
    if m["torch_version"] != versions()["torch_version"]:
        warnings.warn(f"{directory} was exported with torch {m['torch_version']} but this is "
                      f"torch {versions()['torch_version']}: it loads, but if training differs "
                      "re-export with this torch", stacklevel=user_stacklevel())
    return m


def verify(directory: Path, manifest: dict, names: list[str]) -> None:
    """Each of ``names`` is listed in the manifest and has its recorded size and sha256."""
    for name in names:
        path = directory / name
        rec = manifest["files"].get(name)
        if not isinstance(rec, dict) or not {"bytes", "sha256"} <= set(rec):
            raise LoadError(f"{directory / MANIFEST} lists no valid entry for {name}: the export "
                            "is corrupt or for another world size; export again")
        if not path.is_file():
            raise LoadError(f"{path} is missing (the manifest lists it): the export is "
                            "incomplete; export again")
        size = path.stat().st_size
        if size != rec["bytes"]:
            raise LoadError(f"{path} has {size} bytes but the manifest records {rec['bytes']}: "
                            "the file is truncated, or was edited or replaced after export; export again")
        if sha256_file(path) != rec["sha256"]:
            raise LoadError(f"{path} does not match its sha256 in {MANIFEST}: the file is "
                            "corrupt or was edited after export; export again (or, for a "
                            "deliberate edit, autopar.module.export_io.sign the directory)")


# ---------------------------------------------------------------- directories
def _siblings(target: Path, kind: str) -> list[Path]:
    """Staging (``_NEW``) or backup (``_OLD``) directories of ``target``, newest first."""
    if not target.parent.is_dir():
        return []
    found = [p for p in target.parent.iterdir()
             if p.name.startswith(f".{target.name}{kind}") and p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def resolve(target: Path) -> tuple[Path, str | None]:
    """The complete export to load for ``target`` and a warning when it is not
    ``target`` itself (an interrupted swap); :class:`LoadError` when there is none."""
    if (target / MANIFEST).is_file():
        return target, None
    for kind, what in ((_NEW, "the new export"), (_OLD, "the previous export")):
        for cand in _siblings(target, kind):
            if (cand / MANIFEST).is_file():
                return cand, (f"the export at {target} was interrupted while being replaced; "
                              f"loading {what} from {cand}; export again to tidy up")
    if not target.exists():
        raise LoadError(f"no export at {target}: the directory does not exist (and no "
                        "interrupted export was found beside it)")
    if not target.is_dir():
        raise LoadError(f"{target} is not a directory: pass the export directory")
    return target, None  # read_manifest says it is incomplete


def _recover(target: Path) -> None:
    """Finish a swap a crash interrupted (``target`` missing, a complete export beside
    it), then remove leftover staging and backup directories."""
    if not target.exists():
        found, warning = None, None
        try:
            found, warning = resolve(target)
        except LoadError:
            pass
        if found is not None and found != target:
            os.rename(found, target)
    for kind in (_NEW, _OLD):
        for stale in _siblings(target, kind):
            shutil.rmtree(stale, ignore_errors=True)


def begin(target: Path) -> Path:
    """Rank 0: check ``target`` may be replaced, tidy up after earlier crashes and
    create the staging directory."""
    if target.exists():
        if not target.is_dir():
            raise ExportError(f"{target} exists and is not a directory; choose another path")
        entries = {p.name for p in target.iterdir()}
        if entries and not entries & {MANIFEST, "plan.json"}:
            raise ExportError(f"{target} exists and is not an autopar export (no {MANIFEST} or "
                              "plan.json); export replaces the whole directory, so choose "
                              "another one or empty it")
    target.parent.mkdir(parents=True, exist_ok=True)
    _recover(target)
    tmp = target.parent / f".{target.name}{_NEW}{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, target: Path) -> None:
    """Rank 0: swap the complete staging directory into place (module docstring)."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}{_OLD}{tmp.name.rsplit('-', 1)[-1]}"
        os.rename(target, old)
        _fault("old-moved", old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    _fault("new-moved", target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- agreeing across ranks
_ERRORS: dict[str, type[AutoparError]] = {c.__name__: c for c in
                                          (ExportError, LoadError, MeshMismatchError)}
_GROUP: list[Any] = []  # a gloo side group when the default backend is not gloo


def _group() -> Any:
    if dist.get_backend() == "gloo":
        return None
    if not _GROUP:  # all_gather_object on nccl would need a device; gloo needs none
        _GROUP.append(dist.new_group(backend="gloo", timeout=_AGREE_TIMEOUT))
    return _GROUP[0]


def distributed() -> bool:
    """Whether a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def exchange(mine: Any, kind: type[AutoparError] = LoadError, collective: bool = True) -> list[Any]:
    """Every rank's ``mine`` (picklable), on every rank; ``[mine]`` without a group or
    when not ``collective``.  A peer that died (the all-gather fails) is a ``kind``
    error, not a bare ``DistBackendError``."""
    if not (collective and distributed()):
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, mine, group=_group())
    except Exception as e:  # noqa: BLE001 - gloo/nccl raise several types for a lost peer
        raise kind(f"rank {dist.get_rank()}: a peer rank stopped answering during "
                   f"{'export' if kind is ExportError else 'load'} (it crashed or was killed): "
                   f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return out


def agree(err: AutoparError | None, kind: type[AutoparError] = LoadError,
          collective: bool = True) -> None:
    """Collective: raise on every rank the error of the lowest rank that had one (same
    type and message everywhere), or return when no rank had one."""
    everyone = exchange(None if err is None else (type(err).__name__, str(err)), kind, collective)
    for r, e in enumerate(everyone):
        if e is not None:
            msg = e[1] if len(everyone) == 1 else f"rank {r}: {e[1]}"
            raise _ERRORS.get(e[0], LoadError)(msg) from err
