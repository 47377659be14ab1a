"""Saving and resuming a run's parts (``train/run/parts.py``): what a checkpoint holds, how a run
starts from the latest one (or afresh, with the mel statistics fed to the model), and what a
changed config means."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from melcache.errors import UserError
from melcache.index import read_stats
from melcache.loader import LoaderStateError
from train.config.renamed import move_renamed_keys
from train.config.tables import Config
from train.parallel.fsdp import load_weights, weights_state
from train.parallel.rng import derive_seed, rng_state, seed_all, set_rng_state
from train.run.parts import RunParts

log = logging.getLogger(__name__)

# Config keys that may change between a run and its resumption without a warning.
RESUMABLE_CHANGES = {
    "train.max_steps",
    "train.log_every",
    "train.checkpoint.every",
    "train.checkpoint.keep",
    "train.checkpoint.async_write",
    "train.validation.every",
    "train.validation.batches",
    "train.trackers",
    "data.val_shards",
}


def save(parts: RunParts, step: int) -> None:
    """Checkpoint ``parts`` at ``step`` (every rank calls this at the same step)."""
    p, env = parts, parts.env
    shared: dict[str, Any] = {}
    weights = {}  # model, optimizer, EMA: in shared.pt (DDP) or every rank's shards (FSDP2)
    if env.is_main or p.sharded:
        weights = weights_state(p.raw_model, p.optimizer, p.ema, p.sharded)
    if env.is_main:
        shared = {
            "step": step,
            "config": p.cfg.to_dict(),
            "scheduler": p.scheduler.state_dict(),
            "scaler": p.scaler.state_dict(),
            "budgets": p.budgets.state_dict(),
            "batch": p.batch.state_dict(),
            "trackers": p.trackers.state_dict(),
            **p.measures.state_dict(),
            **({} if p.sharded else weights),
        }
    local = {
        "step": step,
        "rank": env.rank,
        "rng": rng_state(env.device),
        "loader": p.loader.state_dict(),
    }
    if p.powersgd is not None:
        local["powersgd"] = p.powersgd.state_dict()
    p.ckpt.save(step, shared, local, weights if p.sharded else None)
    if p.budgets.pending:  # cuts a stopped run left: on disk until a checkpoint holds them
        p.ckpt.wait()
        p.budgets.checkpointed()


def resume_or_start(parts: RunParts) -> int:
    """Restore the latest complete checkpoint in ``parts.out`` and return its step, or prepare
    a fresh start (step 0, saved as a checkpoint when spikes may rewind to it)."""
    p, env = parts, parts.env
    restored = p.ckpt.restore()
    if restored is not None:
        step = _restore(p, *restored, rewinding=False)
        log.info("resumed from %s", restored[0])
        if p.loader.resume_changes:
            log.info("resumed with changes: %s", "; ".join(p.loader.resume_changes))
        return step
    if p.cfg.data.mel_stats and hasattr(p.raw_model, "set_mel_stats"):
        stats = mel_stats(p.shards, p.loader.features.n_mels, p.loader.weights)
        p.raw_model.set_mel_stats(*(x.to(env.device) for x in stats))
    if env.is_main:
        p.out.mkdir(parents=True, exist_ok=True)
        (p.out / "config.json").write_text(json.dumps(p.cfg.to_dict(), indent=1))
    # Dropout masks must differ between ranks: one stream per (seed, rank).
    seed_all(derive_seed(p.cfg.train.seed, "train", env.rank))
    if p.cfg.train.adapt.spike_rewind_after:
        save(p, 0)
    return 0


def rewind(parts: RunParts) -> tuple[int, int]:
    """Go back to the latest checkpoint: weights, optimizer, schedules, RNG and every
    adaptive state, but neither the loader, which goes on (the batches since are skipped, not
    replayed), nor the out-of-memory budgets (facts about memory, not training state). Returns
    the checkpoint's step and how many batches this rank's loader had drawn by then."""
    p = parts
    p.ckpt.wait()  # an async save in flight may be the latest checkpoint
    restored = p.ckpt.restore()
    if restored is None:  # a fresh start saves step 0 with spike_rewind_after on
        raise RuntimeError(f"no checkpoint in {p.ckpt.folder} to rewind to")
    spikes = p.measures.spikes
    counts = spikes.skipped, spikes.rewinds  # what happened in the run: not undone
    step = _restore(p, *restored, rewinding=True)
    spikes.rewound(*counts)
    loader = restored[2]["loader"]  # every old rank's, where a job of another size saved it
    return step, int((loader[0] if isinstance(loader, list) else loader)["batches"])


def _restore_loader(p: RunParts, latest: Path, state: dict[str, Any]) -> None:
    """The loader's position (``state``: this rank's, or every rank's of a job of another size),
    or one line in the trainer's words when it does not fit."""
    try:
        try:
            p.loader.load_state_dict(state)
        except LoaderStateError:
            if isinstance(state, list):
                raise
            # Another mix (or worker count) on as many ranks: the loader needs every rank's.
            p.loader.load_state_dict(p.ckpt.loader_states(latest))
    except LoaderStateError as exc:
        raise UserError(
            f"{latest}: {exc.problem}; rerun with the config the run was saved with, or train "
            "into a new --out"
        ) from None


def _restore(
    p: RunParts, latest: Path, shared: dict[str, Any], local: dict[str, Any], *, rewinding: bool
) -> int:
    """Load checkpoint ``latest`` into the parts (not the loader and budgets when
    ``rewinding``); its step. A checkpoint that does not fit is a one-line :class:`UserError`."""
    try:
        if not rewinding:
            warn_config_changes(shared["config"], p.cfg.to_dict(), latest)
        weights = shared
        if p.sharded:
            weights = weights_state(p.raw_model, p.optimizer, p.ema, True)
            p.ckpt.load_sharded(latest, weights)
        load_weights(p.raw_model, p.optimizer, p.ema, weights, p.sharded)
        p.scheduler.load_state_dict(shared["scheduler"])
        p.scaler.load_state_dict(shared["scaler"])
        if "budgets" in shared and not rewinding:  # none before per-bucket caps
            p.budgets.load_state_dict(shared["budgets"])
        if "batch" in shared:  # checkpoints from before the batch schedule have none
            p.batch.load_state_dict(shared["batch"])
        if "trackers" in shared and not rewinding:  # none before train.trackers
            p.trackers.load_state_dict(shared["trackers"])
        p.measures.load_state_dict(shared)
        if not rewinding:
            _restore_loader(p, latest, local["loader"])
        if p.powersgd is not None and "powersgd" in local:
            p.powersgd.load_state_dict(local["powersgd"])
        if local["rng"] is None:  # a rank the job that saved had not: its own stream
            seed_all(derive_seed(p.cfg.train.seed, "train", p.env.rank))
        else:
            set_rng_state(local["rng"], p.env.device)
        return int(shared["step"])
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        detail = " ".join(str(exc).split())  # torch's messages span lines
        raise UserError(
            f"{latest} does not fit this config (model, optimizer, schedule, precision, "
            f"EMA or loader): {type(exc).__name__}: {detail}"
        ) from None


def mel_stats(
    shards: list[str], n_mels: int, weights: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (float32 ``[n_mels]``) of the cache; of a mix, those of its
    caches pooled at their frame shares ``weights`` (what the model is fed)."""
    try:
        parts = [read_stats(where, n_mels) for where in shards]
        stats = parts[0] if len(parts) == 1 else _pooled(parts, weights)
    except UserError as exc:
        raise UserError(
            f"{exc}; data.mel_stats = true needs them: set data.mel_stats=false to train "
            "on unnormalised log-mels"
        ) from None
    return torch.from_numpy(stats[0]), torch.from_numpy(stats[1])


def warn_config_changes(saved: dict[str, Any], current: dict[str, Any], where: Path) -> None:
    """Warn, naming the keys, when checkpoint ``where`` was saved under another config (one
    saved before the ``[train]`` sub-tables is read under today's key names, and with today's
    defaults for keys it did not have)."""
    saved = move_renamed_keys(saved, str(where), quiet=True)
    # Keys added since the checkpoint was saved read as their defaults, as that run ran; a
    # config today's checks refuse is compared as it was saved.
    with contextlib.suppress(UserError):
        saved = Config.from_dict(saved, str(where)).to_dict()
    changed = sorted(set(_flatten(saved).items()) ^ set(_flatten(current).items()))
    keys = sorted({k for k, _ in changed} - RESUMABLE_CHANGES)
    if keys:
        log.warning(
            "resuming %s with a changed config (%s); the optimizer and schedule state come "
            "from the checkpoint",
            where,
            ", ".join(keys),
        )


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = repr(value)
    return out


def _pooled(
    parts: list[tuple[np.ndarray, np.ndarray]], weights: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std of a mixture of caches with these (mean, std) at these frame shares."""
    mean = sum(w * m for w, (m, _) in zip(weights, parts, strict=True))
    square = sum(w * (s**2 + m**2) for w, (m, s) in zip(weights, parts, strict=True))
    return mean.astype(np.float32), np.sqrt(np.maximum(square - mean**2, 0.0)).astype(np.float32)
