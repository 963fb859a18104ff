"""The ``autopar`` command line: ``plan``, ``explain``, ``diff``, ``presets``,
``calibrate``, ``check``, ``run`` and ``launch``.

The top layer: it may import everything below it (the API, search, report, module);
nothing imports it.
"""

from autopar.cli.args import CLIError
from autopar.cli.main import main

__all__ = ["CLIError", "main"]
