"""``python -m autopar.cli``: the ``autopar`` command."""

import sys

from autopar.cli.main import main

sys.exit(main())
