"""Small compatibility shims for the supported Python versions (3.10+)."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised only on Python 3.10

    class StrEnum(str, Enum):
        """Backport of :class:`enum.StrEnum`: members are strings and print as their value."""

        def __str__(self) -> str:
            return str(self.value)


__all__ = ["StrEnum"]
