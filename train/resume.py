"""Resuming a run: what a changed config means, and the mel statistics a fresh start feeds
the model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from melcache.errors import UserError
from melcache.index import read_stats

log = logging.getLogger(__name__)

# Config keys that may change between a run and its resumption without a warning.
RESUMABLE_CHANGES = {
    "train.max_steps",
    "train.log_every",
    "train.ckpt_every",
    "train.keep_checkpoints",
    "train.async_checkpoint",
    "train.val_every",
    "train.val_batches",
    "data.val_shards",
}


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
    """Warn, naming the keys, when checkpoint ``where`` was saved under another config."""
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
