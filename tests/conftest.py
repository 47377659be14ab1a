"""Shared fixtures: the committed sample corpus built by the real build, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SMALL_SHARDS_TOML, TRAIN_CACHE_TOML, build_cache


@pytest.fixture(scope="session")
def small_shards_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build config TOML giving many small shards."""
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(SMALL_SHARDS_TOML)
    return path


@pytest.fixture(scope="session")
def sample_cache(tmp_path_factory: pytest.TempPathFactory, small_shards_config: Path) -> Path:
    """The sample corpus built once per test session (read-only: copy it before damaging it)."""
    return build_cache(tmp_path_factory.mktemp("sample_cache"), small_shards_config)


# The sample corpus's short utterances: the trainer tests run several 2-process jobs.
@pytest.fixture(scope="session")
def train_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus's short utterances, built once by the real build (read-only)."""
    root = tmp_path_factory.mktemp("train_cache")
    config = root / "short.toml"
    config.write_text(TRAIN_CACHE_TOML)
    return build_cache(root / "cache", config)
