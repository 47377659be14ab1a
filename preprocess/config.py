"""Build configuration: the ``[build]`` table of a preset, and reading a whole preset.

A preset has two tables, ``[features]`` (what a mel *is*: :class:`melcache.features.FeatureConfig`,
stored with the cache and checked by every reader) and ``[build]`` (how the cache is laid
out). Every key has a default equal to the ChatTTS / vocos preset, so an empty file is a
valid config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from melcache.extras import name_problem
from melcache.features import FeatureConfig
from melcache.sections import load_toml, make_section, require
from melcache.storage import FP16, STORAGES


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How utterances are filtered, bucketed and packed into shards."""

    min_seconds: float = 0.3
    max_seconds: float = 30.0
    num_buckets: int = 10
    bucket_edges_seconds: tuple[float, ...] = ()
    shard_max_samples: int = 4000
    shard_max_bytes: int = 128_000_000
    min_shards: int = 64
    silence_dbfs: float = -70.0
    storage: str = FP16  # how mels are stored: melcache.storage.STORAGES
    # Row fields each sample carries for models that ask (language, ...): melcache/extras.py
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        require(self.min_seconds > 0, "build.min_seconds", self.min_seconds, "a positive duration")
        require(
            self.max_seconds > self.min_seconds,
            "build.max_seconds",
            self.max_seconds,
            f"above min_seconds ({self.min_seconds})",
        )
        require(self.num_buckets >= 1, "build.num_buckets", self.num_buckets, "at least 1")
        edges = self.bucket_edges_seconds
        require(
            all(self.min_seconds < e < self.max_seconds for e in edges)
            and list(edges) == sorted(set(edges)),
            "build.bucket_edges_seconds",
            list(edges),
            "strictly increasing inner edges between min_seconds and max_seconds",
        )
        require(
            self.shard_max_samples >= 1,
            "build.shard_max_samples",
            self.shard_max_samples,
            "at least 1",
        )
        require(
            self.shard_max_bytes >= 1 << 16,
            "build.shard_max_bytes",
            self.shard_max_bytes,
            "at least 65536",
        )
        require(self.min_shards >= 1, "build.min_shards", self.min_shards, "at least 1")
        require(
            self.silence_dbfs < 0, "build.silence_dbfs", self.silence_dbfs, "negative, e.g. -70"
        )
        require(
            self.storage in STORAGES,
            "build.storage",
            self.storage,
            " or ".join(map(repr, STORAGES)),
        )

        extras = self.extras
        problem = name_problem(extras) if isinstance(extras, tuple) else "a list of field names"
        shown = list(extras) if isinstance(extras, tuple) else extras
        require(problem is None, "build.extras", shown, problem or "")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, the form stored in the index."""
        out = dataclasses.asdict(self)
        out["bucket_edges_seconds"] = list(self.bucket_edges_seconds)
        if self.storage == FP16:  # absent as before it existed: fp16 caches keep their digests
            del out["storage"]
        if self.extras:  # likewise absent when empty
            out["extras"] = list(self.extras)
        else:
            del out["extras"]
        return out


_TABLES = {"features": FeatureConfig, "build": BuildConfig}


def load_config(path: Path | None) -> tuple[FeatureConfig, BuildConfig]:
    """Read ``[features]`` and ``[build]`` from a TOML preset; ``None`` gives the defaults."""
    data = {} if path is None else load_toml(path, _TABLES)
    source = str(path)
    features = make_section(FeatureConfig, data.get("features", {}), "features", source)
    build = make_section(BuildConfig, data.get("build", {}), "build", source)
    return features, build
