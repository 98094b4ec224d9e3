"""One line at the end of a test run: how many tests skipped because the Kubernetes binaries are absent.

A pytest plugin (registered in tests/conftest.py). A test that needs a binary of ``KUBE_ASSETS`` skips with a reason
from :func:`lab.kubeassets.absent`, which names the missing files; on a machine without them that is a few hundred
skips of one cause, easy to miss among the others. The summary counts the skips whose reason carries
:data:`lab.kubeassets.ABSENT` and says where the binaries were looked for and where the README says how to get them.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from lab.kubeassets import ABSENT, kube_assets

README_SECTION = "README.md, 'The Kubernetes binaries (KUBE_ASSETS)'"


def reason(report: pytest.TestReport) -> str:
    """The skip reason of a skipped report ("" for any other)."""
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])
    return ""


def absent_binaries(reports: Iterable[pytest.TestReport]) -> int:
    """How many tests skipped because a Kubernetes binary is absent (one per test, whatever the phase)."""
    return len({r.nodeid for r in reports if ABSENT in reason(r)})


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    n = absent_binaries(terminalreporter.stats.get("skipped", []))
    if n:
        terminalreporter.write_line(
            f"{n} test{'s' if n != 1 else ''} skipped for lack of the Kubernetes binaries in {kube_assets()} "
            f"(KUBE_ASSETS): see {README_SECTION}",
            yellow=True,
            bold=True,
        )
