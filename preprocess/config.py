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

from melcache.extras import extras_problem
from melcache.features import FeatureConfig
from melcache.sections import bounded, check_numbers, load_toml, make_section, require
from melcache.storage import FP16, STORAGES


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How utterances are filtered, bucketed and packed into shards."""

    min_seconds: float = bounded(0.3, 0, 86_400, open_low=True)
    max_seconds: float = bounded(30.0, 0, 86_400, open_low=True)  # and above min_seconds
    num_buckets: int = bounded(10, 1, 1_000)
    bucket_edges_seconds: tuple[float, ...] = ()
    shard_max_samples: int = bounded(4000, 1, 10**9)
    shard_max_bytes: int = bounded(128_000_000, 1 << 16, 1 << 40)
    min_shards: int = bounded(64, 1, 10**7)
    silence_dbfs: float = bounded(-70.0, -1_000, 0, open_high=True)
    storage: str = FP16  # how mels are stored: melcache.storage.STORAGES
    # Row fields each sample carries for models that ask (language, ...): melcache/extras.py
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_numbers(self, "build")
        require(
            self.max_seconds > self.min_seconds,
            "build.max_seconds",
            self.max_seconds,
            f"above min_seconds ({self.min_seconds})",
        )
        edges = self.bucket_edges_seconds
        require(
            isinstance(edges, tuple)
            and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in edges)
            and all(self.min_seconds < e < self.max_seconds for e in edges)
            and list(edges) == sorted(set(edges)),
            "build.bucket_edges_seconds",
            list(edges),
            "strictly increasing inner edges between min_seconds and max_seconds",
        )
        require(
            self.storage in STORAGES,
            "build.storage",
            self.storage,
            " or ".join(map(repr, STORAGES)),
        )

        extras = self.extras
        problem = extras_problem(extras) if isinstance(extras, tuple) else "a list of field names"
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
