"""Trainer configuration: one frozen dataclass per concern, read from a TOML file.

A trainer config has four tables — ``[model]``, ``[data]``, ``[optim]``, ``[train]`` —
separate from the build config (``[features]``/``[build]``) that made the cache. Every key
has a default, so an empty file is valid; ``key=value`` overrides on the command line use
the dotted path (``train.max_steps=20``, ``model.args.dim=64``) and TOML value syntax.
The resolved config is saved in every checkpoint and in ``OUT/config.json``.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from melcache.config import check_tables, load_toml, make_section, require
from melcache.errors import UserError
from melcache.reader import SHARD_CHECKS

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
STRATEGIES = ("ddp", "fsdp2", "hsdp")
ON_ERROR = ("raise", "skip")
CLIPS = ("norm", "zclip", "autoclip")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to build and the mel features it expects from the cache.

    ``impl`` is any ``"package.module:Class"`` honouring the contract in ``train.model``;
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
class DataConfig:
    """The ``[data]`` table: the streaming loader's one configuration, handed whole to
    ``train.data.make_loader`` and on to its workers (job rank, world size and seed aside)."""

    # Padded mel frames per micro-batch per rank: one count for every length bucket, or a
    # table {bucket: count} (``python -m train tune`` writes one), since attention memory grows
    # with the square of the length and a budget safe for the longest bucket starves the rest.
    batch_frames: int | Mapping[str, int] = 6_000
    max_batch_size: int = 64
    num_workers: int = 2
    pad_multiple: int = 8
    on_error: str = "raise"
    shard_check: str = "fast"  # "fast" (xxh3_128 every read), "sha256" or "off": README Loading
    mel_stats: bool = True  # hand the cache's per-channel mean/std (stats.zarr) to the model
    # Every rank's batches of a step from one length bucket (README "Streaming loader");
    # false: the stream of earlier releases (one cache: the same batches, old states resume).
    sync_buckets: bool = True
    # Frame shares of the caches of a mix, keyed by location as given to --shards (default:
    # their hours), and α: the shares used are ∝ weight^α (α < 1 lifts small caches).
    mix: Mapping[str, float] = dataclasses.field(default_factory=dict)
    mix_temperature: float = 1.0
    tokenizer: str = (
        "bytes"  # "bytes", "chars" (with vocab) or "package.module:name": train/tokenizers.py
    )
    vocab: str = ""  # the "chars" tokenizer's file: one character per line
    val_shards: str = ""  # a second cache for validation (--val-shards): train/validation.py
    # Per-utterance fields each batch carries in batch.extras ([build] extras of the cache, or
    # "reference"): train/collate.py; a plug-in's melcache_contract "extras" adds its own.
    extras: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.batch_frames, Mapping):
            object.__setattr__(self, "batch_frames", _budget_table(self.batch_frames))
        else:
            require(_is_count(self.batch_frames), "data.batch_frames", self.batch_frames, _BUDGET)
        require(isinstance(self.tokenizer, str), "data.tokenizer", self.tokenizer, _TOKENIZER)
        require(self.max_batch_size > 0, "data.max_batch_size", self.max_batch_size, "≥ 1")
        require(self.num_workers >= 0, "data.num_workers", self.num_workers, "0 or more")
        require(self.pad_multiple > 0, "data.pad_multiple", self.pad_multiple, "≥ 1")
        require(self.on_error in ON_ERROR, "data.on_error", self.on_error, " or ".join(ON_ERROR))
        require(
            self.shard_check in SHARD_CHECKS,
            "data.shard_check",
            self.shard_check,
            " or ".join(SHARD_CHECKS),
        )
        require(
            isinstance(self.sync_buckets, bool),
            "data.sync_buckets",
            self.sync_buckets,
            "true or false",
        )
        require(
            isinstance(self.mix, Mapping), "data.mix", self.mix, "a table of locations to weights"
        )
        for where, weight in self.mix.items():
            require(
                isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0,
                f"data.mix.{where}",
                weight,
                "a positive weight",
            )
        require(
            isinstance(self.extras, tuple) and all(isinstance(n, str) and n for n in self.extras),
            "data.extras",
            self.extras,
            "a list of field names",
        )
        require(
            self.mix_temperature >= 0, "data.mix_temperature", self.mix_temperature, "0 or more"
        )

    def budget(self, bucket: int) -> int:
        """Padded frames per micro-batch in length bucket ``bucket`` (the loader checks at start
        that a table names every bucket of the cache)."""
        if isinstance(self.batch_frames, int):
            return self.batch_frames
        return self.batch_frames[str(bucket)]


_TOKENIZER = '"bytes", "chars" or "package.module:name"'
_BUDGET = "a positive count, or a table of bucket numbers to counts such as {0 = 24000, 1 = 16000}"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _budget_table(table: Mapping[Any, Any]) -> dict[str, int]:
    """A ``batch_frames`` table checked and keyed by canonical bucket numbers, in order."""
    require(len(table) > 0, "data.batch_frames", dict(table), _BUDGET)
    out: dict[str, int] = {}
    for key, value in table.items():
        require(str(key).isdigit(), "data.batch_frames", dict(table), _BUDGET)
        require(_is_count(value), f"data.batch_frames.{key}", value, "a positive count")
        out[str(int(key))] = value
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


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
    # "norm": at grad_clip; "zclip" / "autoclip": adaptive limits under it (train/clipping.py).
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
class TrainConfig:
    """The loop: length, precision, accumulation, logging, checkpoints and speed options."""

    max_steps: int = 1_000  # optimizer steps; --max-steps overrides
    grad_accum: int = 1  # micro-batches per optimizer step
    # bf16 autocast (no scaler), fp16 autocast + GradScaler, or fp32; "auto" is bf16 where
    # the hardware has it (CUDA with bf16, CPUs with AVX-512/AMX) and fp32 elsewhere.
    precision: str = "auto"
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 500
    keep_checkpoints: int = 3
    async_checkpoint: bool = False  # stage on CPU, write in a background thread
    compile: bool = False
    activation_checkpointing: bool = False
    ema_decay: float = 0.0  # 0 turns the EMA of weights off; 0.999 is typical
    comm_hook: str = "none"  # DDP gradient compression: none, bf16, fp16 or powersgd
    # PowerSGD (train/powersgd.py): the factors' rank, and plain all-reduce steps before it
    # starts; its error and warm-start memory is checkpointed per rank, by parameter name.
    powersgd_rank: int = 4
    powersgd_start_iter: int = 1_000
    bucket_cap_mb: float = 25.0  # DDP's gradient bucket size (torch's default)
    # Data parallelism (README Sharding): DDP replicates everything; fsdp2 shards parameters,
    # gradients and optimizer state over all ranks, hsdp over groups of hsdp_shard_size ranks
    # (0: one node's) replicated across groups. Sharded parameters are all-gathered in bf16
    # when train.precision is bf16 (fp32 otherwise); master copy and reduction stay fp32.
    strategy: str = "ddp"
    hsdp_shard_size: int = 0
    # CUDA kernels such as embedding backward are nondeterministic by default; true turns on
    # torch.use_deterministic_algorithms (slower) so a resume is bitwise on GPUs as on CPU.
    deterministic: bool = False
    # Share of the device's memory `python -m train tune` fills with the largest batch per bucket.
    memory_target: float = 0.9
    # A model whose training forward all-reduces (train/guards.py) runs only with this key,
    # and then without out-of-memory recovery.
    allow_forward_collectives: bool = False
    find_unused_parameters: bool = False  # DDP's option, for models that skip parameters
    val_every: int = 0  # steps between validations (0: off; needs data.val_shards)
    val_batches: int = 4  # validation batches per rank, the same ones every time
    # Skip a step whose loss or grad norm is spike_sigma σ above the last spike_window
    # trained steps (once spike_min_history are in): train/spikes.py.
    skip_spikes: bool = False
    spike_sigma: float = 6.0
    spike_window: int = 128
    spike_min_history: int = 16
    # After this many spike-skipped steps in a row, go back to the last checkpoint (weights
    # and every adaptive state) while the loader goes on, skipping the batches since (PaLM's
    # rewind). 0: never. A fresh start then saves step 0, the state a first rewind returns to.
    spike_rewind_after: int = 0
    # A batch that grows (train/batchsize.py): accumulation ramped from 1 to grad_accum over
    # batch_ramp_steps (0: off), and/or doubled at logging steps while the noise scale
    # predicts a gain above batch_gain (needs noise_scale), batch_cooldown steps apart.
    batch_ramp_steps: int = 0
    batch_adaptive: bool = False
    batch_max_accum: int = 64
    batch_cooldown: int = 200
    batch_gain: float = 1.05
    # Steps in a row without an out-of-memory error after which lowered budgets grow back by
    # 1/0.9 (train/oom.py; 0: never).
    budget_regrow_steps: int = 0
    # fp16 loss scaling (train/scaler.py): overflows before the scale backs off (1: torch's
    # GradScaler, backing off at each; Megatron-LM uses 2), and the floor of the scale.
    amp_hysteresis: int = 1
    amp_min_scale: float = 1.0
    # The gradient noise scale B_simple in metrics.jsonl (train/monitor.py; DDP, 2+ ranks),
    # smoothed by an EMA of this decay (k-diffusion: 0.9998 for long runs).
    noise_scale: bool = False
    noise_scale_ema: float = 0.99

    def __post_init__(self) -> None:
        require(self.max_steps >= 0, "train.max_steps", self.max_steps, "0 or more")
        require(self.grad_accum >= 1, "train.grad_accum", self.grad_accum, "1 or more")
        require(
            self.precision in PRECISIONS, "train.precision", self.precision, " or ".join(PRECISIONS)
        )
        require(self.log_every >= 1, "train.log_every", self.log_every, "1 or more")
        require(self.ckpt_every >= 1, "train.ckpt_every", self.ckpt_every, "1 or more")
        require(
            self.keep_checkpoints >= 2,
            "train.keep_checkpoints",
            self.keep_checkpoints,
            "2 or more, so a checkpoint killed mid-write always leaves a complete one",
        )
        require(0 <= self.ema_decay < 1, "train.ema_decay", self.ema_decay, "0 (off) or in (0, 1)")
        require(
            self.comm_hook in COMM_HOOKS, "train.comm_hook", self.comm_hook, " or ".join(COMM_HOOKS)
        )
        require(0 < self.memory_target <= 1, "train.memory_target", self.memory_target, "in (0, 1]")
        require(self.val_every >= 0, "train.val_every", self.val_every, "0 (off) or more")
        require(self.val_batches >= 1, "train.val_batches", self.val_batches, "1 or more")
        require(self.powersgd_rank >= 1, "train.powersgd_rank", self.powersgd_rank, "1 or more")
        require(
            self.powersgd_start_iter >= 0,
            "train.powersgd_start_iter",
            self.powersgd_start_iter,
            "0 or more",
        )
        self._check_strategy()
        self._check_spikes()
        self._check_noise_scale()
        self._check_batch()
        require(
            self.budget_regrow_steps >= 0,
            "train.budget_regrow_steps",
            self.budget_regrow_steps,
            "≥ 0",
        )
        require(self.amp_hysteresis >= 1, "train.amp_hysteresis", self.amp_hysteresis, "≥ 1")
        require(self.amp_min_scale > 0, "train.amp_min_scale", self.amp_min_scale, "> 0")
        require(self.bucket_cap_mb > 0, "train.bucket_cap_mb", self.bucket_cap_mb, "a size in MB")

    def _check_spikes(self) -> None:
        require(isinstance(self.skip_spikes, bool), "train.skip_spikes", self.skip_spikes, "bool")
        require(self.spike_sigma > 0, "train.spike_sigma", self.spike_sigma, "a positive σ")
        require(self.spike_window >= 2, "train.spike_window", self.spike_window, "2 or more")
        require(
            2 <= self.spike_min_history <= self.spike_window,
            "train.spike_min_history",
            self.spike_min_history,
            f"in [2, spike_window={self.spike_window}]",
        )
        require(
            self.spike_rewind_after >= 0, "train.spike_rewind_after", self.spike_rewind_after, "≥ 0"
        )
        if self.spike_rewind_after:  # the streak it counts is of skipped spikes
            require(
                self.skip_spikes,
                "train.skip_spikes",
                self.skip_spikes,
                f"true with train.spike_rewind_after = {self.spike_rewind_after}: a rewind "
                "follows spike skips",
            )

    def _check_batch(self) -> None:
        require(self.batch_ramp_steps >= 0, "train.batch_ramp_steps", self.batch_ramp_steps, "≥ 0")
        require(
            self.batch_max_accum >= self.grad_accum,
            "train.batch_max_accum",
            self.batch_max_accum,
            f"at least train.grad_accum ({self.grad_accum})",
        )
        require(self.batch_cooldown >= 0, "train.batch_cooldown", self.batch_cooldown, "≥ 0")
        require(self.batch_gain >= 1, "train.batch_gain", self.batch_gain, "1 or more")
        if self.batch_adaptive:
            require(
                self.noise_scale,
                "train.noise_scale",
                self.noise_scale,
                "true with train.batch_adaptive = true (it follows the noise scale)",
            )

    def _check_noise_scale(self) -> None:
        require(isinstance(self.noise_scale, bool), "train.noise_scale", self.noise_scale, "bool")
        require(
            0 < self.noise_scale_ema < 1, "train.noise_scale_ema", self.noise_scale_ema, "in (0, 1)"
        )
        if self.noise_scale:  # its comm hook replaces DDP's; sharded gradients have none
            why = "with train.noise_scale = true"
            require(self.comm_hook == "none", "train.comm_hook", self.comm_hook, f'"none" {why}')
            require(self.strategy == "ddp", "train.strategy", self.strategy, f'"ddp" {why}')
            require(self.precision != "fp16", "train.precision", self.precision, f"not fp16 {why}")

    def _check_strategy(self) -> None:
        """FSDP2 has no DDP comm hooks and no sharded GradScaler here: refused by name."""
        require(
            self.strategy in STRATEGIES, "train.strategy", self.strategy, " or ".join(STRATEGIES)
        )
        require(self.hsdp_shard_size >= 0, "train.hsdp_shard_size", self.hsdp_shard_size, "≥ 0")
        if self.strategy != "ddp":
            why = f"not with train.strategy = {self.strategy!r}"
            require(
                self.comm_hook == "none",
                "train.comm_hook",
                self.comm_hook,
                f'"none" ({why}: DDP only)',
            )
            require(
                self.precision != "fp16",
                "train.precision",
                self.precision,
                f"bf16, fp32 or auto ({why})",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole trainer config."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
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
    "data": DataConfig,
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
