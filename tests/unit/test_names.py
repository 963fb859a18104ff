"""One name for one thing: ``autopar.plan`` is the function, ``autopar.plans`` the
package of plan data, and both are reachable the way a user writes them."""

from __future__ import annotations

import subprocess
import sys


def test_plan_data_package_imports_beside_the_plan_function():
    # a fresh interpreter: in this process the modules may already sit in sys.modules,
    # which hides the attribute lookup ``import a.b.c as d`` does on ``a.b``
    code = ("import autopar, autopar.api\n"
            "import autopar.plans.data as d\n"
            "assert d.Plan is autopar.Plan and autopar.plans.data.Plan is autopar.Plan\n"
            "assert autopar.plan is autopar.api.plan and callable(autopar.plan)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
