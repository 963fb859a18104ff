"""One name for one thing: ``autopar.plan`` is the function, ``autopar.plans`` the
package of plan data, and both are reachable the way a user writes them."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_no_file_name_names_three_modules():
    # a rule and its runtime form may share their op family's name (sharding/rules/norms.py,
    # runtime/norms.py); a third module of the same name leaves a reader guessing which
    # one an import or a traceback means
    files = [f for d in ("autopar", "passes", "cost_models") for f in (ROOT / d).rglob("*.py")
             if f.name != "__init__.py"]
    counts = Counter(f.name for f in files)
    assert not {n: c for n, c in counts.items() if c > 2}
