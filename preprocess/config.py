"""Feature and build configuration: frozen dataclasses read from a TOML preset.

A preset has two tables, ``[features]`` (what a mel *is*: stored with the cache and
checked by every reader) and ``[build]`` (how the cache is laid out). Every key has a
default equal to the ChatTTS / vocos preset, so an empty file is a valid config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from preprocess.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """The exact log-mel extractor; two caches are interchangeable only if these match.

    ``center=True`` reflect-pads ``n_fft // 2`` on both sides (torchaudio, vocos, ChatTTS:
    ``1 + samples // hop`` frames); ``center=False`` reflect-pads ``(n_fft - hop) / 2``
    (HiFi-GAN, BigVGAN: ``samples // hop`` frames). The magnitude is
    ``sqrt(re² + im² + magnitude_eps)`` and the stored value ``ln(max(mel, log_floor))``.
    """

    sample_rate: int = 24_000
    n_fft: int = 1024
    win_length: int = 1024
    hop_length: int = 256
    n_mels: int = 100
    f_min: float = 0.0
    f_max: float = 12_000.0
    mel_scale: str = "htk"
    mel_norm: str = "none"
    center: bool = True
    magnitude_eps: float = 0.0
    log_floor: float = 1e-5

    def __post_init__(self) -> None:
        require(
            self.sample_rate > 0, "features.sample_rate", self.sample_rate, "a positive rate in Hz"
        )
        require(self.n_fft > 0, "features.n_fft", self.n_fft, "a positive FFT size")
        require(
            0 < self.win_length <= self.n_fft,
            "features.win_length",
            self.win_length,
            f"between 1 and n_fft ({self.n_fft})",
        )
        require(
            0 < self.hop_length <= self.win_length,
            "features.hop_length",
            self.hop_length,
            f"between 1 and win_length ({self.win_length})",
        )
        require(self.n_mels > 0, "features.n_mels", self.n_mels, "a positive number of bands")
        require(
            0 <= self.f_min < self.f_max <= self.sample_rate / 2,
            "features.f_max",
            self.f_max,
            f"above f_min ({self.f_min}) and at most sample_rate / 2 ({self.sample_rate / 2})",
        )
        require(
            self.mel_scale in ("htk", "slaney"),
            "features.mel_scale",
            self.mel_scale,
            '"htk" or "slaney"',
        )
        require(
            self.mel_norm in ("none", "slaney"),
            "features.mel_norm",
            self.mel_norm,
            '"none" or "slaney"',
        )
        require(
            self.magnitude_eps >= 0,
            "features.magnitude_eps",
            self.magnitude_eps,
            "zero or positive",
        )
        require(
            self.log_floor > 0,
            "features.log_floor",
            self.log_floor,
            "a positive floor such as 1e-5",
        )
        require(
            self.center or (self.n_fft - self.hop_length) % 2 == 0,
            "features.center",
            self.center,
            "true, or n_fft - hop_length must be even for HiFi-GAN style padding",
        )

    @property
    def frames_per_second(self) -> float:
        """Mel frames per second of audio."""
        return self.sample_rate / self.hop_length

    def num_frames(self, num_samples: int) -> int:
        """Frames the extractor yields for ``num_samples`` samples at ``sample_rate``."""
        if self.center:
            return 1 + num_samples // self.hop_length
        return num_samples // self.hop_length

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, the form stored in the index."""
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Stable hash of every feature key: equal digests mean interchangeable mels."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


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

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, the form stored in the index."""
        out = dataclasses.asdict(self)
        out["bucket_edges_seconds"] = list(self.bucket_edges_seconds)
        return out


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise a UserError naming the config key, its bad value and what would be valid."""
    if not ok:
        raise UserError(f"config key {key} = {value!r} is invalid: expected {expected}")


def _make(cls: type, table: Mapping[str, Any], section: str, source: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise UserError(
            f"{source}: unknown key {section}.{unknown[0]}; known keys are {', '.join(sorted(known))}"
        )
    values = dict(table)
    if "bucket_edges_seconds" in values:
        values["bucket_edges_seconds"] = tuple(values["bucket_edges_seconds"])
    try:
        return cls(**values)
    except TypeError as exc:
        raise UserError(f"{source}: bad [{section}] table: {exc}") from None


def features_from_dict(table: Mapping[str, Any], source: str = "index") -> FeatureConfig:
    """Rebuild a FeatureConfig from its ``to_dict`` form (as stored in an index)."""
    return _make(FeatureConfig, table, "features", source)


def load_config(path: Path | None) -> tuple[FeatureConfig, BuildConfig]:
    """Read ``[features]`` and ``[build]`` from a TOML preset; ``None`` gives the defaults."""
    if path is None:
        return FeatureConfig(), BuildConfig()
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"config file {path} cannot be read: {exc}") from None
    extra = sorted(set(data) - {"features", "build"})
    if extra:
        raise UserError(f"{path}: unknown table [{extra[0]}]; expected [features] and [build]")
    features = _make(FeatureConfig, data.get("features", {}), "features", str(path))
    build = _make(BuildConfig, data.get("build", {}), "build", str(path))
    return features, build
