"""Test-session defaults.

``AUTOPAR_CALIBRATE=0``: ``auto_parallel`` in a process group with no mesh description
named would otherwise calibrate the running ranks (:mod:`autopar.cost_models.live`),
about 10 s on 4 ranks here, and plan on numbers that follow the host's load; the tests
plan on the presets, so a case's plan is the same from run to run.  The tests of live
calibration itself (``tests/dist/test_live_calibration.py``) turn it back on in their
ranks.  Set before any rank is forked or spawned, which inherit it; a value already in
the environment is kept.
"""

import os

os.environ.setdefault("AUTOPAR_CALIBRATE", "0")
