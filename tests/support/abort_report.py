"""Keep what a test's children printed before a SIGABRT, for the rerun summary.

A 2-process gloo job can die of SIGABRT at interpreter exit (see ``addopts`` in
``pyproject.toml``), and such a test runs once more. pytest prints a test's captured
output only when it finally fails, so a rerun that passes used to leave a bare ``R``: not which
test it was, nor the children's stacks (``PYTHONFAULTHANDLER``, set in ``conftest.py``). This
hook adds the captured stderr of such a failure to its report, which
``--rerun-show-tracebacks`` prints under "rerun test summary info".
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

STDERR_KEPT = 20_000  # characters from the end of the captured stderr: the stacks are last


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed report naming SIGABRT (what ``--only-rerun`` matches, traceback text included)
    gets the test's captured stderr as a section, unless it is the last try: pytest prints a
    final failure's captured output itself."""
    report = yield
    longrepr = report.longrepr
    reruns = item.config.getoption("reruns", None) or 0  # None without --reruns
    reruns_left = getattr(item, "execution_count", 1) <= reruns
    if reruns_left and report.failed and hasattr(longrepr, "addsection"):
        stderr = "".join(text for name, text in report.sections if "stderr" in name)
        if stderr and "SIGABRT" in str(longrepr):
            longrepr.addsection("stderr before the abort", stderr[-STDERR_KEPT:])
    return report
