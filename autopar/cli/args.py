"""Reading the command line's arguments: byte sizes, key=value pins, recomputed layers
and the forced plan decisions; :class:`CLIError` for a user's mistake."""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Sequence
from typing import Any

from autopar.plans.placement import parse_placements

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


class CLIError(Exception):
    """A user error: printed as ``error: <message>``, exit status 2."""


# ---------------------------------------------------------------- parsing helpers
def parse_bytes(text: str) -> float:
    """``"40GiB"`` -> 42949672960; accepts B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB
    and bare K/M/G/T (powers of 2), or a plain number of bytes (``"4e10"``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise CLIError(f"cannot parse memory size {text!r}; expected e.g. 40GiB, 512MiB, 80GB "
                       f"or a number of bytes")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise CLIError(f"memory size must be > 0, got {text!r}")
    return value


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_kv(items: Sequence[str], what: str) -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}`` (values left as strings)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise CLIError(f"{what} {item!r} must look like NAME=VALUE")
        out[key.strip()] = value.strip()
    return out


def parse_pins(items: Sequence[str]) -> dict[str, str]:
    """``--pin NAME=PLACEMENTS`` values, with the placements checked for syntax."""
    pins = parse_kv(items, "--pin")
    for name, value in pins.items():
        try:
            if not parse_placements(value):
                raise ValueError
        except ValueError:
            raise CLIError(f"--pin {name}={value}: cannot parse placements {value!r}; expected "
                           f"one of R, P or S(dim) per mesh axis, e.g. S(0)R") from None
    return pins


def parse_recompute(items: Sequence[str] | None) -> list[str] | None:
    """``--recompute`` values (repeatable, comma-separated layer keys) -> the layer list;
    ``none`` forces no recomputation; not given (``None``) leaves it to the search."""
    if items is None:
        return None
    keys: list[str] = []
    for item in items:
        for key in item.split(","):
            key = key.strip()
            if not key:
                raise CLIError(f"--recompute {item!r}: empty layer key; expected e.g. "
                               f"blocks.0,blocks.1 or none")
            if key.lower() != "none" and key not in keys:
                keys.append(key)
    if keys and any(k.strip().lower() == "none" for item in items for k in item.split(",")):
        raise CLIError("--recompute none cannot be combined with layer keys")
    return keys


def decision_options(args: argparse.Namespace) -> dict[str, Any]:
    """The plan-level decisions forced on the command line, as keyword arguments of
    :func:`autopar.plan` (unset ones are left out, so the search chooses them)."""
    for flag, value in (("--pipeline-stages", args.pipeline_stages),
                        ("--micro-batches", args.micro_batches),
                        ("--virtual-stages", args.virtual_stages)):
        if value is not None and value < 1:
            raise CLIError(f"{flag} must be >= 1, got {value}")
    if args.schedule is not None and args.pipeline_stages == 1:
        raise CLIError(f"--schedule {args.schedule} needs a pipeline: give --pipeline-stages "
                       f"2 or more (or leave it out to let the search choose)")
    out: dict[str, Any] = {}
    for key in ("zero_stage", "zero_axes", "pipeline_stages", "pipeline_axis", "micro_batches", "schedule",
                "virtual_stages"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    recompute = parse_recompute(args.recompute)
    if recompute is not None:
        out["recompute"] = recompute
    if args.explore:
        out["explore"] = True
    if args.precision != "native":
        out["precision"] = args.precision
    if args.batch != "global":
        out["batch"] = args.batch
    return out


__all__ = ["CLIError", "decision_options", "device_counts", "parse_bytes", "parse_kv", "parse_pins",
           "parse_recompute"]


def device_counts(text: str) -> list[int]:
    """``--devices``: ``"64"`` or ``"8,16,32"`` as positive ints (CLIError otherwise)."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise CLIError(f"bad --devices {text!r}: expected a device count such as 64, or several "
                       "such as 8,16,32")
    return counts
