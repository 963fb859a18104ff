"""How the suite is spread over pytest-xdist's workers (``--dist loadgroup``, pyproject).

A test file's tests go to one worker together: a file's module fixtures (one process
group for many equivalence cases, a shared capture) are then made once.  The
documentation's code blocks are spread by page instead: a page's blocks share a working
directory and run in page order, and ``tests/unit/test_docs.py`` as one group was the
slow step's last ten minutes on one worker while the other sat idle."""

from __future__ import annotations

import pytest

BY_PAGE = "tests/unit/test_docs.py"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its own hook, same name)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test its xdist group: its file, or its file and page for the docs."""
    for item in items:
        group = item.nodeid.split("::")[0]
        where = getattr(getattr(item, "callspec", None), "params", {}).get("where")
        if group == BY_PAGE and where is not None:
            group += ":" + where.rsplit(":", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
