"""The flat ``[train]`` keys of earlier releases, and where each lives now.

``train.ckpt_every = 100`` in a file, an override or a checkpoint's saved config still works:
:func:`move_renamed_keys` moves it to ``train.checkpoint.every`` and logs one line naming the
new key (saved configs are moved without a word: the user did not write them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from melcache.errors import UserError

log = logging.getLogger(__name__)

# old key in [train] → (sub-table, key in it)
RENAMED: dict[str, tuple[str, str]] = {
    "strategy": ("parallel", "strategy"),
    "hsdp_shard_size": ("parallel", "hsdp_shard_size"),
    "comm_hook": ("parallel", "comm_hook"),
    "powersgd_rank": ("parallel", "powersgd_rank"),
    "powersgd_start_iter": ("parallel", "powersgd_start_iter"),
    "bucket_cap_mb": ("parallel", "bucket_cap_mb"),
    "find_unused_parameters": ("parallel", "find_unused_parameters"),
    "allow_forward_collectives": ("parallel", "allow_forward_collectives"),
    "ckpt_every": ("checkpoint", "every"),
    "keep_checkpoints": ("checkpoint", "keep"),
    "async_checkpoint": ("checkpoint", "async_write"),
    "val_every": ("validation", "every"),
    "val_batches": ("validation", "batches"),
    "skip_spikes": ("adapt", "skip_spikes"),
    "spike_sigma": ("adapt", "spike_sigma"),
    "spike_window": ("adapt", "spike_window"),
    "spike_min_history": ("adapt", "spike_min_history"),
    "spike_rewind_after": ("adapt", "spike_rewind_after"),
    "batch_ramp_steps": ("adapt", "batch_ramp_steps"),
    "batch_adaptive": ("adapt", "batch_adaptive"),
    "batch_max_accum": ("adapt", "batch_max_accum"),
    "batch_cooldown": ("adapt", "batch_cooldown"),
    "batch_gain": ("adapt", "batch_gain"),
    "noise_scale": ("adapt", "noise_scale"),
    "noise_scale_ema": ("adapt", "noise_scale_ema"),
    "memory_target": ("memory", "target"),
    "budget_regrow_steps": ("memory", "budget_regrow_steps"),
    "amp_hysteresis": ("amp", "hysteresis"),
    "amp_min_scale": ("amp", "min_scale"),
}


def new_name(old: str) -> str:
    """``"train.ckpt_every"`` → ``"train.checkpoint.every"``; other keys unchanged."""
    table, _, key = old.partition(".")
    if table != "train" or key not in RENAMED:
        return old
    group, name = RENAMED[key]
    return f"train.{group}.{name}"


def move_renamed_keys(data: Mapping[str, Any], source: str, *, quiet: bool = False) -> dict:
    """A copy of the config tables ``data`` (from ``source``) with every old flat ``[train]``
    key moved into its sub-table, each logged once unless ``quiet``. Giving a key under both
    names in one source is refused: which one was meant cannot be known."""
    train = data.get("train")
    if not isinstance(train, Mapping) or not RENAMED.keys() & train.keys():
        return dict(data)
    moved = {key: value for key, value in train.items() if key not in RENAMED}
    for old in [key for key in train if key in RENAMED]:
        group, name = RENAMED[old]
        table = moved.setdefault(group, {})
        if not isinstance(table, Mapping):
            continue  # "[train.parallel] must be a table" is said where tables are read
        table = moved[group] = dict(table)
        if name in table:
            raise UserError(
                f"{source}: train.{old} and train.{group}.{name} are the same key; keep only "
                f"train.{group}.{name} (train.{old} is its old name)"
            )
        table[name] = train[old]
        if not quiet:
            log.warning(
                "%s: config key train.%s is deprecated; use train.%s.%s", source, old, group, name
            )
    return {**data, "train": moved}
