"""The ``[train]`` table: the loop's own keys, and one sub-table per room of the trainer.

``[train]`` holds what the loop itself reads (length, accumulation, precision, seed, logging,
compilation, EMA); each concern a room of ``train/`` owns has its own sub-table with the same
name: ``[train.parallel]`` (``train/parallel/``), ``[train.checkpoint]`` and
``[train.validation]`` (``train/run/``), ``[train.adapt]`` (``train/adapt/``),
``[train.memory]`` (``train/memory/``) and ``[train.amp]`` (fp16 loss scaling,
``train/optim/scaler.py``). The flat keys of earlier releases (``train.ckpt_every``) still
work with a one-line deprecation: ``train/config/renamed.py``. Every number has its range
stated beside it (``bounded``) and checked at creation.
"""

from __future__ import annotations

import dataclasses

from melcache.sections import bounded, check_numbers, require

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
STRATEGIES = ("ddp", "fsdp2", "hsdp")
TRACKERS = ("tensorboard", "wandb")  # train/run/trackers.py opens each by this name

_STEPS = 10**12  # an upper bound for step counts: more steps than any run will take
_MAX_ACCUM = 1 << 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """``[train.parallel]``: how ranks share the work (docs/training.md, "FSDP2 and HSDP").

    DDP replicates everything; fsdp2 shards parameters, gradients and optimizer state over all
    ranks, hsdp over groups of ``hsdp_shard_size`` ranks (0: one node's) replicated across
    groups. Sharded parameters are all-gathered in bf16 when ``train.precision`` is bf16 (fp32
    otherwise); master copy and reduction stay fp32.
    """

    strategy: str = "ddp"
    hsdp_shard_size: int = bounded(0, 0, 1 << 20)
    comm_hook: str = "none"  # DDP gradient compression: none, bf16, fp16 or powersgd
    # PowerSGD (train/parallel/powersgd.py): the factors' rank, and plain all-reduce steps before
    # it starts; its error and warm-start memory is checkpointed per rank, by parameter name.
    powersgd_rank: int = bounded(4, 1, 1024)
    powersgd_start_iter: int = bounded(1_000, 0, _STEPS)
    bucket_cap_mb: float = bounded(25.0, 0, 100_000, open_low=True)  # DDP's (torch's default)
    find_unused_parameters: bool = False  # DDP's option, for models that skip parameters
    # A model whose training forward all-reduces (train/model/guards.py) runs only with this
    # key, and then without out-of-memory recovery.
    allow_forward_collectives: bool = False

    def __post_init__(self) -> None:
        check_numbers(self, "train.parallel")
        require(
            self.strategy in STRATEGIES,
            "train.parallel.strategy",
            self.strategy,
            " or ".join(STRATEGIES),
        )
        require(
            self.comm_hook in COMM_HOOKS,
            "train.parallel.comm_hook",
            self.comm_hook,
            " or ".join(COMM_HOOKS),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """``[train.checkpoint]``: how often the run saves, how many saves it keeps, and how."""

    every: int = bounded(500, 1, _STEPS)  # optimizer steps between checkpoints
    # 2 or more, so a checkpoint killed mid-write always leaves a complete one
    keep: int = bounded(3, 2, 1_000_000)
    async_write: bool = False  # stage on CPU, write in a background thread

    def __post_init__(self) -> None:
        check_numbers(self, "train.checkpoint")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """``[train.validation]``: the held-out loss (train/run/validation.py; data.val_shards)."""

    every: int = bounded(0, 0, _STEPS)  # steps between validations (0: off)
    batches: int = bounded(4, 1, 1_000_000)  # validation batches per rank, the same every time

    def __post_init__(self) -> None:
        check_numbers(self, "train.validation")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptConfig:
    """``[train.adapt]``: what the run changes about itself as it goes (train/adapt/)."""

    # Skip a step whose loss or grad norm is spike_sigma σ above the last spike_window
    # trained steps (once spike_min_history are in): train/adapt/spikes.py.
    skip_spikes: bool = False
    spike_sigma: float = bounded(6.0, 0, 1_000, open_low=True)
    spike_window: int = bounded(128, 2, 1_000_000)
    spike_min_history: int = bounded(16, 2, 1_000_000)
    # After this many spike-skipped steps in a row, go back to the last checkpoint (weights
    # and every adaptive state) while the loader goes on, skipping the batches since (PaLM's
    # rewind). 0: never. A fresh start then saves step 0, the state a first rewind returns to.
    spike_rewind_after: int = bounded(0, 0, 1_000_000)
    # A batch that grows (train/adapt/batch_ramp.py): accumulation ramped from 1 to
    # train.grad_accum over batch_ramp_steps (0: off), and/or doubled at logging steps while
    # the noise scale predicts a gain above batch_gain (needs noise_scale), batch_cooldown
    # steps apart.
    batch_ramp_steps: int = bounded(0, 0, _STEPS)
    batch_adaptive: bool = False
    batch_max_accum: int = bounded(64, 1, _MAX_ACCUM)
    batch_cooldown: int = bounded(200, 0, _STEPS)
    batch_gain: float = bounded(1.05, 1, 100)
    # The gradient noise scale B_simple in metrics.jsonl (train/adapt/noise_scale.py; DDP, 2+
    # ranks), smoothed by an EMA of this decay (k-diffusion: 0.9998 for long runs).
    noise_scale: bool = False
    noise_scale_ema: float = bounded(0.99, 0, 1, open_low=True, open_high=True)

    def __post_init__(self) -> None:
        check_numbers(self, "train.adapt")
        for name in ("skip_spikes", "batch_adaptive", "noise_scale"):
            value = getattr(self, name)
            require(isinstance(value, bool), f"train.adapt.{name}", value, "true or false")
        require(
            self.spike_min_history <= self.spike_window,
            "train.adapt.spike_min_history",
            self.spike_min_history,
            f"at most spike_window ({self.spike_window})",
        )
        if self.spike_rewind_after:  # the streak it counts is of skipped spikes
            require(
                self.skip_spikes,
                "train.adapt.skip_spikes",
                self.skip_spikes,
                f"true with train.adapt.spike_rewind_after = {self.spike_rewind_after}: a "
                "rewind follows spike skips",
            )
        if self.batch_adaptive:
            require(
                self.noise_scale,
                "train.adapt.noise_scale",
                self.noise_scale,
                "true with train.adapt.batch_adaptive = true (it follows the noise scale)",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """``[train.memory]``: how much of the device the batches may fill (train/memory/)."""

    # Share of the device's memory `python -m train tune` fills with the largest batch per bucket.
    target: float = bounded(0.9, 0, 1, open_low=True)
    # Steps in a row without an out-of-memory error after which lowered budgets grow back by
    # 1/0.9 (train/memory/oom.py; 0: never).
    budget_regrow_steps: int = bounded(0, 0, _STEPS)

    def __post_init__(self) -> None:
        check_numbers(self, "train.memory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AmpConfig:
    """``[train.amp]``: fp16 loss scaling (train/optim/scaler.py)."""

    # Overflows before the scale backs off (1: torch's GradScaler, backing off at each;
    # Megatron-LM uses 2), and the floor of the scale.
    hysteresis: int = bounded(1, 1, 1_000_000)
    min_scale: float = bounded(1.0, 0, 2.0**24, open_low=True)

    def __post_init__(self) -> None:
        check_numbers(self, "train.amp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop: its length, accumulation, precision, seed and logging, then one sub-table per
    room of the trainer."""

    max_steps: int = bounded(1_000, 0, _STEPS)  # optimizer steps; --max-steps overrides
    grad_accum: int = bounded(1, 1, _MAX_ACCUM)  # micro-batches per optimizer step
    # bf16 autocast (no scaler), fp16 autocast + GradScaler, or fp32; "auto" is bf16 where
    # the hardware has it (CUDA with bf16, CPUs with AVX-512/AMX) and fp32 elsewhere.
    precision: str = "auto"
    seed: int = bounded(0, 0, 2**63 - 1)
    log_every: int = bounded(10, 1, _STEPS)
    compile: bool = False
    activation_checkpointing: bool = False
    ema_decay: float = bounded(0.0, 0, 1, open_high=True)  # 0: no EMA of weights; 0.999 typical
    # CUDA kernels such as embedding backward are nondeterministic by default; true turns on
    # torch.use_deterministic_algorithms (slower) so a resume is bitwise on GPUs as on CPU.
    deterministic: bool = False
    # Where rank 0 also sends metrics.jsonl's records (train/run/trackers.py): "tensorboard"
    # (OUT/tensorboard/), "wandb" (W&B's own WANDB_* variables; its run id is checkpointed).
    trackers: tuple[str, ...] = ()
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    adapt: AdaptConfig = dataclasses.field(default_factory=AdaptConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    amp: AmpConfig = dataclasses.field(default_factory=AmpConfig)

    def __post_init__(self) -> None:
        check_numbers(self, "train")
        require(
            self.precision in PRECISIONS, "train.precision", self.precision, " or ".join(PRECISIONS)
        )
        self._check_trackers()
        self._check_across_tables()

    def _check_trackers(self) -> None:
        """Known names, each once: a typo must not silently leave a run untracked."""
        names = self.trackers
        listed = isinstance(names, tuple) and all(isinstance(n, str) for n in names)
        require(listed, "train.trackers", names, f"a list of names from {list(TRACKERS)}")
        for name in names:
            require(name in TRACKERS, "train.trackers", name, " or ".join(TRACKERS))
        twice = sorted({n for n in names if names.count(n) > 1})
        require(
            not twice, "train.trackers", list(names), f"each name once ({', '.join(twice)} twice)"
        )

    def _check_across_tables(self) -> None:
        """Combinations refused by name: FSDP2 has no DDP comm hooks and no sharded GradScaler
        here, the noise scale's comm hook replaces DDP's, and a batch grows from grad_accum."""
        parallel, adapt = self.parallel, self.adapt
        if parallel.strategy != "ddp":
            why = f"not with train.parallel.strategy = {parallel.strategy!r}"
            require(
                parallel.comm_hook == "none",
                "train.parallel.comm_hook",
                parallel.comm_hook,
                f'"none" ({why}: DDP only)',
            )
            require(
                self.precision != "fp16",
                "train.precision",
                self.precision,
                f"bf16, fp32 or auto ({why})",
            )
        if adapt.noise_scale:
            why = "with train.adapt.noise_scale = true"
            require(
                parallel.comm_hook == "none",
                "train.parallel.comm_hook",
                parallel.comm_hook,
                f'"none" {why}',
            )
            require(
                parallel.strategy == "ddp",
                "train.parallel.strategy",
                parallel.strategy,
                f'"ddp" {why}',
            )
        require(
            adapt.batch_max_accum >= self.grad_accum,
            "train.adapt.batch_max_accum",
            adapt.batch_max_accum,
            f"at least train.grad_accum ({self.grad_accum})",
        )
