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
