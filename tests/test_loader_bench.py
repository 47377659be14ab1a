"""benchmarks/loader_bench.py end to end on a small corpus: the rows the README table reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_loader_bench_prints_baseline_and_both_melcache_rows(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.loader_bench", "--hours", "0.05"]
    command += ["--min-seconds", "1", "--data", str(tmp_path / "data")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    base, checked, unchecked = map(json.loads, done.stdout.splitlines())
    assert base["loader"] == "on-the-fly baseline" and base["samples_per_s"] > 0
    assert (checked["check_sha256"], unchecked["check_sha256"]) == (True, False)
    for ours in (checked, unchecked):
        assert ours["loader"] == "melcache" and ours["samples_per_s"] > 0
        assert 0 <= ours["padding_fraction"] < base["padding_fraction"]
        assert set(ours["resume_first_batch_s"]) == {"1%", "90%"}
