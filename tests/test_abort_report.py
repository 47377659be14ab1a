"""The rerun summary of a test whose child died of SIGABRT names the test and shows the child's
stack (tests/abort_report.py), in a real pytest run of a real aborting process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import REPO

# Its first run starts a child that prints a marker (not spelt as such in the source, which
# the traceback quotes) and its faulthandler stack to the inherited stderr (captured by pytest,
# not by the test) and aborts; its rerun passes.
ABORTS_ONCE = """
import subprocess, sys
from pathlib import Path

def test_a_child_aborts_once(tmp_path_factory):
    flag = Path(__file__).with_name("aborted")
    if flag.exists():
        return
    flag.touch()
    child = "import os, sys; print('marker', 'of the child', file=sys.stderr); os.abort()"
    code = subprocess.run([sys.executable, "-X", "faulthandler", "-c", child]).returncode
    assert code == 0, "the child died of SIGABRT"
"""


def rerun_summary(folder: Path, *plugin: str) -> str:
    """What pytest prints for ABORTS_ONCE, run with the project's rerun options."""
    (folder / "test_child.py").write_text(ABORTS_ONCE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    options = ["--reruns=1", "--only-rerun=SIGABRT", "--rerun-show-tracebacks"]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *plugin, *options]
    done = subprocess.run([*command, "test_child.py"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed, 1 rerun" in done.stdout, done.stdout[-3000:]
    return done.stdout.split("rerun test summary info")[1]


def test_the_rerun_summary_keeps_the_aborted_childs_stderr(tmp_path: Path) -> None:
    (tmp_path / "with").mkdir()
    summary = rerun_summary(tmp_path / "with", "-p", "abort_report")
    assert "RERUN test_child.py::test_a_child_aborts_once" in summary
    assert "marker of the child" in summary and "Fatal Python error: Aborted" in summary
    (tmp_path / "without").mkdir()  # pytest alone drops what the first run's child printed
    assert "marker of the child" not in rerun_summary(tmp_path / "without")
