"""``torch.compile`` with an eager fallback: a compile that fails runs eagerly, said once.

``torch.compile`` compiles on the first call, so a backend that cannot compile a graph
(a missing compiler, an op inductor does not lower) fails in the user's training loop.
:class:`CompiledOrEager` catches that failure, runs the same call eagerly and, where the
eager call succeeds (so the failure was the compiler's, not the input's), warns once
with the compiler's error and runs eagerly from then on.  Where the eager call fails
too, its error is the user's and is raised as it is.  Compilation runs before any of
the graph's collectives, so a rank that falls back issues the same collectives in the
same order as one that compiled.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch._dynamo.exc import TorchDynamoException

from autopar.errors import CompileFallbackWarning
from autopar.log import log

try:  # inductor's own error (newer torch); older torch wraps inductor's errors in dynamo's
    from torch._inductor.exc import InductorError
    _COMPILE_ERRORS: tuple[type[BaseException], ...] = (TorchDynamoException, InductorError)
except ImportError:
    _COMPILE_ERRORS = (TorchDynamoException,)


def _cause(e: BaseException) -> str:
    """The compiler's error in one line: the innermost exception dynamo wrapped."""
    while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None:
        e = inner
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


class CompiledOrEager:
    """``fn`` through ``torch.compile(fn, *args, **kwargs)``, eager where that fails
    (see the module docstring); ``what`` names the graph in the warning."""

    def __init__(self, fn: Callable, what: str, *args, **kwargs) -> None:
        self.eager = fn
        self.compiled: Callable | None = torch.compile(fn, *args, **kwargs)
        self.what = what
        self.failure: str | None = None
        """The compiler's error once it failed (then every call runs eagerly)."""

    def __call__(self, *args, **kwargs):
        """``fn(*args, **kwargs)``, compiled unless compiling it failed."""
        if self.compiled is None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except _COMPILE_ERRORS as e:
            out = self.eager(*args, **kwargs)  # raises the user's error where it is one
            self.compiled, self.failure = None, _cause(e)
            text = (f"autopar: torch.compile failed on {self.what}; it runs eagerly (correct, "
                    f"not as fast). Pass compile=False to skip compiling. The error: {self.failure}")
            log.warning(text)
            warnings.warn(text, CompileFallbackWarning, stacklevel=2)
            return out


__all__ = ["CompiledOrEager"]
