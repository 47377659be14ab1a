"""The exact log-mel extractor a cache was built with: stored in its index, checked by readers.

Feeding one vocoder another's mel gives "robotic output with very low volume"
(gemelo-ai/vocos#39), so two caches are interchangeable only when every key here matches;
the digest of these keys is stored with the cache and every reader compares it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from melcache.errors import UserError
from melcache.sections import bounded, check_numbers, load_toml, make_section, preset_names, require

# Bounds that keep every derived size (ring slots, filterbanks) sane for any index read.
MAX_SAMPLE_RATE = 768_000
MAX_N_FFT = 1 << 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """The exact log-mel extractor; two caches are interchangeable only if these match.

    ``center=True`` reflect-pads ``n_fft // 2`` on both sides (torchaudio, vocos, ChatTTS:
    ``1 + samples // hop`` frames); ``center=False`` reflect-pads ``(n_fft - hop) / 2``
    (HiFi-GAN, BigVGAN: ``samples // hop`` frames). The magnitude is
    ``sqrt(re² + im² + magnitude_eps)`` and the stored value ``ln(max(mel, log_floor))``.
    """

    sample_rate: int = bounded(24_000, 1, MAX_SAMPLE_RATE)
    n_fft: int = bounded(1024, 1, MAX_N_FFT)
    win_length: int = bounded(1024, 1, MAX_N_FFT)  # and at most n_fft
    hop_length: int = bounded(256, 1, MAX_N_FFT)  # and at most win_length
    n_mels: int = bounded(100, 1, MAX_N_FFT // 2 + 1)  # and at most the FFT's bins
    f_min: float = bounded(0.0, 0, MAX_SAMPLE_RATE / 2)
    f_max: float = bounded(12_000.0, 0, MAX_SAMPLE_RATE / 2, open_low=True)  # ≤ sample_rate / 2
    mel_scale: str = "htk"
    mel_norm: str = "none"
    center: bool = True
    magnitude_eps: float = bounded(0.0, 0, 1e6)
    log_floor: float = bounded(1e-5, 0, 1e6, open_low=True)

    def __post_init__(self) -> None:
        check_numbers(self, "features")
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
        require(
            0 < self.n_mels <= self.n_fft // 2 + 1,
            "features.n_mels",
            self.n_mels,
            f"between 1 and the FFT's {self.n_fft // 2 + 1} bins",
        )
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


def features_from_dict(table: Mapping[str, Any], source: str = "index") -> FeatureConfig:
    """Rebuild a FeatureConfig from its ``to_dict`` form (as stored in an index)."""
    return make_section(FeatureConfig, table, "features", source)


def check_features(
    features: FeatureConfig, expect: Mapping[str, Any] | FeatureConfig | None, cache: str
) -> None:
    """Refuse a cache whose feature config differs from what the caller expects."""
    if expect is None:
        return
    wanted = expect.to_dict() if isinstance(expect, FeatureConfig) else dict(expect)
    have = features.to_dict()
    for key, value in wanted.items():
        if key not in have:
            raise UserError(
                f"expect_features names unknown feature key {key!r}; known: {', '.join(have)}"
            )
        same = (
            math.isclose(have[key], value, rel_tol=1e-9)
            if isinstance(value, float) and isinstance(have[key], (int, float))
            else have[key] == value
        )
        if not same:
            raise UserError(
                f"cache {cache} was built with features.{key} = {have[key]!r}, but "
                f"{value!r} is expected; rebuild the cache or change the model's features"
            )


@functools.cache
def feature_presets() -> dict[str, FeatureConfig]:
    """The installed presets that have a ``[features]`` table (``chattts``, ``hifigan``), by
    name: the extractors a model may declare (train/model/contract.py), read from the preset files."""
    tables = {name: load_toml(name) for name in preset_names()}
    return {
        name: make_section(FeatureConfig, table["features"], "features", name)
        for name, table in tables.items()
        if "features" in table
    }
