"""Errors autopar raises; each message names the problem and what to do about it."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of autopar's errors."""


class CaptureError(AutoparError):
    """Neither tracer could capture the model."""


class PlanError(AutoparError):
    """No valid plan: contradictory pins, indivisible shapes, or an infeasible budget."""


class MeshMismatchError(AutoparError):
    """The running world does not match the plan's mesh."""


class ExportError(AutoparError, ValueError):
    """A module cannot be exported: nothing was replaced, the previous export (if any)
    is still in place.  (A ``ValueError`` too, as it was before it moved here.)"""


class LoadError(AutoparError, ValueError):
    """An export directory or a plan file cannot be loaded: missing, truncated or
    corrupt files, another autopar schema, unknown keys, or placements that do not fit
    the plan's mesh.  The message names the file and the field; under a process group
    every rank raises it with the same message."""


class ConfigError(PlanError, ValueError):
    """An argument autopar was given is not one it accepts: the message names the
    argument, the value and what is allowed.  A :class:`PlanError` too: no plan can be
    made from it."""


class RankTimeoutError(AutoparError, TimeoutError):
    """A rank did not arrive, or did not answer, within the configured timeout."""


class AutoparWarning(UserWarning):
    """Something planned differently from what the user may expect (an op without a
    sharding rule runs replicated, ...).  Shown every time a plan is made: the same
    warning text is also kept in ``plan.warnings``."""
