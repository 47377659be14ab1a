"""One unit of a bucket's shards as a bucket reader takes it: read whole, or by range.

A unit (length-neighbour shards cut together, ``melcache/loader/schedule.py``) is shared by the slots of
a job when it has fewer units than slots, each slot taking a few of its batches. Reading the
unit whole for those few made every sharing slot read all of it. Where the cache has a table
(``utterances.table``: each utterance's frames and place), a slot that takes little of a unit
cuts it from the table without reading it and reads only its batches' utterances, one ranged
read per run of them in a shard, each checked against the table's digest of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from melcache.access import Cache
from melcache.errors import ShardError
from melcache.loader.deal import Deal, visit_run
from melcache.loader.schedule import SubStream
from melcache.location import member_location
from melcache.reader import RawSample
from melcache.table import TABLE_NAME

# A slot that takes less than this share of a unit's batches reads only their samples, by the
# cache's table: a ranged read costs about a whole shard's read per sample, plus ~10 µs per
# run of consecutive samples.
RANGED_BELOW = 0.6

Record = Callable[[str, ShardError], None]  # a shard that cannot be read: its name, why


@dataclasses.dataclass(frozen=True)
class UnitMembers:
    """The samples of one unit as the even cut sees them: their frames and shards' index
    entries, in tar order, and ``fetch``, which gives ``(place, sample)`` for the places asked
    for that could be read."""

    frames: list[int]
    owners: list[dict[str, Any]]
    fetch: Callable[[Sequence[int]], list[tuple[int, RawSample]]]
    rows: list[int] = dataclasses.field(default_factory=list)  # table row of each, if known

    def chosen(self, rows: np.ndarray) -> UnitMembers:
        """The members at table ``rows`` (``data.where``, ``data.balance``: a row may come
        more than once), those of shards that could not be read left out."""
        held = np.asarray(self.rows, np.int64)
        order = np.argsort(held, kind="stable")
        at = np.minimum(np.searchsorted(held[order], rows), max(len(held) - 1, 0))
        found = held[order][at] == rows if len(held) else np.zeros(len(rows), bool)
        places = order[at[found]].tolist()
        return UnitMembers(
            np.asarray(self.frames)[places].tolist(),
            [self.owners[p] for p in places],
            functools.partial(_fetch_chosen, self.fetch, places),
            rows[found].tolist(),
        )


def _fetch_chosen(
    fetch: Callable[[Sequence[int]], list[tuple[int, RawSample]]],
    places: Sequence[int],
    at: Sequence[int],
) -> list[tuple[int, RawSample]]:
    """``fetch`` of the chosen members ``at`` (their places in the unit: ``places``), each
    given back at its chosen place; those that could not be read are left out, in order."""
    found = iter(fetch([places[i] for i in at]))
    out, held = [], next(found, None)
    for i in at:
        if held is not None and held[0] == places[i]:
            out.append((i, held[1]))
            held = next(found, None)
    return out


def takes_little(
    sub: SubStream, deal: Deal, place: int, *, seed: int, slot: int, num_slots: int, taken: int
) -> bool:
    """Whether the slot's run of batches of one visit of unit ``place``, from its ``taken``-th
    batch, is under :data:`RANGED_BELOW` of the unit's (it shares the unit with others)."""
    limit = math.ceil(RANGED_BELOW * sub.batches[place])
    run = visit_run(sub, deal, seed=seed, slot=slot, num_slots=num_slots, taken=taken, limit=limit)
    return run < limit


def whole_unit(
    shards: Sequence[dict[str, Any]],
    unit: tuple[int, ...],
    read: Callable[[int], list[RawSample] | None],
    first_rows: Sequence[int] = (),
) -> UnitMembers:
    """Every shard of the unit read whole by ``read`` (``None``: it could not be, and was
    recorded), so the unit is cut from the others; ``first_rows``: the table's first row of
    each shard, where the members' rows are asked for."""
    samples: list[RawSample] = []
    owners: list[dict[str, Any]] = []
    rows: list[int] = []
    for shard_id in unit:
        held = read(shard_id) or []
        samples += held
        owners += [shards[shard_id]] * len(held)
        if first_rows:
            rows += range(first_rows[shard_id], first_rows[shard_id] + len(held))
    return UnitMembers(
        [s.frames for s in samples], owners, lambda at: [(i, samples[i]) for i in at], rows
    )


def ranged_unit(
    cache: Cache,
    location: str,
    shards: Sequence[dict[str, Any]],
    unit: tuple[int, ...],
    record: Record,
) -> UnitMembers:
    """The unit from the cache's table, nothing read yet. A shard whose table frames leave its
    index bounds (which batching relies on) is recorded and left out."""
    starts, lengths = cache.table.column("shard_rows"), cache.lengths
    rows: list[int] = []
    owners: list[dict[str, Any]] = []
    for shard_id in unit:
        entry = shards[shard_id]
        ids = range(int(starts[shard_id]), int(starts[shard_id + 1]))
        held = lengths[ids.start : ids.stop]
        low, high = entry["min_frames"], entry["max_frames"]
        if len(held) and not low <= held.min() <= held.max() <= high:
            where = member_location(location, entry["name"])
            record(entry["name"], ShardError(
                f"{where}: {TABLE_NAME} gives frames {int(held.min())}..{int(held.max())}, "
                f"outside the index's [{low}, {high}]"
            ))  # fmt: skip
            continue
        rows += ids
        owners += [entry] * len(ids)
    fetch = functools.partial(_fetch_rows, cache, rows, owners, record)
    return UnitMembers(lengths[rows].tolist(), owners, fetch, rows)


def _fetch_rows(
    cache: Cache,
    rows: list[int],
    owners: list[dict[str, Any]],
    record: Record,
    places: Sequence[int],
) -> list[tuple[int, RawSample]]:
    """The samples at ``places`` of a unit read by range; a shard that cannot be read is
    recorded and its samples left out of the batch, as reading whole leaves it out of the
    unit."""
    by_shard: dict[str, list[int]] = {}
    for place in places:
        by_shard.setdefault(owners[place]["name"], []).append(place)
    read: dict[int, RawSample] = {}
    for name, held in by_shard.items():
        try:
            read.update(zip(held, cache.raw_rows([rows[i] for i in held]), strict=True))
        except ShardError as exc:
            record(name, exc)
    return [(place, read[place]) for place in places if place in read]
