"""Where exports written before autopar's packages (``module.py`` of an export made by
autopar 0.1.0 up to the move) import :func:`attach` from; the export code itself is
:mod:`autopar.module.export`."""

from autopar.module.export import attach

__all__ = ["attach"]
