"""The rerun summary of a test whose child died of SIGABRT names the test and shows the child's
stack (tests/support/abort_report.py), in a real pytest run of a real aborting process, with the
project's own pytest options."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from tests import conftest
from tests.support import abort_report
from tests.support.helpers import REPO

# A test whose child prints a marker (not spelt as such in the source, which the traceback
# quotes) and its faulthandler stack to the inherited stderr (captured by pytest, not by the
# test), then aborts: on the first run only, or on every run.
ABORTS = """
import subprocess, sys
from pathlib import Path

def test_a_child_aborts():
    flag = Path(__file__).with_name("aborted")
    if flag.exists() and not {always}:
        return
    flag.touch()
    child = "import os, sys; print('marker', 'of the child', file=sys.stderr); os.abort()"
    code = subprocess.run([sys.executable, "-X", "faulthandler", "-c", child]).returncode
    assert code == 0, "the child died of SIGABRT"
"""


def run_pytest(folder: Path, always: bool, *plugin: str) -> subprocess.CompletedProcess:
    """pytest on ABORTS in ``folder``, with the options of the project's ``addopts``."""
    folder.mkdir()
    (folder / "test_child.py").write_text(ABORTS.format(always=always))
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    options = shlex.split(config["tool"]["pytest"]["ini_options"]["addopts"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *plugin, *options]
    return subprocess.run([*command, "test_child.py"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_the_rerun_summary_keeps_the_aborted_childs_stderr(tmp_path: Path) -> None:
    assert conftest.pytest_runtest_makereport is abort_report.pytest_runtest_makereport
    done = run_pytest(tmp_path / "with", False, "-p", "tests.support.abort_report")
    assert done.returncode == 0 and "1 passed, 1 rerun" in done.stdout, done.stdout[-3000:]
    assert "rerun test summary info" in done.stdout, done.stdout[-3000:]
    summary = done.stdout.split("rerun test summary info")[1]
    assert "RERUN test_child.py::test_a_child_aborts" in summary, summary
    assert "marker of the child" in summary and "Fatal Python error: Aborted" in summary, summary
    # pytest alone drops what the first run's child printed
    assert "marker of the child" not in run_pytest(tmp_path / "without", False).stdout


def test_a_final_abort_shows_its_stderr_once(tmp_path: Path) -> None:
    done = run_pytest(tmp_path / "always", True, "-p", "tests.support.abort_report")
    assert done.returncode == 1 and "1 failed, 1 rerun" in done.stdout, done.stdout[-3000:]
    # the first try's in the rerun summary; the last try's as pytest's own captured stderr
    assert done.stdout.count("stderr before the abort") == 1, done.stdout[-6000:]
    assert "Captured stderr call" in done.stdout.split("rerun test summary info")[0]
