"""benchmarks/build_bench.py end to end on a small corpus: every row the README table reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_build_bench_prints_every_row(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.build_bench", "--hours", "0.06"]
    command += ["--workers", "2", "--data", str(tmp_path / "data")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["row"]: row for row in map(json.loads, done.stdout.splitlines())}
    build, native = rows["preprocess build"], rows["preprocess build, sources already 24 kHz"]
    # Steady rates are differences of two short walls here: present, but noise in sign.
    assert build["audio_hours"] >= 0.06 and build["real_time_x"] > 0
    assert isinstance(build["steady_real_time_x"], int)
    assert isinstance(native["steady_real_time_x"], int)
    assert rows["naive librosa loop"]["real_time_x"] > 0
    components = rows["components, one core"]
    for step in ("decode", "decode_stock", "resample", "mel", "mel_stock"):
        assert components[f"{step}_real_time_x"] > 0, step
    assert components["bound_2_workers_x"] > 0 and components["stock_bound_2_workers_x"] > 0
    assert set(rows["ratio"]) == {
        "row",
        "build_steady_over_naive",
        "build_steady_over_component_bound",
    }
    # the 24 kHz copy holds the same utterances, resampled once
    assert sorted(p.name for p in (tmp_path / "data").glob("speech-0.06h-24k/**/*.wav")) == sorted(
        p.name for p in (tmp_path / "data").glob("speech-0.06h/**/*.wav")
    )
