"""The ``[train]`` table: the loop's length, precision, accumulation, parallelism, logging,
checkpoints and adaptive options (the other tables are in ``train/config/tables.py``)."""

from __future__ import annotations

import dataclasses

from melcache.sections import require

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")
STRATEGIES = ("ddp", "fsdp2", "hsdp")
TRACKERS = ("tensorboard", "wandb")  # train/run/trackers.py opens each by this name


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
    # PowerSGD (train/parallel/powersgd.py): the factors' rank, and plain all-reduce steps before it
    # starts; its error and warm-start memory is checkpointed per rank, by parameter name.
    powersgd_rank: int = 4
    powersgd_start_iter: int = 1_000
    bucket_cap_mb: float = 25.0  # DDP's gradient bucket size (torch's default)
    # Data parallelism (docs/training.md, "FSDP2 and HSDP"): DDP replicates everything; fsdp2 shards parameters,
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
    # A model whose training forward all-reduces (train/model/guards.py) runs only with this key,
    # and then without out-of-memory recovery.
    allow_forward_collectives: bool = False
    find_unused_parameters: bool = False  # DDP's option, for models that skip parameters
    val_every: int = 0  # steps between validations (0: off; needs data.val_shards)
    val_batches: int = 4  # validation batches per rank, the same ones every time
    # Skip a step whose loss or grad norm is spike_sigma σ above the last spike_window
    # trained steps (once spike_min_history are in): train/adapt/spikes.py.
    skip_spikes: bool = False
    spike_sigma: float = 6.0
    spike_window: int = 128
    spike_min_history: int = 16
    # After this many spike-skipped steps in a row, go back to the last checkpoint (weights
    # and every adaptive state) while the loader goes on, skipping the batches since (PaLM's
    # rewind). 0: never. A fresh start then saves step 0, the state a first rewind returns to.
    spike_rewind_after: int = 0
    # A batch that grows (train/adapt/batch_ramp.py): accumulation ramped from 1 to grad_accum over
    # batch_ramp_steps (0: off), and/or doubled at logging steps while the noise scale
    # predicts a gain above batch_gain (needs noise_scale), batch_cooldown steps apart.
    batch_ramp_steps: int = 0
    batch_adaptive: bool = False
    batch_max_accum: int = 64
    batch_cooldown: int = 200
    batch_gain: float = 1.05
    # Steps in a row without an out-of-memory error after which lowered budgets grow back by
    # 1/0.9 (train/memory/oom.py; 0: never).
    budget_regrow_steps: int = 0
    # fp16 loss scaling (train/optim/scaler.py): overflows before the scale backs off (1: torch's
    # GradScaler, backing off at each; Megatron-LM uses 2), and the floor of the scale.
    amp_hysteresis: int = 1
    amp_min_scale: float = 1.0
    # The gradient noise scale B_simple in metrics.jsonl (train/adapt/monitor.py; DDP, 2+ ranks),
    # smoothed by an EMA of this decay (k-diffusion: 0.9998 for long runs).
    noise_scale: bool = False
    noise_scale_ema: float = 0.99
    # Where rank 0 also sends metrics.jsonl's records (train/run/trackers.py): "tensorboard"
    # (OUT/tensorboard/), "wandb" (W&B's own WANDB_* variables; its run id is checkpointed).
    trackers: tuple[str, ...] = ()

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
        self._check_trackers()
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
