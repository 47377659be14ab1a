"""One loader worker's endless batch stream, as plain generator stages.

``worker_stream`` composes: schedule shards (epoch after epoch) → read each shard →
plan its batches → decode and pad. Each stage takes the upstream iterator first. A batch
travels with a :class:`Cursor`, the worker's :class:`Position` *after* that batch, which is
all the loader needs to resume: positions are (epoch, shard index in the worker's list for
that epoch, batches already taken from that shard), and batching is a pure function of
``(seed, epoch, shard)``, so a restored worker skips whole shards unread and re-plans at most
one shard, whose consumed batches it skips without decoding their mels.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

from melcache.batching import BATCH_PLAN, make_rng, plan_batches, worker_shards
from melcache.errors import ShardError
from melcache.location import member_location
from melcache.reader import RawSample, ShardCheck, read_shard
from train.collate import PackedBatch, Tokenizer, collate
from train.config import DataConfig
from train.transport import BatchRing


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a worker continues: ``batch`` batches into shard ``shard`` of its ``epoch`` list."""

    epoch: int = 0
    shard: int = 0
    batch: int = 0


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Travels with each batch: who made it, where that worker stands after it, and the
    shards it skipped since its previous batch (``(name, reason)`` pairs)."""

    worker: int
    after: Position
    skipped: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """Everything a worker process needs to produce its stream (picklable)."""

    cache: str
    shards: tuple[dict[str, Any], ...]  # the index's shard entries
    data: DataConfig  # the [data] table, whole
    rank: int
    world_size: int
    seed: int
    n_mels: int
    pad_value: float
    tokenizer: Tokenizer

    @property
    def workers_per_rank(self) -> int:
        """Logical workers per rank: ``num_workers = 0`` reads in the main process, as one."""
        return max(1, self.data.num_workers)

    @property
    def num_slots(self) -> int:
        """Workers in the whole job: each reads a disjoint share of every epoch's shards."""
        return self.world_size * self.workers_per_rank


@dataclasses.dataclass(frozen=True)
class ShardVisit:
    """One read of one shard by this worker, in one epoch."""

    epoch: int
    pos: int  # index in this worker's shard list for the epoch
    count: int  # length of that list
    shard_id: int  # index into StreamSpec.shards
    skip_batches: int  # batches consumed before a restore (first visit only)

    def after(self, batch: int, num_batches: int) -> Position:
        """Normalised position after ``batch`` batches of ``num_batches``: a finished shard
        points at the next one, so a restore never re-reads a shard it does not need."""
        if batch < num_batches:
            return Position(self.epoch, self.pos, batch)
        if self.pos + 1 < self.count:
            return Position(self.epoch, self.pos + 1, 0)
        return Position(self.epoch + 1, 0, 0)


class _SkipLog:
    """The ``on_error`` policy of one worker: re-raise, or note the shard and go on.

    Skipping must not hang: when every shard of the cache has failed (or three times as
    many shards as the cache holds) with no batch in between, it raises after all.
    """

    def __init__(self, on_error: str, num_shards: int) -> None:
        self.on_error = on_error
        self.num_shards = num_shards
        self.pending: list[tuple[str, str]] = []
        self.failed: set[int] = set()  # distinct shard ids failed since the last batch
        self.streak = 0  # shards failed since the last batch

    def record(self, visit: ShardVisit, name: str, exc: ShardError) -> None:
        if self.on_error == "raise":
            raise exc
        self.pending.append((name, str(exc)))
        self.failed.add(visit.shard_id)
        self.streak += 1
        if len(self.failed) == self.num_shards or self.streak >= 3 * self.num_shards:
            raise ShardError(
                f"{self.streak} shards in a row failed, {len(self.failed)} of the cache's "
                f"{self.num_shards} distinct; the last: {exc}"
            )

    def take(self) -> tuple[tuple[str, str], ...]:
        """Skips to report with the batch about to be yielded; progress resets the watchdog."""
        pending, self.pending = tuple(self.pending), []
        self.failed, self.streak = set(), 0
        return pending


def schedule(spec: StreamSpec, slot: int, start: Position) -> Iterator[ShardVisit]:
    """This worker's shards, epoch after epoch, forever, from ``start`` on."""
    epoch, first, skip = start.epoch, start.shard, start.batch
    while True:
        ids = worker_shards(
            len(spec.shards), seed=spec.seed, epoch=epoch, slot=slot, num_slots=spec.num_slots
        )
        for pos in range(first, len(ids)):
            yield ShardVisit(epoch, pos, len(ids), ids[pos], skip)
            skip = 0
        epoch, first = epoch + 1, 0


def load_shards(
    visits: Iterator[ShardVisit], spec: StreamSpec, skips: _SkipLog
) -> Iterator[tuple[ShardVisit, list[RawSample]]]:
    """Read each scheduled shard whole; a bad one goes to the ``on_error`` policy."""
    check = ShardCheck(spec.data.shard_check)  # one per worker: it lives as long as the stream
    for visit in visits:
        entry = spec.shards[visit.shard_id]
        try:
            samples = read_shard(member_location(spec.cache, entry["name"]), entry, check)
        except ShardError as exc:
            skips.record(visit, entry["name"], exc)
            continue
        yield visit, samples


def plan_shards(
    loaded: Iterator[tuple[ShardVisit, list[RawSample]]], spec: StreamSpec
) -> Iterator[tuple[ShardVisit, Position, list[RawSample]]]:
    """Cut each shard into batches (a pure function of seed, epoch and shard) and drop the
    ones a restored state already consumed, before any mel is decoded."""
    for visit, samples in loaded:
        batches = plan_batches(
            [s.frames for s in samples],
            rng=make_rng(spec.seed, BATCH_PLAN, visit.epoch, visit.shard_id),
            batch_frames=spec.data.budget(spec.shards[visit.shard_id]["bucket"]),
            max_batch_size=spec.data.max_batch_size,
            pad_multiple=spec.data.pad_multiple,
        )
        for number in range(visit.skip_batches, len(batches)):
            picked = [samples[i] for i in batches[number]]
            yield visit, visit.after(number + 1, len(batches)), picked


def collate_batches(
    planned: Iterator[tuple[ShardVisit, Position, list[RawSample]]],
    spec: StreamSpec,
    skips: _SkipLog,
    worker: int,
    ring: BatchRing,
) -> Iterator[tuple[PackedBatch, Cursor]]:
    """Decode and pad each planned batch into the next ring slot; a shard with a bad mel
    loses its remaining batches."""
    failed: ShardVisit | None = None
    seq = 0
    for visit, after, samples in planned:
        if visit == failed:
            continue
        entry = spec.shards[visit.shard_id]
        name = entry["name"]
        try:
            packed = collate(
                samples,
                seq=seq,
                mel_out=functools.partial(ring.slot, seq),
                n_mels=spec.n_mels,
                pad_multiple=spec.data.pad_multiple,
                pad_value=spec.pad_value,
                tokenizer=spec.tokenizer,
                where=member_location(spec.cache, name),
                bucket=entry["bucket"],
            )
        except ShardError as exc:
            failed = visit
            skips.record(visit, name, exc)
            continue
        ring.publish(seq)
        seq += 1
        yield packed, Cursor(worker, after, skips.take())


def worker_stream(
    spec: StreamSpec, worker: int, start: Position, ring: BatchRing
) -> Iterator[tuple[PackedBatch, Cursor]]:
    """The endless stream of logical worker ``worker`` of this rank, resumed at ``start``."""
    skips = _SkipLog(spec.data.on_error, len(spec.shards))
    visits = schedule(spec, spec.rank * spec.workers_per_rank + worker, start)
    loaded = load_shards(visits, spec, skips)
    planned = plan_shards(loaded, spec)
    return collate_batches(planned, spec, skips, worker, ring)
