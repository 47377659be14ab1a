"""What one training run is made of, built from its config: the model, the loader, the
optimizer and what sits around them. :func:`build_run_parts` only builds (no checkpoint is
read here: ``train/run/resume.py`` restores the parts, ``train/trainer.py`` runs them), and
:func:`wrap_for_training` wraps the model for DDP once it holds its restored weights.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
from torch import nn

from melcache.errors import UserError
from melcache.loader.prefetch import DeviceCopies
from melcache.loader.stream_loader import StreamLoader, make_loader
from train.adapt.batch_ramp import BatchSchedule
from train.adapt.step_measures import StepMeasures
from train.config.tables import Config
from train.config.train_table import TrainConfig
from train.memory.oom import Budgets, no_recovery
from train.model import build_model
from train.model.contract import ModelSpec, declared, expected_features, loader_data
from train.model.guards import FirstStep
from train.model.tokenizers import build_tokenizer
from train.optim.optimizer import EMA, build_optimizer, build_scheduler
from train.optim.precision import AMP_DTYPES, resolve_precision
from train.optim.scaler import HysteresisScaler
from train.parallel.ddp import wrap_model
from train.parallel.env import Env
from train.parallel.fsdp import shard, sharded
from train.parallel.powersgd import PowerSGD
from train.parallel.rng import derive_seed, seed_all, use_deterministic_algorithms
from train.parallel.votes import HostVote
from train.run.checkpoint import Checkpointer
from train.run.trackers import TrackerState
from train.run.validation import Validator, build_validator


@dataclasses.dataclass
class RunParts:
    """The parts of one run in ``out``; every rank holds its own."""

    cfg: Config
    env: Env
    out: Path
    shards: list[str]
    precision: str  # "auto" resolved for this device
    raw_model: nn.Module  # not wrapped for DDP (FSDP2: sharded in place)
    spec: ModelSpec  # what the model class declares (train/model/contract.py)
    sharded: bool  # FSDP2 / HSDP: DTensor parameters
    loader: StreamLoader
    validator: Validator | None  # None unless train.validation.every
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    batch: BatchSchedule  # micro-batches per step
    scaler: HysteresisScaler
    ema: EMA | None
    ckpt: Checkpointer
    vote: HostVote
    measures: StepMeasures  # clipping, spikes, noise scale
    budgets: Budgets  # per-bucket frame budgets lowered by out-of-memory errors
    first: FirstStep  # the checks of the first step
    copies: DeviceCopies
    powersgd: PowerSGD | None
    trackers: TrackerState  # the W&B run id, kept in checkpoints


def build_run_parts(cfg: Config, shards: str | list[str], out: Path, env: Env) -> RunParts:
    """Build every part of a run from ``cfg`` with fresh state (identical weights on every
    rank); the caller restores a checkpoint into them, then calls :func:`wrap_for_training`."""
    t, device = cfg.train, env.device
    precision = _start_process(t, device)
    shards = [shards] if isinstance(shards, str) else list(shards)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.vocab)
    model = build_model(cfg.model, tokenizer.vocab_size).to(device).train()
    spec = declared(type(model), cfg.model.impl)
    features = expected_features(cfg.model, spec)
    loader = make_loader(
        shards[0] if len(shards) == 1 else shards,
        loader_data(cfg.data, spec),
        rank=env.rank,
        world_size=env.world_size,
        seed=t.seed,
        expect_features=features,
        tokenizer=tokenizer,
    )
    validator = build_validator(cfg, spec, env, out, expect_features=features, tokenizer=tokenizer)
    is_sharded = sharded(t.parallel, env)
    model = shard(
        model, env, t.parallel, AMP_DTYPES.get(precision, torch.float32)
    )  # fp16 is refused
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim)
    # A skipped step (fp16 overflow, out of memory) is normal, not a misordered schedule.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
    recovery_off = no_recovery(
        is_sharded, t.parallel.allow_forward_collectives
    )  # its reason, or None
    return RunParts(
        cfg=cfg,
        env=env,
        out=out,
        shards=shards,
        precision=precision,
        raw_model=model,
        spec=spec,
        sharded=is_sharded,
        loader=loader,
        validator=validator,
        optimizer=optimizer,
        scheduler=scheduler,
        batch=BatchSchedule(t, optimizer, scheduler),
        scaler=HysteresisScaler.for_run(t, device, precision),
        ema=EMA(model, t.ema_decay) if t.ema_decay > 0 else None,
        ckpt=Checkpointer(
            out / "checkpoints", env, keep=t.checkpoint.keep, async_save=t.checkpoint.async_write
        ),
        vote=HostVote(env),
        measures=StepMeasures(cfg, env, sharded=is_sharded),
        budgets=Budgets(env, loader.spec.data.pad_multiple, out, no_recovery=recovery_off),
        first=_first_step(cfg, model, is_sharded),
        copies=DeviceCopies(device),
        powersgd=PowerSGD.for_run(model, env, t),
        trackers=TrackerState(t.trackers),
    )


def _start_process(t: TrainConfig, device: torch.device) -> str:
    """This process's numerics before anything is built: the precision ("auto" resolved for
    the device), TF32 matmuls on CUDA, determinism if asked, and the seed of the initial
    weights; returns the precision."""
    precision = resolve_precision(t.precision, device)
    if device.type == "cuda":  # TF32 matmuls: ~fp32 accuracy at tensor-core speed
        torch.set_float32_matmul_precision("high")
    if t.deterministic:
        use_deterministic_algorithms()
    seed_all(derive_seed(t.seed, "init"))  # identical initial weights on every rank
    return precision


def _first_step(cfg: Config, model: nn.Module, is_sharded: bool) -> FirstStep:
    """The first step's checks of the model: collectives in its forward, unused parameters."""
    t = cfg.train
    return FirstStep(
        model,
        cfg.model.impl,
        # FSDP2 all-gathers in every forward itself; it has no recovery for them to break.
        allow_collectives=t.parallel.allow_forward_collectives or is_sharded,
        unused=t.parallel.find_unused_parameters,
        compiled=t.compile,
    )


def wrap_for_training(parts: RunParts) -> nn.Module:
    """The model the step runs: activation checkpointing on if asked, wrapped for DDP (with
    its comm hook) and hooked for the noise-scale monitor. Call after restoring weights."""
    if parts.cfg.train.activation_checkpointing:
        if not hasattr(parts.raw_model, "set_activation_checkpointing"):
            raise UserError(
                f"config key train.activation_checkpointing = true, but {parts.cfg.model.impl} "
                "has no set_activation_checkpointing method"
            )
        parts.raw_model.set_activation_checkpointing(True)
    model = wrap_model(parts.raw_model, parts.env, parts.cfg.train, parts.powersgd)
    parts.measures.register(model)
    return model
