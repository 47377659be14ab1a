"""One loader worker's endless batch stream, as plain generator stages.

``worker_stream`` asks the schedule (``melcache/loader/schedule.py``) which sub-stream each of its
batches comes from, and pulls that batch from the sub-stream's reader: a lazy generator that
reads each shard it needs (the last one kept), cuts it into batches and hands them out. A
batch travels with a :class:`Cursor`: the sub-stream it came from and the worker's position
in that sub-stream *after* it, which is all the loader needs to resume.

Two readers. A bucket sub-stream (``data.sync_buckets``, the default) is one endless sequence
of batches whose counts come from the index; its position is one integer, the batches this
worker's slot has taken, and any batch is located without reading (``deal.locate``). A
whole-cache sub-stream (``sync_buckets = false``) is the stream of earlier releases: each
epoch the cache's shards are dealt to the slots and cut greedily; its position is (epoch,
shard in the slot's list, batches taken from it), the batching a pure function of
``(seed, epoch, shard)``. Either way a restored worker re-reads at most one shard (a bucket
sub-stream: one unit of its shards, or only its batches of it, ``melcache/loader/units.py``) per
sub-stream and skips its consumed batches without decoding their mels. Each position ends
with the real frames the worker has taken from the sub-stream: the schedule's choice of cache
within a bucket follows them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np

from melcache.access import Cache
from melcache.batch_plans import (
    BATCH_PLAN,
    EVEN_PLAN,
    make_rng,
    plan_batches,
    plan_even_batches,
    worker_shards,
)
from melcache.errors import ShardError
from melcache.loader.batch import PackedBatch, collate
from melcache.loader.deal import locate
from melcache.loader.reads.fields import BatchFields
from melcache.loader.reads.shards import SkipLog, disk_counts, read_checked
from melcache.loader.schedule import SubStream
from melcache.loader.sequence import TWO_AXES, declared_texts, plan_two_axis_batches
from melcache.loader.spec import Cursor, Position, StreamSpec
from melcache.loader.transport import BatchRing
from melcache.loader.units import UnitMembers, ranged_unit, takes_little, whole_unit
from melcache.location import member_location
from melcache.reader import RawSample, ShardCheck

# A planned batch: the shard visit it belongs to (a failed visit loses its other batches),
# the reader's position after it, its samples, their source and their shards' index entries
# (one, or two where a batch continues into the next shard of its unit).
Planned = tuple[Hashable, tuple[int, ...], list[RawSample], int, tuple[dict[str, Any], ...]]


@dataclasses.dataclass(frozen=True)
class ShardVisit:
    """One read of one shard by this worker, in one epoch."""

    epoch: int
    pos: int  # index in this worker's shard list for the epoch
    count: int  # length of that list
    shard_id: int  # index into the source's shards
    skip_batches: int  # batches consumed before a restore (first visit only)

    def after(self, batch: int, num_batches: int) -> Position:
        """Normalised position after ``batch`` batches of ``num_batches``: a finished shard
        points at the next one, so a restore never re-reads a shard it does not need."""
        if batch < num_batches:
            return Position(self.epoch, self.pos, batch)
        if self.pos + 1 < self.count:
            return Position(self.epoch, self.pos + 1, 0)
        return Position(self.epoch + 1, 0, 0)


def whole_cache_batches(
    spec: StreamSpec, sub: SubStream, slot: int, start: Position, check: ShardCheck, skips: SkipLog
) -> Iterator[Planned]:
    """A whole cache as earlier releases streamed it: this slot's shards of every epoch
    (dealt by ``worker_shards``), each cut greedily (a pure function of seed, epoch and
    shard), the batches a restore already consumed dropped before any mel is decoded."""
    shards, source = spec.sources[sub.source].shards, sub.source
    epoch, first, skip = start.epoch, start.shard, start.batch
    while True:
        ids = worker_shards(
            len(shards), seed=spec.seed, epoch=epoch, slot=slot, num_slots=spec.num_slots,
            stream=source,
        )  # fmt: skip
        for pos in range(first, len(ids)):
            visit = ShardVisit(epoch, pos, len(ids), ids[pos], skip)
            skip, samples = 0, read_checked(spec, source, visit.shard_id, check=check, skips=skips)
            if samples is None:
                continue
            entry = shards[visit.shard_id]
            batches = plan_batches(
                [s.frames for s in samples],
                rng=make_rng(
                    spec.seed, BATCH_PLAN, epoch, visit.shard_id, *((source,) if source else ())
                ),
                batch_frames=spec.data.budget(entry["bucket"]),
                max_batch_size=spec.data.max_batch_size,
                pad_multiple=spec.data.pad_multiple,
            )
            for number in range(visit.skip_batches, len(batches)):
                after = visit.after(number + 1, len(batches))
                picked = [samples[i] for i in batches[number]]
                yield visit, (after.epoch, after.shard, after.batch), picked, source, (entry,)
        epoch, first = epoch + 1, 0


def bucket_batches(
    spec: StreamSpec,
    stream: int,
    slot: int,
    taken: int,
    check: ShardCheck,
    skips: SkipLog,
    cache: Cache | None,
) -> Iterator[Planned]:
    """This slot's batches of one bucket sub-stream, from its ``taken``-th on: each located
    in O(1) from the index, its unit of shards cut once for a run of its batches. Where the
    slot takes little of a unit (it shares it with other slots) and the cache has a table
    (``cache``), only its batches' samples are read, else the unit's shards whole. A shard
    that cannot be read is recorded and left out: of the unit's cut when read whole, of the
    batch when read by range."""
    sub, deal = spec.subs[stream], spec.deal(stream)
    visit: tuple[int, int] | None = None
    plan: list[list[int]] = []
    read = functools.partial(read_checked, spec, sub.source, check=check, skips=skips)

    def record(name: str, problem: ShardError) -> None:
        skips.record((sub.source, name), name, problem)

    while True:
        number = deal.number(sub, slot=slot, num_slots=spec.num_slots, taken=taken)
        epoch, place, batch = locate(sub, seed=spec.seed, number=number)
        taken += 1
        unit = sub.units[place]
        if visit != (epoch, unit[0]):
            visit = (epoch, unit[0])
            source = spec.sources[sub.source]
            if cache is not None and takes_little(
                sub,
                deal,
                place,
                seed=spec.seed,
                slot=slot,
                num_slots=spec.num_slots,
                taken=taken - 1,
            ):
                members = ranged_unit(cache, source.location, source.shards, unit, record)
            else:
                members = whole_unit(source.shards, unit, read, source.first_rows)
            if sub.picks:  # data.where, data.balance: this epoch's copies of the unit
                picked = sub.picks[place].rows_of(spec.seed, sub.source, epoch, unit[0])
                members = members.chosen(picked)
            rng = make_rng(spec.seed, EVEN_PLAN, sub.source, epoch, unit[0])
            count = min(sub.batches[place], len(members.frames))
            plan = _cut_unit(spec, sub, members, unit, rng, count) if count else []
        if batch < len(plan):
            held = members.fetch(plan[batch])
            if held:  # else every shard of the batch failed, each recorded
                owners = (members.owners[at] for at, _ in held)
                entries = tuple({entry["name"]: entry for entry in owners}.values())
                yield visit, (taken,), [sample for _, sample in held], sub.source, entries


def _cut_unit(
    spec: StreamSpec,
    sub: SubStream,
    members: UnitMembers,
    unit: tuple[int, ...],
    rng: np.random.Generator,
    count: int,
) -> list[list[int]]:
    """A unit's ``count`` batches (places in ``members``), cut on what ``data.sequence``
    declares: frames, ``text + frames`` (one length), or text and frames (two axes)."""
    data, frames, source = spec.data, members.frames, spec.sources[sub.source]
    if source.text is None:
        texts = None
    elif sub.picks:  # data.where, data.balance: the chosen rows
        texts = [int(source.text.per_row[r]) for r in members.rows]
    else:
        texts = declared_texts(members.owners, unit, source.shards, source.text)
    if texts is not None and data.sequence == TWO_AXES:
        return plan_two_axis_batches(
            texts, frames, rng=rng, count=count, max_batch_size=data.max_batch_size,
            pad_multiple=data.pad_multiple, attention_frames=data.attention,
        )  # fmt: skip
    lengths = frames if texts is None else [f + t for f, t in zip(frames, texts, strict=True)]
    spread = sub.picks and data.balance.get("spread")  # copies a batch apart
    return plan_even_batches(
        lengths, rng=rng, count=count, max_batch_size=data.max_batch_size,
        pad_multiple=data.pad_multiple, plan=spec.plan, attention_frames=data.attention,
        rows=members.rows if spread else None,
    )  # fmt: skip


def progress(spec: StreamSpec, positions: list[list[tuple[int, ...]]]) -> list[list[float]]:
    """Per worker of this rank and sub-stream: epochs of it behind the worker's next batch."""
    out = []
    for worker, row in enumerate(positions):
        slot = spec.rank * spec.workers_per_rank + worker
        out.append([
            p[0] + p[1] * spec.num_slots / len(sub.units)  # (epoch, shard, batch)
            if sub.bucket < 0
            else spec.deal(u).number(sub, slot=slot, num_slots=spec.num_slots, taken=p[0])
            / sub.per_epoch
            for u, (sub, p) in enumerate(zip(spec.subs, row, strict=True))
        ])  # fmt: skip
    return out


def open_readers(
    spec: StreamSpec,
    slot: int,
    positions: list[tuple[int, ...]],
    check: ShardCheck,
    skips: SkipLog,
    stack: contextlib.ExitStack,
) -> list[Iterator[Planned]]:
    """Slot ``slot``'s reader of each sub-stream, from ``positions``: planned batches, no mel
    decoded; the caches they read by table are opened once each, closed with ``stack``."""
    caches = [
        stack.enter_context(Cache(source.location)) if source.ranged else None
        for source in spec.sources
    ]
    return [
        bucket_batches(spec, u, slot, position[0], check, skips, caches[sub.source])
        if sub.bucket >= 0
        else whole_cache_batches(spec, sub, slot, Position(*position[:3]), check, skips)
        for u, (sub, position) in enumerate(zip(spec.subs, positions, strict=True))
    ]


def planned_stream(spec: StreamSpec, worker: int) -> Iterator[Planned]:
    """Logical worker ``worker``'s batches from the start, in the schedule's order, planned
    but no mel decoded (what benchmarks and tests plan whole jobs with)."""
    slot = spec.rank * spec.workers_per_rank + worker
    starts = [spec.start(sub) for sub in spec.subs]
    with contextlib.ExitStack() as stack:
        readers = open_readers(spec, slot, starts, ShardCheck("off"), SkipLog("raise", 1), stack)
        consumed = [0] * len(readers)
        for step in itertools.count():
            stream = spec.pick(step * spec.workers_per_rank + worker, slot, consumed)
            planned = next(readers[stream])
            consumed[stream] += sum(s.frames for s in planned[2])
            yield planned


def worker_stream(
    spec: StreamSpec, worker: int, step: int, positions: list[tuple[int, ...]], ring: BatchRing
) -> Iterator[tuple[PackedBatch, Cursor]]:
    """The endless stream of logical worker ``worker`` of this rank, resumed at its batch
    ``step`` with ``positions`` in its sub-streams: each batch from the sub-stream the
    schedule picks; a shard with a bad mel loses its remaining batches in that sub-stream."""
    skips = SkipLog(spec.data.on_error, sum(len(s.shards) for s in spec.sources))
    check = ShardCheck(spec.data.shard_check)  # one per worker: it lives as long as the stream
    slot = spec.rank * spec.workers_per_rank + worker
    fields = BatchFields(spec.sources, spec.data.fields)
    with contextlib.ExitStack() as stack:
        readers = open_readers(spec, slot, positions, check, skips, stack)
        consumed = [position[-1] for position in positions]
        failed: list[Hashable] = [None] * len(readers)
        seq = 0
        while True:
            rank_step = step * spec.workers_per_rank + worker  # the rank's batch number
            stream = spec.pick(rank_step, slot, consumed)
            packed, after = _collate_next(
                spec, readers[stream], failed, stream, skips, ring, seq, fields
            )
            consumed[stream] += int(packed.mel_lengths.sum())
            ring.publish(seq)
            seq += 1
            step += 1
            position = (*after, consumed[stream])
            yield packed, Cursor(worker, stream, position, skips.take(), disk_counts(spec))


def _collate_next(
    spec: StreamSpec,
    reader: Iterator[Planned],
    failed: list[Hashable],
    stream: int,
    skips: SkipLog,
    ring: BatchRing,
    seq: int,
    fields: BatchFields,
) -> tuple[PackedBatch, tuple[int, ...]]:
    """Decode and pad the reader's next batch into ring slot ``seq``; a batch with a bad mel
    goes to the ``on_error`` policy and its shard visit loses its remaining batches."""
    for visit, after, samples, source, entries in reader:
        if visit == failed[stream]:
            continue
        location = spec.sources[source].location
        name = " + ".join(entry["name"] for entry in entries)
        try:
            packed = collate(
                samples,
                seq=seq,
                mel_out=functools.partial(ring.slot, seq),
                n_mels=spec.n_mels if spec.data.read_mel else 0,
                pad_multiple=spec.data.pad_multiple,
                pad_value=spec.pad_value,
                tokenizer=spec.tokenizer,
                where=" + ".join(member_location(location, e["name"]) for e in entries),
                bucket=entries[0]["bucket"],
                source=location,
                extras=spec.data.extras,
            )
            packed.fields, packed.field_lengths = fields.batch(source, samples, entries)
        except ShardError as exc:
            failed[stream] = visit
            skips.record((source, name), name, exc)
            continue
        return packed, after
    raise AssertionError("a sub-stream reader is endless")
