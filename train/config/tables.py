"""Trainer configuration: one frozen dataclass per concern, read from a TOML file.

A trainer config has four tables — ``[model]``, ``[data]``, ``[optim]``, ``[train]`` —
separate from the build config (``[features]``/``[build]``) that made the cache. Every key
has a default, so an empty file is valid; ``key=value`` overrides on the command line use
the dotted path (``train.max_steps=20``, ``model.args.dim=64``) and TOML value syntax.
The resolved config is saved in every checkpoint and in ``OUT/config.json``. The ``[train]``
table, the largest, has its own module (``train/config/train_table.py``) with one sub-table per
room of the trainer; its flat keys of earlier releases are moved by ``train/config/renamed.py``.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from melcache.errors import UserError
from melcache.loader.data_config import DataConfig
from melcache.sections import bounded, check_numbers, check_tables, load_toml, make_section, require
from train.config.renamed import move_renamed_keys
from train.config.train_table import TrainConfig

CLIPS = ("norm", "zclip", "autoclip")
_STEPS = 10**12  # an upper bound for step counts: more steps than any run will take


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to build and the mel features it expects from the cache.

    ``impl`` is any ``"package.module:Class"`` honouring the contract in ``train.model.text_to_mel``;
    ``args`` are passed to its constructor as keyword arguments.
    """

    impl: str = "train.model:TextToMel"
    n_mels: int = bounded(100, 1, 4096)
    sample_rate: int = bounded(24_000, 1, 768_000)  # Hz
    hop_length: int = bounded(256, 1, 1 << 16)  # samples
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_numbers(self, "model")
        module, _, name = self.impl.partition(":")
        require(bool(module and name), "model.impl", self.impl, '"package.module:Class"')
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
    vocab: str = ""  # "chars": a file of one character a line; a tokenizer class's files
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

    lr: float = bounded(1e-3, 0, 100, open_low=True)
    min_lr: float = bounded(1e-5, 0, 100)  # and at most lr
    warmup_steps: int = bounded(100, 0, _STEPS)
    decay_steps: int = bounded(10_000, 1, _STEPS)  # cosine reaches min_lr here and stays there
    weight_decay: float = bounded(0.01, 0, 100)
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = bounded(1e-8, 0, 1, open_low=True)
    grad_clip: float = bounded(1.0, 0, 1e12)  # max global grad norm; 0 turns clipping off
    # "norm": at grad_clip; "zclip" / "autoclip": adaptive limits under it (train/optim/clipping.py).
    clip: str = "norm"
    # EMA factor of the norms' mean and variance
    zclip_alpha: float = bounded(0.97, 0, 1, open_low=True, open_high=True)
    zclip_z: float = bounded(2.5, 0, 1_000, open_low=True)  # z-score above which norms shrink
    zclip_warmup: int = bounded(25, 2, 1_000_000)  # steps that only collect norms
    autoclip_percentile: float = bounded(10.0, 0, 100, open_low=True)  # of past norms: the limit
    autoclip_window: int = bounded(1_000, 1, 1_000_000)  # past norms kept

    def __post_init__(self) -> None:
        check_numbers(self, "optim")
        require(self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"in [0, lr={self.lr}]")
        require(
            self.decay_steps > self.warmup_steps,
            "optim.decay_steps",
            self.decay_steps,
            f"more than warmup_steps ({self.warmup_steps})",
        )
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else ()
        require(
            len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas),
            "optim.betas",
            self.betas,
            "two numbers in [0, 1), e.g. [0.9, 0.98]",
        )
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        require(self.clip in CLIPS, "optim.clip", self.clip, " or ".join(CLIPS))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        """Build and validate from nested tables; unknown tables or keys are errors, and the
        flat ``[train]`` keys of earlier releases are moved to their sub-tables, with a warning."""
        check_tables(data, _SECTIONS, source)
        data = move_renamed_keys(data, source)
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
            if raw.lstrip().startswith(("[", "{")):  # a list or table the shell unquoted
                raise UserError(
                    f"override {item!r}: {raw.strip()} is not a TOML list or table (a shell "
                    f"drops the quotes inside it): quote the whole override, as in "
                    f"'{key.strip()}=[\"tensorboard\"]'"
                ) from None
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
    for path in paths:  # old key names are moved per file, so a later file's new name wins
        data = merge(data, move_renamed_keys(load_toml(path, _SECTIONS), str(path)))
    source = " + ".join(map(str, paths)) or "defaults"
    if overrides:
        data = merge(data, move_renamed_keys(parse_overrides(overrides), "override"))
        source += " with overrides"
    return Config.from_dict(data, source)
