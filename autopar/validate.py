"""Up-front checks of every public input: each failure is a :class:`ConfigError` that
names the argument, the value and what is allowed, before any capture or search (the
Python API as clear as the CLI).  docs/reliability.md lists them."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost_models import MeshSpec
from autopar.cost_models.presets import PRESET_NAMES
from autopar.errors import ConfigError
from autopar.plans.decisions import check_options

SEARCHES = ("auto", "ilp", "drec")
_PLACEMENT = re.compile(r"(R|P|S\(-?\d+\))")
_SHAPE_TEXT = re.compile(r"[\d\sx*,-]+")
"""A ``mesh=`` string that can only be a shape ("8", "2x4", "2, 4"): anything else names a
preset (what :func:`mesh` parses and :func:`describes_machine` tells apart)."""


def mesh(value) -> MeshSpec:
    """A :class:`MeshSpec` from ``mesh=``: a MeshSpec, ``None`` (the world as a 1-D mesh)
    or a shape (``"2x4"``, ``8``, ``(2, 4)``), each priced as :func:`_this_machine` says
    until ``auto_parallel`` calibrates the job, a preset name, JSON text or a JSON file."""
    if isinstance(value, MeshSpec):
        return value
    if value is None:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        return _this_machine((world,))
    if isinstance(value, str) and (value.endswith(".json") or value.lstrip().startswith("{")):
        where = "the JSON text" if value.lstrip().startswith("{") else value
        try:
            return MeshSpec.from_json(value)
        except FileNotFoundError:
            raise ConfigError(f"mesh={value!r}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"mesh={value!r}: {where} is not valid JSON (line {e.lineno}, "
                              f"column {e.colno}: {e.msg})") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"mesh={value!r}: {where} is not a mesh description ({e}); "
                              "see MeshSpec.to_json for the format") from None
    if isinstance(value, str) and not _SHAPE_TEXT.fullmatch(value):
        if value not in PRESET_NAMES:
            raise ConfigError(f"mesh={value!r}: unknown preset; presets: {', '.join(PRESET_NAMES)}; "
                              "or give a shape like '8' or '2x4', or a JSON file")
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 0))
        # under torchrun a preset named without a shape is this job's device count, its
        # shape searched; planning alone keeps the preset's default shape
        try:
            return MeshSpec.preset(value, devices=world) if world > 1 else MeshSpec.preset(value)
        except ValueError as e:  # e.g. more ranks than a one-node preset's node
            raise ConfigError(f"mesh={value!r} with {world} ranks: {e}") from None
    try:
        shape = MeshSpec.parse_shape(value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"mesh={value!r}: {e}; a shape is positive ints like 8, '2x4' or (2, 4)") from None
    if any(n < 1 for n in shape):
        raise ConfigError(f"mesh={value!r}: every mesh axis needs at least one device")
    return _this_machine(shape)


def _this_machine(shape: tuple[int, ...]) -> MeshSpec:
    """The figures a mesh of ``shape`` is priced on when only its shape is named: the
    nearest GPU preset with this GPU's memory (:meth:`MeshSpec.for_device`) where CUDA is
    available, else ``cpu-gloo``."""

    if torch.cuda.is_available():  # the runtime computes on this rank's GPU (NCCL)
        props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
        spec = MeshSpec.for_device(props.name, props.total_memory, math.prod(shape))
        return spec if len(shape) == 1 else spec.with_shape(shape)
    return MeshSpec.preset("cpu-gloo", shape=shape)


def describes_machine(value) -> bool:
    """Whether ``mesh=`` describes the machine (a MeshSpec, a preset name, JSON text or a
    JSON file) rather than only the layout (None or a shape): ``auto_parallel`` plans a
    described machine as given and measures the running job otherwise."""
    if isinstance(value, MeshSpec):
        return True
    return isinstance(value, str) and not _SHAPE_TEXT.fullmatch(value)


def placement_string(key: str, value) -> None:
    """A pin value: a string of placements (``"S(0)R"``, one per mesh axis) or a sequence
    of ``Placement`` objects.  How many per mesh axis is the planner's check."""
    if isinstance(value, str):
        compact = value.replace(" ", "")
        if "".join(_PLACEMENT.findall(compact)) != compact or not compact:
            raise ConfigError(f"pins[{key!r}]={value!r}: not a placement string; each mesh axis "
                              "takes R, P or S(dim) with an integer dim, e.g. 'S(0)R'")
    elif isinstance(value, (tuple, list)):
        if not all(isinstance(p, (Shard, Replicate, Partial)) for p in value):
            raise ConfigError(f"pins[{key!r}]={value!r}: expected Shard/Replicate/Partial objects")
    else:
        raise ConfigError(f"pins[{key!r}]={value!r}: expected a placement string like 'S(0)R' "
                          "or a tuple of placements")


def pins(value: Mapping | None) -> dict:
    """``pins=``: a mapping from names or globs to placements."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"pins={value!r}: expected a dict like {{'fc1.weight': 'S(0)'}}")
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise ConfigError(f"pins: key {k!r} is not a parameter name, glob or 'input:N'")
        placement_string(k, v)
    return dict(value)


def positive(name: str, value, allow_none: bool = True) -> None:
    """A positive finite number (or ``None`` when allowed)."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
    if not ok:
        raise ConfigError(f"{name} must be a positive number" + (" or None" if allow_none else "")
                          + f", got {value!r}")


def options(memory_budget, optimizer, time_limit, search, decisions: Mapping) -> None:
    """The scalar options and forced decisions of :func:`autopar.plan` / ``auto_parallel``."""
    positive("memory_budget", memory_budget)
    positive("time_limit", time_limit, allow_none=False)
    if str(search).lower() not in SEARCHES:
        raise ConfigError(f"search must be one of {', '.join(SEARCHES)}, got {search!r}")
    if not isinstance(optimizer, str):
        raise ConfigError(f"optimizer={optimizer!r}: expected a name such as 'adamw' or 'sgd'")
    check_options(dict(decisions))  # each forced decision's own check (its registry entry)


def runnable_model(model: nn.Module) -> None:
    """A model whose weights are real: planning works on the meta device, running does not."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ConfigError(
            f"model: {len(meta)} tensor(s) are on the meta device (e.g. {meta[0]!r}), which has "
            "no values to train: autopar.plan(...) plans such a model; to run, build it with "
            "real weights (or load a checkpoint into it) before auto_parallel")


__all__ = ["mesh", "options", "pins", "placement_string", "positive", "runnable_model"]
