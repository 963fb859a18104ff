"""Errors autopar raises; each message names the problem and what to do about it."""

from __future__ import annotations

import os
import sys
import warnings


class AutoparError(Exception):
    """Base class of autopar's errors."""


class CaptureError(AutoparError):
    """Neither tracer could capture the model."""


class PlanError(AutoparError):
    """No valid plan: contradictory pins, indivisible shapes, or an infeasible budget."""


class NoFitError(PlanError):
    """No plan fits the memory budget (the leanest one found is named in the message)."""


class MeshMismatchError(AutoparError):
    """The running world does not match the plan's mesh."""


class ExportError(AutoparError, ValueError):
    """A module cannot be exported: nothing was replaced, the previous export (if any)
    is still in place.  (A ``ValueError`` too, for callers that catch that.)"""


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


class CallMismatchError(AutoparError, ValueError):
    """The ranks' calls of a module disagree where the plan needs them equal: different
    batches under ``batch="global"``, or random generators in different states for
    dropout.  Every rank raises it with the same message on the same call."""


class StaleModelError(AutoparError, RuntimeError):
    """The model passed to :func:`autopar.auto_parallel` was used where the
    ParallelModule is meant: its parameters were replaced by the module's, so an
    optimizer over them, or its ``state_dict()``, never sees the training.  The message
    names what to call on the ParallelModule instead."""


class ForeignShardError(AutoparError, ValueError):
    """A state dict holding one rank's shards (``pm.state_dict()`` or an optimizer's,
    written with ``torch.save``) was loaded on a rank that holds other shards.  Every
    rank raises it with the same message."""


class GenerateError(AutoparError, TypeError):
    """``pm.generate`` cannot run: the module has no Hugging Face model to generate with
    (the model passed to ``auto_parallel`` has no ``generate``, is gone, or the module
    was loaded from an export or is planning-only).  Every rank raises it with the same
    message, which names what works instead."""


class AutoparWarning(UserWarning):
    """Something planned differently from what the user may expect (an op without a
    sharding rule runs replicated, ...).  Shown every time a plan is made: the same
    warning text is also kept in ``plan.warnings``."""


class CompileFallbackWarning(AutoparWarning):
    """``torch.compile`` failed on a graph autopar compiles, which runs eagerly instead
    (:mod:`autopar.runtime.compile_fallback`)."""


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in ("autopar", "passes", "cost_models"))


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called in the function that calls this
    one, attributing the warning to the first frame outside autopar (the user's
    ``plan(...)`` or ``auto_parallel(...)`` line); torch's and the standard library's frames between
    (export, contextlib) are skipped too, since the user did not write them either."""
    frame = sys._getframe(1)  # our caller, which passes the result to warnings.warn: level 1
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_OURS) or "/torch/" in name or name.startswith("<frozen")
                or name.endswith(("contextlib.py", "functools.py"))):
            return level
        frame = frame.f_back
        level += 1
    return 1


def warn(message: str, category: type[Warning] | None = None) -> None:
    """``warnings.warn`` attributed to the user's call site (see :func:`user_stacklevel`);
    ``category`` defaults to :class:`AutoparWarning`."""
    warnings.warn(message, category or AutoparWarning, stacklevel=user_stacklevel())
