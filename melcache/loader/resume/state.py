"""The loader's saved state: its keys and versions, the settings a resume may not change,
what a resume yields (:class:`Resumed`) and the error a state that does not fit raises. Both
readers (``same_job``, ``elsewhere``) stand on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from melcache.batch_plans import BATCH_PLAN_VERSION
from melcache.errors import UserError
from melcache.loader.data_config import MAX_ATTENTION_FRAMES, MAX_SYNC_SPLIT, DataConfig
from melcache.loader.deal import Deal, fresh_deal


class LoaderStateError(UserError):
    """A saved loader state that does not fit this loader. ``problem`` says what differs;
    the message adds the fix for a caller of ``StreamLoader.load_state_dict`` (a trainer says
    its own)."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(
            f"{problem}; resume with the same setting, or start the data stream afresh without "
            "load_state_dict"
        )


# What a resume on another job size or mix may not change: the batches themselves.
SAME_BATCHES = ("seed", "batch_frames", "max_batch_size", "pad_multiple", "sync_buckets",
                "sync_split", "batch_plan", "attention_frames", "sequence")  # fmt: skip
# Saved states that hold a bucket sub-stream's position as batches taken (3: before deals).
ELASTIC_VERSIONS = (3, 4)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a loader of a new job continues: its workers' positions, the job's deals, its
    batches so far, the shards skipped before and one line per thing that changed."""

    positions: list[list[tuple[int, ...]]]
    deals: tuple[Deal, ...]
    batches: int
    skipped_shards: dict[str, str]
    changes: tuple[str, ...]


def parse_deals(saved: Any, count: int, plan: int) -> tuple[Deal, ...]:
    """``[[frontier, [[start, stop], ...]], ...]`` (a state's ``deals``) as ``count`` deals
    of batch plan ``plan``."""
    by_epoch = fresh_deal(plan).by_epoch
    try:
        deals = tuple(
            Deal(int(frontier), tuple((int(a), int(b)) for a, b in runs), by_epoch)
            for frontier, runs in saved
        )
    except (TypeError, ValueError) as exc:
        raise LoaderStateError(f"loader state has unreadable deals ({exc})") from None
    if len(deals) != count:
        raise LoaderStateError(f"loader state has {len(deals)} deals for {count} sub-streams")
    return deals


def state_cut(state: Mapping[str, Any], data: DataConfig) -> tuple[int, int, int]:
    """The batch plan, length ranges a bucket and attention frames that cut ``state``'s
    batches: its plan, and its ranges and frames where ``data.sync_split`` and
    ``data.attention_frames`` are left at 0 (a state of an earlier release: plan 1 or 2, one
    range). A setting given otherwise is checked against the state as any key."""
    plan = state_setting(state, "batch_plan", BATCH_PLAN_VERSION)
    split = data.sync_split or state_setting(state, "sync_split", MAX_SYNC_SPLIT)
    attention = data.attention_frames or state_setting(
        state, "attention_frames", MAX_ATTENTION_FRAMES, unset=data.attention
    )
    return plan, split, attention


def state_setting(state: Mapping[str, Any], key: str, most: int, unset: int = 1) -> int:
    """A batch setting ``state`` holds (``batch_plan``, ``sync_split``, ``attention_frames``):
    an int in ``1..most``, and ``unset`` where the state holds none (a state of an earlier
    release: plan 1, one length range; a plan that uses no attention frames)."""
    value = state.get(key)
    if value is None:
        return unset
    if type(value) is not int or not 1 <= value <= most:  # a bool is no setting
        raise LoaderStateError(
            f"loader state holds {STATE_KEYS[key]} = {value!r}, not a whole number in 1..{most}"
        )
    return value


# The user's names of the state's identity keys: a trainer user sets data.num_workers, not the
# workers per rank it gives (at least 1).
STATE_KEYS = {
    "workers_per_rank": "data.num_workers (workers per rank)",
    "batch_frames": "data.batch_frames",
    "max_batch_size": "data.max_batch_size",
    "pad_multiple": "data.pad_multiple",
    "sync_buckets": "data.sync_buckets",
    "sync_split": "data.sync_split",
    "batch_plan": "batch plan (melcache.batch_plans.sort_order)",
    "attention_frames": "data.attention_frames",
    "sequence": "data.sequence (and its tokenizer; with text as an axis, data.batch_text)",
    "mix": "mix shares (data.mix, data.mix_temperature, the caches' hours)",
    "mix_schedule": "data.mix_schedule (first batch, frame shares)",
    "cache_digest": "cache content digest",
    "selection": "data.where / data.balance (their digest)",
}
