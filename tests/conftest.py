"""Shared fixtures: the committed sample corpus built by the real build, once per session;
ChatTTS's codes derived into it; a real S3 server (moto) per module, the sample cache pushed."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from benchmarks.common.s3_server import moto_server, s3_environment
from melcache.remote import objectstore
from tests.support.abort_report import pytest_runtest_makereport  # noqa: F401  (a hook)
from tests.support.helpers import (
    REPO,
    S3_BUCKET,
    SMALL_SHARDS_TOML,
    TRAIN_CACHE_TOML,
    build_cache,
    derive_args,
    needs_extra,
    run_ok,
    run_preprocess,
)

# Every child (torchrun ranks, spawned workers, builds) prints each thread's Python stack if it
# dies of a fatal signal: a rare SIGABRT in a gloo job then says where it happened, and
# abort_report's hook (found here by pytest) keeps it for the rerun summary.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="session", autouse=True)
def private_user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``XDG_CACHE_HOME`` in a folder of this session (each xdist worker its own), for this
    process and every child: what the suite keeps there (the text-length sidecars, matplotlib's
    and wandb's caches) stays out of the user's home and cannot carry over between runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        yield


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


@pytest.fixture
def cache_copy(sample_cache: Path, tmp_path: Path) -> Path:
    """A private copy of the sample cache, to damage."""
    return Path(shutil.copytree(sample_cache, tmp_path / "cache"))


# The sample corpus's short utterances: the trainer tests run several 2-process jobs.
@pytest.fixture(scope="session")
def train_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus's short utterances, built once by the real build (read-only)."""
    root = tmp_path_factory.mktemp("train_cache")
    config = root / "short.toml"
    config.write_text(TRAIN_CACHE_TOML)
    return build_cache(root / "cache", config)


@pytest.fixture(scope="session")
def dvae_run(train_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ChatTTS's DVAE example trained 4 steps (one process) on ``train_cache``: its run folder."""
    needs_extra("ChatTTS", "chattts")
    out = tmp_path_factory.mktemp("dvae") / "run"
    config = REPO / "examples" / "chattts_dvae" / "config.toml"
    command = [sys.executable, "-m", "train", "--shards", str(train_cache), "--config"]
    command += [str(config), "--out", str(out), "--max-steps", "4", "train.checkpoint.every=4"]
    run_ok(command, timeout=600)
    return out


@pytest.fixture(scope="session")
def derived(train_cache: Path, dvae_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``train_cache`` with ChatTTS's codes derived by one single-part derive with
    ``dvae_run`` (read-only: copy it before damaging it)."""
    cache = tmp_path_factory.mktemp("single") / "cache"
    shutil.copytree(train_cache, cache)
    run_preprocess(*derive_args(cache, dvae_run))
    return cache


@pytest.fixture(scope="session")
def chattts_tokenizer(train_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ChatTTS tokenizer trained on ``train_cache``'s texts (the GPT example's from scratch)."""
    pytest.importorskip("ChatTTS", reason="needs the 'chattts' extra: pip install -e '.[chattts]'")
    from examples.chattts_gpt.tokenizer import cache_texts, train_tokenizer

    out = tmp_path_factory.mktemp("chattts_tokenizer")
    train_tokenizer(cache_texts([str(train_cache)]), out, vocab_size=1000)
    return out


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """A moto S3 server for this module, the standard environment pointing at it."""
    objectstore.forget_clients()  # a client of an earlier module's server would outlive it
    with moto_server() as url, s3_environment(url):
        boto3.client("s3").create_bucket(Bucket=S3_BUCKET)
        yield url
    objectstore.forget_clients()


@pytest.fixture(scope="module")
def pushed(endpoint: str, sample_cache: Path) -> str:
    """The sample cache published with ``python -m preprocess push``."""
    location = f"s3://{S3_BUCKET}/sample"
    done = run_preprocess("push", str(sample_cache), location)
    assert "objects uploaded" in done.stdout
    return location
