"""Trainer configuration: one frozen dataclass per concern, read from a TOML file.

A trainer config has four tables — ``[model]``, ``[data]``, ``[optim]``, ``[train]`` —
separate from the build config (``[features]``/``[build]``) that made the cache. Every key
has a default, so an empty file is valid; ``key=value`` overrides on the command line use
the dotted path (``train.max_steps=20``, ``model.args.dim=64``) and TOML value syntax.
The resolved config is saved in every checkpoint and in ``OUT/config.json``. The ``[train]``
table, the largest, has its own module (``train/config/train_table.py``).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from melcache.errors import UserError
from melcache.loader.data_config import DataConfig
from melcache.sections import check_tables, load_toml, make_section, require
from train.config.train_table import TrainConfig

CLIPS = ("norm", "zclip", "autoclip")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to build and the mel features it expects from the cache.

    ``impl`` is any ``"package.module:Class"`` honouring the contract in ``train.model.text_to_mel``;
    ``args`` are passed to its constructor as keyword arguments.
    """

    impl: str = "train.model:TextToMel"
    n_mels: int = 100
    sample_rate: int = 24_000
    hop_length: int = 256
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        module, _, name = self.impl.partition(":")
        require(bool(module and name), "model.impl", self.impl, '"package.module:Class"')
        require(self.n_mels > 0, "model.n_mels", self.n_mels, "a positive number of bands")
        require(self.sample_rate > 0, "model.sample_rate", self.sample_rate, "a rate in Hz")
        require(self.hop_length > 0, "model.hop_length", self.hop_length, "a hop in samples")
        require(isinstance(self.args, Mapping), "model.args", self.args, "a table")

    def expected_features(self) -> dict[str, int]:
        """The feature keys the cache must match (passed to the loader's ``expect_features``)."""
        return {
            "n_mels": self.n_mels,
            "sample_rate": self.sample_rate,
            "hop_length": self.hop_length,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainDataConfig(DataConfig):
    """The ``[data]`` table: the loader's keys (:class:`~melcache.loader.DataConfig`) and the
    trainer's own, which the loader never reads."""

    mel_stats: bool = True  # hand the cache's per-channel mean/std (stats.zarr) to the model
    tokenizer: str = (
        "bytes"  # "bytes", "chars" (with vocab) or "package.module:name": train/model/tokenizers.py
    )
    vocab: str = ""  # the "chars" tokenizer's file: one character per line
    val_shards: str = ""  # a second cache for validation (--val-shards): train/run/validation.py

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.tokenizer, str), "data.tokenizer", self.tokenizer, _TOKENIZER)


_TOKENIZER = '"bytes", "chars" or "package.module:name"'


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to ``min_lr`` over ``decay_steps``.

    The schedule depends on these keys only, never on ``--max-steps``, so a run stopped
    early and resumed with a larger ``--max-steps`` follows the same learning-rate curve.
    """

    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 100
    decay_steps: int = 10_000  # cosine reaches min_lr here and stays there
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    # "norm": at grad_clip; "zclip" / "autoclip": adaptive limits under it (train/optim/clipping.py).
    clip: str = "norm"
    zclip_alpha: float = 0.97  # EMA factor of the norms' mean and variance
    zclip_z: float = 2.5  # z-score above which a norm is scaled down
    zclip_warmup: int = 25  # steps that only collect norms
    autoclip_percentile: float = 10.0  # of past norms: the limit
    autoclip_window: int = 1_000  # past norms kept

    def __post_init__(self) -> None:
        require(self.lr > 0, "optim.lr", self.lr, "a positive learning rate")
        require(0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"in [0, lr={self.lr}]")
        require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "0 or more")
        require(
            self.decay_steps > self.warmup_steps,
            "optim.decay_steps",
            self.decay_steps,
            f"more than warmup_steps ({self.warmup_steps})",
        )
        require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "0 or more")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optim.betas",
            list(self.betas),
            "two numbers in [0, 1), e.g. [0.9, 0.98]",
        )
        require(self.eps > 0, "optim.eps", self.eps, "a small positive number")
        require(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "0 (off) or a norm")
        require(self.clip in CLIPS, "optim.clip", self.clip, " or ".join(CLIPS))
        require(0 < self.zclip_alpha < 1, "optim.zclip_alpha", self.zclip_alpha, "in (0, 1)")
        require(self.zclip_z > 0, "optim.zclip_z", self.zclip_z, "a positive z-score")
        require(self.zclip_warmup >= 2, "optim.zclip_warmup", self.zclip_warmup, "2 or more")
        require(
            0 < self.autoclip_percentile <= 100,
            "optim.autoclip_percentile",
            self.autoclip_percentile,
            "in (0, 100]",
        )
        require(self.autoclip_window >= 1, "optim.autoclip_window", self.autoclip_window, "≥ 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole trainer config."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: TrainDataConfig = dataclasses.field(default_factory=TrainDataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of builtins: JSON-able and ``weights_only``-loadable."""
        out = dataclasses.asdict(self)
        out["model"]["args"] = dict(self.model.args)
        out["optim"]["betas"] = list(self.optim.betas)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> Config:
        """Build and validate from nested tables; unknown tables or keys are errors."""
        check_tables(data, _SECTIONS, source)
        parts = {
            name: make_section(kind, data.get(name, {}), name, source)
            for name, kind in _SECTIONS.items()
        }
        return cls(**parts)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": TrainDataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
}


# Deeper dotted keys than any config has; merging and validating them recurses once per key.
_MAX_KEY_DEPTH = 32


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["train.max_steps=20", "model.impl=pkg.mod:Cls"]`` → nested dict.

    Values use TOML syntax (``20``, ``1e-3``, ``true``, ``[0.9, 0.95]``, ``"text"``); a value
    that is not valid TOML is taken as a bare string, so quotes are optional for strings.
    """
    nested: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        path = key.strip().split(".")
        if not sep or len(path) < 2 or not all(path):
            raise UserError(f"override {item!r} is not of the form table.key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        except RecursionError:
            raise UserError(f"override {key.strip()}: its value is nested too deeply") from None
        if len(path) > _MAX_KEY_DEPTH:
            raise UserError(f"override {key.strip()[:80]}...: more than {_MAX_KEY_DEPTH} keys deep")
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r} conflicts with another override of {part}")
        node[path[-1]] = value
    return nested


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``extra`` into a copy of ``base`` (tables merge, values replace)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(paths: Path | Sequence[Path] | None, overrides: Sequence[str] = ()) -> Config:
    """Read trainer TOML files (``None`` or none: all defaults), each merged over the ones
    before it (a tuned ``[data.batch_frames]`` table over a preset), then apply
    ``table.key=value`` overrides."""
    paths = [] if paths is None else [paths] if isinstance(paths, (str, Path)) else list(paths)
    data: dict[str, Any] = {}
    for path in paths:
        data = merge(data, load_toml(path, _SECTIONS))
    source = " + ".join(map(str, paths)) or "defaults"
    if overrides:
        data = merge(data, parse_overrides(overrides))
        source += " with overrides"
    return Config.from_dict(data, source)
