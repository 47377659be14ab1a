"""The loader's foot: the types every stage shares. A :class:`StreamSpec` is all a worker
process needs to make its stream; a :class:`MixCache` is one cache of the mix; a
:class:`Cursor` travels with each batch and a :class:`Position` is where a whole-cache reader
continues. They sit below the stages (``stream``, ``reads``, ``workers``) and the
resume room, so each of those imports them downward."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from typing import Any

from melcache.batch_plans import BATCH_PLAN_VERSION
from melcache.loader.batch import Tokenizer
from melcache.loader.data_config import DataConfig
from melcache.loader.deal import Deal, fresh_deal
from melcache.loader.schedule import Schedule, SubStream
from melcache.loader.sequence import TextLengths


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a whole-cache reader continues: ``batch`` batches into shard ``shard`` of its
    ``epoch`` list."""

    epoch: int = 0
    shard: int = 0
    batch: int = 0


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Travels with each batch: who made it, from which sub-stream, where that worker stands
    in it after the batch, the shards it skipped since its previous batch (``(name, reason)``
    pairs) and its disk cache's counts."""

    worker: int
    stream: int
    after: tuple[int, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    disk: tuple[int, int] = (0, 0)  # data.cache_dir's hits and misses since its previous batch


@dataclasses.dataclass(frozen=True)
class MixCache:
    """One cache of the mix: its location (folder or URL prefix) and its index's shards;
    ``ranged``: a bucket reader reads only its batches' samples, located by the cache's
    utterance table (a local cache with a table, checked per sample by its digest).
    ``StreamSpec.sources`` holds them in the mix's order and a sub-stream's ``source`` is a
    place in it; an utterance's ``source`` (its json, the build) is its input's path."""

    location: str
    shards: tuple[dict[str, Any], ...]
    ranged: bool = False
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # entries asked for
    first_rows: tuple[int, ...] = ()  # data.where / data.balance: the table's first row a shard
    selected_by: tuple[str, ...] = ()  # the derived fields they read, as name@provenance digest
    # data.sequence = "text+frames": text tokens per table row (melcache/loader/sequence.py)
    text: TextLengths | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """Everything a worker process needs to produce its stream (picklable)."""

    sources: tuple[MixCache, ...]
    subs: tuple[SubStream, ...]
    schedule: Schedule
    data: DataConfig  # the [data] table, whole
    rank: int
    world_size: int
    seed: int
    n_mels: int
    pad_value: float
    tokenizer: Tokenizer
    # How the job's slots share each bucket sub-stream: fresh, or after a resume from a job of
    # another size or mix (melcache/loader/resume/elsewhere.py); empty: all fresh.
    deals: tuple[Deal, ...] = ()
    # data.mix_schedule: (first rank-level batch, schedule) of each later phase of the mix
    phases: tuple[tuple[int, Schedule], ...] = ()
    # How a unit's samples are sorted and cut (melcache.batch_plans.plan_even_batches): a state of an
    # earlier release continues with its own.
    plan: int = BATCH_PLAN_VERSION

    @property
    def selection_versions(self) -> tuple[str, ...]:
        """The derived fields ``data.where`` / ``data.balance`` read, of every cache."""
        return tuple(version for source in self.sources for version in source.selected_by)

    def phase(self, rank_step: int) -> int:
        """Phase of the mix (0: ``schedule``; i: ``phases[i - 1]``) at a rank's batch."""
        return bisect.bisect_right([start for start, _ in self.phases], rank_step)

    def pick(self, rank_step: int, slot: int, consumed: list[int]) -> int:
        """The sub-stream of the rank's batch ``rank_step`` (see ``Schedule.pick``). The first
        batch of a worker in a new phase of the mix starts its frames per sub-stream even
        with the phase's weights (in place), so the shares follow them from the first window
        instead of catching up on the past."""
        phase = self.phase(rank_step)
        schedule = self.phases[phase - 1][1] if phase else self.schedule
        before = rank_step - self.workers_per_rank  # the worker's batch before
        if phase and before >= 0 and self.phase(before) != phase:
            total = sum(consumed)
            consumed[:] = [round(target * total) for target in schedule.targets]
        return schedule.pick(rank_step, slot, consumed)

    def deal(self, stream: int) -> Deal:
        """How the job's slots share sub-stream ``stream``."""
        return self.deals[stream] if self.deals else fresh_deal(self.plan)

    @property
    def workers_per_rank(self) -> int:
        """Logical workers per rank: ``num_workers = 0`` reads in the main process, as one."""
        return max(1, self.data.num_workers)

    @property
    def num_slots(self) -> int:
        """Workers in the whole job: each reads a disjoint share of every sub-stream."""
        return self.world_size * self.workers_per_rank

    def start(self, sub: SubStream) -> tuple[int, ...]:
        """A worker's position in ``sub`` before its first batch: batches taken (a bucket) or
        (epoch, shard, batch) (a whole cache), then the real frames taken."""
        return (0, 0) if sub.bucket >= 0 else (0, 0, 0, 0)
