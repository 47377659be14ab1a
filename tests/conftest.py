"""Shared fixtures: the committed sample corpus and a cache built from it by the real build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO / "examples" / "wavs"
# Few buckets and small shards: the 30-utterance corpus then spreads over ≥ 8 shards,
# enough for 2 ranks × 2 workers.
SMALL_SHARDS_TOML = """
[build]
num_buckets = 4
min_shards = 8
"""


def run_preprocess(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python -m preprocess ARGS`` as a user would; return the finished process."""
    done = subprocess.run(
        [sys.executable, "-m", "preprocess", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"preprocess {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
        )
    return done


@pytest.fixture(scope="session")
def small_shards_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build config TOML giving many small shards."""
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(SMALL_SHARDS_TOML)
    return path


def build_cache(out: Path, config: Path, *extra: str) -> Path:
    """Build the sample corpus into ``out`` with ``config``, one worker, as a user would."""
    run_preprocess(
        "build",
        "--src",
        str(SAMPLE_CORPUS),
        "--out",
        str(out),
        "--config",
        str(config),
        "--workers",
        "1",
        *extra,
    )
    return out


@pytest.fixture(scope="session")
def sample_cache(tmp_path_factory: pytest.TempPathFactory, small_shards_config: Path) -> Path:
    """The sample corpus built once per test session (read-only: copy it before damaging it)."""
    return build_cache(tmp_path_factory.mktemp("sample_cache"), small_shards_config)


# --- Trainer tests (tests/test_train*.py) -------------------------------------------------
# Short utterances only (≤ 4.5 s, 23 of the 30): attention cost grows with the square of the
# length, and the trainer tests run several 2-process jobs on shared CPU cores.
TRAIN_CACHE_TOML = """
[build]
num_buckets = 3
min_shards = 8
max_seconds = 4.5
"""


@pytest.fixture(scope="session")
def train_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus's short utterances, built once by the real build (read-only)."""
    root = tmp_path_factory.mktemp("train_cache")
    config = root / "short.toml"
    config.write_text(TRAIN_CACHE_TOML)
    return build_cache(root / "cache", config)
