"""Resuming from a job of another size or mix: which batches the old job left unread.

A bucket sub-stream's batches are numbered in one endless sequence that does not depend on
the job reading it (``melcache/loader/schedule.py``: the units, their order per epoch and
their cuts come from the index, the seed and the budget), and each slot of a job reads a
known part of it (a :class:`Deal`). So the set an old job has read is known from every old
slot's count of batches taken, and what it left unread before the end of the epoch its
furthest slot is in is a few runs of batch numbers: a new job of any size reads those first
(each slot a block of them), then deals the epochs after as a fresh job of its size would.
Nothing is replayed: the runs are found per slot and block (or chunk, in plans 1–3),
``O(slots)``, not per batch or shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from melcache.loader.balance import selection_key
from melcache.loader.deal import Deal, chunk_size, fresh_deal
from melcache.loader.mix import content_digest, same_cache
from melcache.loader.resume.state import (
    ELASTIC_VERSIONS,
    SAME_BATCHES,
    STATE_KEYS,
    LoaderStateError,
    Resumed,
    parse_deals,
)
from melcache.loader.schedule import SubStream
from melcache.loader.spec import StreamSpec


def unread(sub: SubStream, deal: Deal, num_slots: int, taken: Sequence[int]) -> Deal:
    """The deal a new job of any size continues ``sub`` with, after a job of ``num_slots``
    slots that shared it by ``deal`` and whose slot ``s`` took ``taken[s]`` of its batches:
    every batch before the end of the epoch the furthest slot was in that no slot took,
    then the epochs after, from that end."""
    last = max(
        (
            deal.number(sub, slot=slot, num_slots=num_slots, taken=count - 1)
            for slot, count in enumerate(taken)
            if count
        ),
        default=-1,
    )
    frontier = max(deal.frontier, -(-(last + 1) // sub.per_epoch) * sub.per_epoch)
    runs: list[tuple[int, int]] = []
    for slot, count in enumerate(taken):
        runs += _slot_runs(sub, deal, slot, num_slots, count, frontier)
    return dataclasses.replace(deal, frontier=frontier, leftover=tuple(_merged(runs)))


def _slot_runs(
    sub: SubStream, deal: Deal, slot: int, num_slots: int, taken: int, frontier: int
) -> list[tuple[int, int]]:
    """The runs of batch numbers below ``frontier`` that slot ``slot`` of the old job would
    have read after its ``taken`` batches: the rest of its leftover share, then its chunks
    (one batch each in turn where chunks are of one: fewer than two epochs' worth per slot),
    or its blocks of the leftover and the epochs after (``deal.by_epoch``)."""
    if deal.by_epoch:
        return _block_runs(sub, deal, slot, num_slots, taken, frontier)
    if chunk_size(sub, num_slots) == 1:
        runs, number = [], deal.number(sub, slot=slot, num_slots=num_slots, taken=taken)
        while number < frontier:
            runs.append((number, number + 1))
            taken += 1
            number = deal.number(sub, slot=slot, num_slots=num_slots, taken=taken)
        return runs
    first, end = deal.share(slot, num_slots)
    runs = deal.leftover_runs(first + min(taken, end - first), end)
    size = chunk_size(sub, num_slots)
    fresh = max(0, taken - (end - first))  # batches taken after the leftover
    chunk, offset = divmod(fresh, size)
    while True:
        start = deal.frontier + (slot + chunk * num_slots) * size
        if start + offset >= frontier:
            return runs
        runs.append((start + offset, min(start + size, frontier)))
        chunk, offset = chunk + 1, 0


def _block_runs(
    sub: SubStream, deal: Deal, slot: int, num_slots: int, taken: int, frontier: int
) -> list[tuple[int, int]]:
    """:func:`_slot_runs` of a ``by_epoch`` deal: the rest of the slot's block in the part
    (leftover or epoch) its next batch is in, then its blocks of the parts after, up to
    ``frontier``; one step per part the slot has a batch in."""
    runs: list[tuple[int, int]] = []
    while True:
        start, first, end = deal.block(sub, slot=slot, num_slots=num_slots, taken=taken)
        if start < deal.leftover_size:
            runs += deal.leftover_runs(first, end)
        elif (base := deal.fresh(start)) + first < frontier:
            runs.append((base + first, min(base + end, frontier)))
        else:
            return runs
        taken += end - first  # the slot's first batch of a later part


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted disjoint runs, touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(runs):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        elif start < stop:
            out.append((start, stop))
    return out


def stream_keys(spec: StreamSpec) -> list[list[Any]]:
    """Each sub-stream's ``[cache, content digest, bucket]``: what a state's positions are of.
    Under ``data.where`` or ``data.balance`` the digest ends with ``+`` and their key, as
    they change the sub-streams' batches as a change of content does."""
    chosen = selection_key(spec.data.where, spec.data.balance, spec.selection_versions)
    digests = [
        content_digest(source.shards) + (f"+{chosen}" if chosen else "") for source in spec.sources
    ]
    return [
        [same_cache(spec.sources[sub.source].location), digests[sub.source], sub.bucket]
        + ([sub.part] if sub.part else [])  # data.sync_split's ranges: the keys before it alone
        for sub in spec.subs
    ]


def resume_elsewhere(
    spec: StreamSpec,
    identity: Mapping[str, Any],
    states: Sequence[Mapping[str, Any]],
    allow_data_change: bool,
) -> Resumed:
    """Continue from every rank's state of a job of another size or mix (``states``, in rank
    order): each kept sub-stream from what that job left unread, an added cache (or one whose
    content changed, when ``allow_data_change``) from its epoch 0; :class:`LoaderStateError`
    when the states are not one job's or would change the batches themselves."""
    _check_states(identity, states)
    old_keys = _old_keys(identity, states, stream_keys(spec))
    old = {_place(key): u for u, key in enumerate(old_keys)}
    old_digests = {key[0]: key[1] for key in old_keys}
    new_keys = stream_keys(spec)
    changes = _job_changes(identity, states[0])
    for where, digest in dict.fromkeys((k[0], k[1]) for k in new_keys):
        if where not in old_digests:
            changes.append(f"cache {where} added: it starts at its epoch 0")
        elif old_digests[where] != digest and _same_content(old_digests[where], digest):
            changes.append(_selection_change(where, old_digests[where], digest, allow_data_change))
        elif old_digests[where] != digest:
            if not allow_data_change:
                raise LoaderStateError(
                    f"cache {where} changed since the loader state was saved (index digest "
                    f"{old_digests[where]}, now {digest}); data.allow_data_change = true reads "
                    "it afresh from its epoch 0"
                )
            changes.append(f"cache {where} changed content: it starts again at its epoch 0")
    kept = {k[0] for k in new_keys}
    changes += [f"cache {w} dropped" for w in old_digests if w not in kept]
    old_slots = len(states) * int(states[0]["workers_per_rank"])
    deals, frames = [], 0
    for u, sub in enumerate(spec.subs):
        where, digest = new_keys[u][:2]
        match = old.get(_place(new_keys[u])) if old_digests.get(where) == digest else None
        if match is None:
            deals.append(fresh_deal(spec.plan))
            continue
        rows = [worker[match] for state in states for worker in state["positions"]]
        frames += sum(int(row[-1]) for row in rows)
        deal = _saved_deals(states[0], len(old_keys), spec.plan)[match]
        deals.append(unread(sub, deal, old_slots, [int(row[0]) for row in rows]))
    # The schedule's choice of cache within a bucket follows each slot's frames per
    # sub-stream: start every slot even with the (new) weights, so no cache catches up.
    per_slot, phase = frames / spec.num_slots, spec.phase(int(states[0]["batches"]))
    schedule = spec.phases[phase - 1][1] if phase else spec.schedule
    row = [(0, round(target * per_slot)) for target in schedule.targets]
    skipped = {k: v for state in states for k, v in state.get("skipped_shards", {}).items()}
    return Resumed(
        positions=[list(row) for _ in range(spec.workers_per_rank)],
        deals=tuple(deals),
        batches=int(states[0]["batches"]),
        skipped_shards=skipped,
        changes=tuple(changes),
    )


def _same_content(old: str, new: str) -> bool:
    """Whether two sub-stream digests differ only in ``data.where`` / ``data.balance``."""
    return old.split("+")[0] == new.split("+")[0]


def _selection_change(where: str, old: str, new: str, allow_data_change: bool) -> str:
    """The line a resume under another ``data.where`` or ``[data.balance]`` says; another
    ``data.where`` is a data change, refused unless ``allow_data_change``. Either way the
    cache's sub-streams start at their epoch 0, under the new selection from its first
    batch."""
    if _filter_of(old) != _filter_of(new):
        if not allow_data_change:
            raise LoaderStateError(
                f"data.where changed since the loader state was saved (cache {where}); "
                "data.allow_data_change = true reads the cache afresh under it from its epoch 0"
            )
        return f"cache {where}: data.where changed: it starts again at its epoch 0"
    return f"cache {where}: data.balance changed: it starts again at its epoch 0 under it"


def _filter_of(digest: str) -> str | None:
    """The ``data.where`` part of a sub-stream digest, if any."""
    return next((part for part in digest.split("+")[1:] if part.startswith("w:")), None)


def _check_states(identity: Mapping[str, Any], states: Sequence[Mapping[str, Any]]) -> None:
    """Refuse states that are not every rank's of one job at one step, in rank order, or
    whose batches this loader would cut otherwise."""
    if not states:
        raise LoaderStateError("no loader state given (an empty list)")
    for rank, state in enumerate(states):
        if not isinstance(state, Mapping) or state.get("version") not in ELASTIC_VERSIONS:
            version = state.get("version") if isinstance(state, Mapping) else state
            raise LoaderStateError(
                f"loader state {rank} of {len(states)} has version {version!r}: only the "
                f"states of bucket streams (versions {ELASTIC_VERSIONS}) resume on another "
                "job size or mix"
            )
        if state.get("rank") != rank or state.get("world_size") != len(states):
            raise LoaderStateError(
                f"loader state {rank} of the {len(states)} given was saved by rank "
                f"{state.get('rank')!r} of {state.get('world_size')!r}: give every rank's "
                "state of the old job, in rank order"
            )
        for key in (*SAME_BATCHES, "workers_per_rank", "batches"):
            if state.get(key) != states[0].get(key):
                raise LoaderStateError(
                    f"loader states of ranks 0 and {rank} differ in {key} "
                    f"({states[0].get(key)!r}, {state.get(key)!r}): not one job at one step"
                )
    for key in SAME_BATCHES:
        if states[0].get(key) != identity[key]:
            name = STATE_KEYS.get(key, key)
            raise LoaderStateError(
                f"loader state was saved with {name} = {states[0].get(key)!r} but this loader "
                f"has {name} = {identity[key]!r}, which cuts other batches"
            )
    if not identity["sync_buckets"]:
        raise LoaderStateError("only data.sync_buckets = true resumes on another job size or mix")


def _old_keys(
    identity: Mapping[str, Any], states: Sequence[Mapping[str, Any]], mine: list[list[Any]]
) -> list[list[Any]]:
    """The old job's sub-streams: saved with the state, or (version 3, which does not save
    them) this loader's own when the caches and mix are the same."""
    first = states[0]
    if first["version"] == 3:
        if (
            first.get("cache_digest") != identity["cache_digest"]
            or first.get("mix") != (identity["mix"])
        ):
            raise LoaderStateError(
                "a loader state of version 3 resumes on another job size only with the same "
                "caches and mix"
            )
        return mine
    keys = first.get("streams")
    if not (isinstance(keys, list) and all(isinstance(k, list) and len(k) in (3, 4) for k in keys)):
        raise LoaderStateError(f"loader state has no list of sub-streams: {keys!r}")
    return keys


def _place(key: Sequence[Any]) -> tuple[Any, ...]:
    """A sub-stream's cache, bucket and length range from its :func:`stream_keys` entry."""
    return key[0], key[2], key[3] if len(key) > 3 else 0


def _job_changes(identity: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """One line per job setting a resume changed (the caches are said by the caller)."""
    changes = [
        f"{STATE_KEYS.get(key, key)} {old.get(key)!r} -> {identity[key]!r}"
        for key in ("world_size", "workers_per_rank", "mix", "mix_schedule")
        if old.get(key) != identity.get(key)
    ]
    return changes


def _saved_deals(state: Mapping[str, Any], count: int, plan: int) -> tuple[Deal, ...]:
    """The deals a state of batch plan ``plan`` holds (none before version 4: all fresh)."""
    if state["version"] == 3:
        return (fresh_deal(plan),) * count
    return parse_deals(state.get("deals"), count, plan)


def saved_deals(spec: StreamSpec) -> list[list[Any]]:
    """The job's deals as plain lists, for a state."""
    deals = [spec.deal(u) for u in range(len(spec.subs))]
    return [[deal.frontier, [list(run) for run in deal.leftover]] for deal in deals]
