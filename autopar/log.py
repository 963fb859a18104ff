"""Live progress of a planning run, and autopar's log.

Every phase of planning (capture, pricing, each searched candidate, the solver) calls
:func:`report`.  The message always goes to the ``autopar`` logger (``logging``: INFO
for phases, DEBUG for detail), so ``logging.basicConfig(level=logging.INFO)`` or
``autopar plan --verbose`` shows it.  Inside :func:`show` (``progress=True``, and the
CLI by default) it is also shown live: on a terminal as a rich status line with the
elapsed time and the search time left, and one line per finished candidate above it;
when stderr is not a terminal (a log file, CI) as plain timestamped lines, so a long
search is never silent.  Nothing is printed outside :func:`show`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rich.console import Console
from rich.text import Text

log = logging.getLogger("autopar")
"""The ``autopar`` logger (progress at INFO, detail at DEBUG)."""


@dataclass
class _Live:
    """One active display: a rich status on a terminal, plain lines otherwise."""

    time_limit: float | None
    left: Callable[[], float] | None = None  # the search's own account of its time left
    start: float = field(default_factory=time.perf_counter)
    status: object | None = None
    console: object | None = None
    phase: str = "starting"

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _status_text(self) -> str:
        if self.left is not None:
            left = f", search time left {self.left():.0f} s"
        elif self.time_limit is not None:
            left = f", search time left {max(0.0, self.time_limit - self.elapsed()):.0f} s"
        else:
            left = ""
        return f"[autopar {self.elapsed():6.1f} s{left}] {self.phase}"

    def _text(self):
        return Text(self._status_text())  # plain text: "[autopar ...]" is not rich markup

    def update(self, message: str, done: bool) -> None:
        if self.status is not None:
            if done:
                self.console.print(f"[autopar {self.elapsed():6.1f} s] {message}",  # type: ignore[union-attr]
                                   highlight=False, markup=False)
            else:
                self.phase = message
            self.status.update(self._text())  # type: ignore[attr-defined]
        else:
            print(f"[autopar {self.elapsed():7.2f} s] {message}", file=sys.stderr, flush=True)


_active: list[_Live] = []


def report(message: str, *, done: bool = False, detail: bool = False) -> None:
    """Report a phase (``done=False``: what starts now) or a result (``done=True``:
    one finished step, e.g. a priced candidate); ``detail`` logs at DEBUG."""
    log.log(logging.DEBUG if detail else logging.INFO, message)
    if _active and not detail:
        _active[-1].update(message, done)


@contextlib.contextmanager
def show(enabled: bool, time_limit: float | None = None,
         left: Callable[[], float] | None = None) -> Iterator[None]:
    """Show :func:`report` messages live while the block runs (see the module
    docstring); ``enabled=False`` shows nothing (messages still reach the log).
    ``left``: the seconds the search has left, by its own account (the joint search's
    phase budget, :mod:`autopar.search.budget`); else ``time_limit`` minus the time elapsed."""
    if not enabled or _active:  # nested planning (a joint search's inner plans) reuses the outer
        yield
        return
    live = _Live(time_limit, left)
    if sys.stderr.isatty():
        live.console = Console(stderr=True)
        with live.console.status(live._text()) as status:
            live.status = status
            _active.append(live)
            try:
                yield
            finally:
                _active.pop()
        return
    _active.append(live)
    try:
        yield
    finally:
        _active.pop()


__all__ = ["log", "report", "show"]
