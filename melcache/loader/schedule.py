"""Which sub-stream each batch comes from: a schedule of ``(seed, step, rank, worker)`` and the
frames the worker has taken so far.

A *sub-stream* is one length bucket of one cache (``bucket = -1``: the whole cache, the
stream of ``data.sync_buckets = false``), read shard after shard, epoch after epoch. Each
rank-level step ``j`` (a rank's ``j``-th batch: worker ``j % W``'s ``j // W``-th) takes its
batch from the sub-stream :meth:`Schedule.pick` names:

- bucket-synchronous: the bucket is drawn from ``x = frac(c₁ + j·φ)``, the same on every rank,
  so all ranks of a step hold batches of one length bucket and no rank waits for a longer one.
  Each bucket's probability is its batch share, ``Σ weight(cache) × batches per epoch ÷ frames
  of the cache`` over the caches that have it, so within a cache every bucket runs through its
  epochs at about the same pace (each shard is read once per epoch of its sub-stream).
- the cache within the bucket: the one furthest behind in the frames this worker has taken,
  ``(weight × all − the cache's) + (target × all − the sub-stream's)`` (the sub-stream's
  target: its cache's weight × its share of the cache's frames), plus a lead per slot and
  cache so that the ranks of one step take different caches. The first term keeps each
  cache at its weight: frames per batch vary (a bucket's short and long shards), so counting
  batches would let a 200-batch window drift by several percent of its frames, while the
  deficit keeps every window within about a batch of it. The second keeps a cache's buckets
  at one pace where the buckets' draws fall unevenly on the caches (a bucket only one cache
  has); with the first alone, a cache's buckets would drift apart.

A Kronecker (Weyl) sequence instead of random draws: its counts stay within a few of their
expected values over every window of steps, where random draws drift by √n, and it needs no
state. The cache choice needs the worker's frames per sub-stream, a few integers that travel
with its position, so a resume is still exact and O(1).

Within a sub-stream the epochs are one endless sequence of batches: its shards are grouped
into units (length neighbours read and cut together, so a batch may continue into the next
shard), the units permuted per epoch, each cut into a count of batches known from the index;
the ``world_size × workers`` slots of the job deal each epoch whole, each slot a block of it
(:class:`Deal`: batch plan 4; earlier plans, chunks of the sequence in turn), so a slot's
place is one integer and any batch is located in O(1), and slots share a unit when there are
fewer units than slots.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from melcache.batch_plans import SUBSTREAM_ORDER, even_batch_count, even_units, make_rng
from melcache.loader.balance import Chosen, UnitPicks, allocate
from melcache.loader.data_config import DataConfig
from melcache.loader.sequence import most_per_batch

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
SILVER = math.sqrt(2.0) - 1.0  # independent of GOLDEN over the rationals: a 2-D sequence
SCHEDULE_OFFSETS = 5  # purpose tag of the sequences' random starting points
WHOLE = -1  # bucket of a sub-stream that is a whole cache


@dataclasses.dataclass(frozen=True)
class SubStream:
    """One length bucket of one cache (or the whole cache), as the schedule sees it."""

    source: int  # index of the cache in the mix
    bucket: int  # length bucket, or WHOLE
    units: tuple[tuple[int, ...], ...]  # shards read and cut together (indices into the
    # cache's shard list): length neighbours in a bucket (melcache.batch_plans.even_units), else one
    batches: tuple[int, ...]  # batches of each unit per epoch (the even cut)
    frames: int  # real frames in one epoch
    part: int = 0  # length range of the bucket (data.sync_split), drawn as a bucket is
    # data.where / data.balance: each unit's copies per epoch (melcache/loader/balance.py);
    # empty: every utterance once. Not part of the identity: it follows from the rest.
    picks: tuple[UnitPicks, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @functools.cached_property  # a deal asks it per batch located; units can be thousands
    def per_epoch(self) -> int:
        """Batches in one epoch of the sub-stream, over all slots of the job."""
        return sum(self.batches)


def substreams(
    sources: Sequence[Sequence[Mapping[str, Any]]],
    data: DataConfig,
    sync: bool,
    chosen: Sequence[Chosen | None] = (),
    tops: Sequence[Sequence[int] | None] = (),
    texts: Sequence[Sequence[int] | None] = (),
) -> tuple[SubStream, ...]:
    """The sub-streams of a mix: one per (cache, bucket) when ``sync``, else one per cache;
    ``chosen``: each cache's selection (``data.where``, ``data.balance``), if any; ``tops``:
    per cache, each shard's longest declared sequence (``data.sequence``,
    melcache/loader/sequence.py) where it is not the index's ``max_frames``; ``texts``: per
    cache, each shard's longest text where text is an axis of its own (``"text,frames"``)."""
    out = []
    for source, shards in enumerate(sources):
        given = tops[source] if source < len(tops) else None
        top = given or [entry["max_frames"] for entry in shards]
        text = texts[source] if source < len(texts) else None
        groups: dict[int, list[int]] = {}
        for shard_id, entry in enumerate(shards):
            groups.setdefault(entry["bucket"] if sync else WHOLE, []).append(shard_id)
        for bucket, ids in sorted(groups.items()):
            units = [[i] for i in ids]
            if bucket != WHOLE:
                cut = {"batch_frames": data.budget(bucket), "pad_multiple": data.pad_multiple,
                       "max_batch_size": _most(data, bucket, text, ids)}  # fmt: skip
                grouped = even_units([shards[i]["samples"] for i in ids],
                                     [top[i] for i in ids], **cut)  # fmt: skip
                units = [[ids[j] for j in unit] for unit in grouped]
            counts = [
                even_batch_count(
                    sum(shards[i]["samples"] for i in unit),
                    max(top[i] for i in unit),
                    batch_frames=data.budget(shards[unit[0]]["bucket"]),
                    max_batch_size=_most(data, shards[unit[0]]["bucket"], text, unit),
                    pad_multiple=data.pad_multiple,
                )
                for unit in units
            ]
            out += _split(source, bucket, units, counts, shards, data.split)
    if chosen:
        longest = [
            (tops[s] if tops else None, texts[s] if texts else None) for s in range(len(chosen))
        ]
        out = [
            sub
            for source, pick in enumerate(chosen)
            for sub in _chosen(out, source, pick, data, *longest[source])
        ]
    return tuple(sub for sub in out if sub.per_epoch)  # data.where may leave a range empty


def _most(data: DataConfig, bucket: int, text: Sequence[int] | None, shards: Sequence[int]) -> int:
    """Utterances a batch of these ``shards`` may hold: ``max_batch_size``, and where text is
    an axis of its own (``text``: each shard's longest) what fits ``data.batch_text``."""
    return most_per_batch(data, bucket, max(text[i] for i in shards) if text else None)


def _chosen(
    subs: Sequence[SubStream],
    source: int,
    chosen: Chosen,
    data: DataConfig,
    top: Sequence[int] | None,
    text: Sequence[int] | None = None,
) -> list[SubStream]:
    """The sub-streams of cache ``source`` with the copies ``chosen`` deals their units,
    dealt over all of them at once (a speaker's remainder carried across buckets too);
    ``top``: each shard's longest declared sequence, if not frames; ``text``: each shard's
    longest text, where it is an axis of its own."""
    mine = [sub for sub in subs if sub.source == source]
    picks = iter(allocate(chosen, [unit for sub in mine for unit in sub.units]))
    return [_picked(sub, [next(picks) for _ in sub.units], chosen, data, top, text) for sub in mine]


def _picked(
    sub: SubStream,
    picks: Sequence[UnitPicks],
    chosen: Chosen,
    data: DataConfig,
    top: Sequence[int] | None,
    text: Sequence[int] | None,
) -> SubStream:
    """``sub`` with its units' ``picks``: each unit's batches and the epoch's frames counted
    from them, the longest utterance a unit may hold that of its rows ever picked (with a
    declared sequence, or a text axis, its shards' longest: a bound, as the text is not per
    row here)."""
    counts = tuple(
        even_batch_count(
            pick.size,
            max(top[s] for s in unit) if top else int(chosen.frames[pick.rows].max(initial=0)),
            batch_frames=data.budget(sub.bucket),
            max_batch_size=_most(data, sub.bucket, text, unit),
            pad_multiple=data.pad_multiple,
        )
        if pick.size
        else 0
        for unit, pick in zip(sub.units, picks, strict=True)
    )
    frames = sum(float(chosen.frames[p.rows] @ p.weights) for p in picks)
    return dataclasses.replace(sub, batches=counts, frames=round(frames), picks=tuple(picks))


def _split(
    source: int,
    bucket: int,
    units: Sequence[Sequence[int]],
    counts: Sequence[int],
    shards: Sequence[Mapping[str, Any]],
    parts: int,
) -> list[SubStream]:
    """A bucket's units (in length order, as :func:`even_units` gives them) as ``parts``
    sub-streams of neighbouring lengths and near-equal batches (one where ``parts`` is 1 or
    the bucket is a whole cache)."""
    parts = 1 if bucket == WHOLE else min(parts, len(units))
    ends = list(itertools.accumulate(counts))
    cuts = [bisect.bisect_left(ends, part * ends[-1] // parts) + 1 for part in range(1, parts)]
    places = [0, *cuts, len(units)]
    out = []
    for part, (start, stop) in enumerate(itertools.pairwise(places)):
        held = [tuple(unit) for unit in units[start:stop]]
        frames = sum(shards[i]["frames"] for unit in held for i in unit)
        out.append(SubStream(source, bucket, tuple(held), tuple(counts[start:stop]), frames, part))
    return [s for s in out if s.units]


def mix_weights(
    hours: Sequence[float], weights: Sequence[float] | None, temperature: float
) -> list[float]:
    """Frame shares of the caches: ``weights`` (default: each cache's hours) to the power
    ``temperature``, normalised (NeMo's temperature sampling: α < 1 lifts small caches)."""
    base, alpha = list(hours if weights is None else weights), float(temperature)
    if alpha == 0 or not any(w > 0 for w in base):  # w**0 is 1 for every w, 0 included
        return [1 / len(base)] * len(base)
    # In log space, scaled by the largest: w**α overflows at α = 300.5 and underflows to a
    # zero total for weights of 1e-200 at α = 2; exp(x - top) is in (0, 1] and sums to ≥ 1.
    logs = [alpha * math.log(w) if w > 0 else -math.inf for w in base]  # exact for big ints
    top = max(logs)
    powered = [math.exp(x - top) for x in logs]
    total = sum(powered)
    return [w / total for w in powered]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The choice of a sub-stream per step (see the module docstring)."""

    groups: tuple[tuple[int, ...], ...]  # sub-stream indices drawn together (a bucket, or all)
    group_edges: tuple[float, ...]  # cumulative probabilities of the groups
    source_of: tuple[int, ...]  # cache of each sub-stream
    weights: tuple[float, ...]  # frame share of each cache
    targets: tuple[float, ...]  # frame share of each sub-stream: its cache's, by its frames
    batch_frames: float  # mean real frames of a batch: the scale of the slots' leads
    offsets: tuple[float, float]

    def pick(self, step: int, slot: int, consumed: Sequence[int]) -> int:
        """Sub-stream of a worker's batch at rank-level step ``step``: the group from a sequence
        every rank shares, the member furthest behind in the frames ``consumed`` (per
        sub-stream) by slot ``slot`` so far."""
        x = math.fmod(self.offsets[0] + step * GOLDEN, 1.0)
        group = self.groups[_bin(self.group_edges, x)]
        if len(group) == 1:
            return group[0]
        taken = [0] * len(self.weights)
        for sub, frames in enumerate(consumed):
            taken[self.source_of[sub]] += frames
        total = sum(taken)

        def behind(sub: int) -> float:
            source = self.source_of[sub]
            turn = (slot * len(self.weights) + source) * SILVER
            lead = math.fmod(self.offsets[1] + turn, 1.0) * self.batch_frames
            cache = self.weights[source] * total - taken[source]
            return cache + self.targets[sub] * total - consumed[sub] + lead

        return max(group, key=behind)


def make_schedule(
    subs: Sequence[SubStream], weights: Sequence[float], *, seed: int, sync: bool
) -> Schedule:
    """The schedule of ``subs`` with cache frame shares ``weights``; ``sync`` groups them by
    bucket (drawn alike on every rank), otherwise all form one group."""
    source_frames: dict[int, int] = {}
    for sub in subs:
        source_frames[sub.source] = source_frames.get(sub.source, 0) + sub.frames
    share = [weights[s.source] * s.per_epoch / source_frames[s.source] for s in subs]
    frame_share = [weights[s.source] * s.frames / source_frames[s.source] for s in subs]
    keys = sorted({(s.bucket, s.part) for s in subs}) if sync else [None]
    groups = tuple(
        tuple(i for i, s in enumerate(subs) if key in (None, (s.bucket, s.part))) for key in keys
    )
    mass = [sum(share[i] for i in g) for g in groups]
    rng = make_rng(seed, SCHEDULE_OFFSETS)
    return Schedule(
        groups=groups,
        group_edges=_edges(mass),
        source_of=tuple(s.source for s in subs),
        weights=tuple(weights),
        targets=tuple(frame_share),
        batch_frames=sum(s.frames for s in subs) / sum(s.per_epoch for s in subs),
        offsets=(float(rng.random()), float(rng.random())),
    )


def _edges(masses: Sequence[float]) -> tuple[float, ...]:
    total = sum(masses)
    return tuple(itertools.accumulate(m / total for m in masses))


def _bin(edges: tuple[float, ...], value: float) -> int:
    return min(bisect.bisect_right(edges, value), len(edges) - 1)


def chunk_size(sub: SubStream, num_slots: int) -> int:
    """Batches a slot takes in a row: about its share of an epoch, at least one."""
    return max(1, sub.per_epoch // num_slots)


def global_batch(sub: SubStream, *, slot: int, num_slots: int, taken: int) -> int:
    """Number, in the sub-stream's endless sequence, of slot ``slot``'s batch after ``taken``:
    slots take chunks in turn, so the slots' batches are disjoint and cover the sequence."""
    size = chunk_size(sub, num_slots)
    return (slot + (taken // size) * num_slots) * size + taken % size


@dataclasses.dataclass(frozen=True)
class Deal:
    """How the slots of a job share one sub-stream's endless sequence of batches.

    A job resumed from a job of another size or mix (``melcache/loader/resume/elsewhere.py``) first
    reads ``leftover``, the batches before ``frontier`` (an epoch boundary) that the old job
    left unread (sorted, disjoint ``[start, stop)`` runs), then deals the sequence from
    ``frontier`` on as a fresh job of its size deals it from 0.

    ``by_epoch`` (batch plan 4 on): the job's places ``taken × slots + slot`` are cut into the
    leftover, then one epoch after another, and each slot's places in one of them are a
    block of it, the blocks in slot order. A slot's batches of an epoch are neighbours, in
    few units. Where every slot takes one batch a step (ranks of one worker each, one cache),
    places are read in order, so the job reads each epoch whole before any batch of the
    next (ranks in order within the step they share), whatever its size; a rank's workers
    serve its steps in turn, so there a turn of them reads the places of one ``taken``
    (epochs meet within a turn), and they drift apart by the buckets they draw.

    Otherwise (plans 1–3) a fresh job deals the whole sequence in chunks
    (:func:`global_batch`), whose turns run across epoch ends: where an epoch is not a whole
    number of turns, some slots read the next epoch's first chunk while one finishes this
    one's last. There each slot reads a near-equal run of the leftover (the larger runs
    first); where chunks are of one (an epoch has fewer than two batches per slot), the
    slots take the leftover and then the sequence one batch each in turn.
    """

    frontier: int = 0
    leftover: tuple[tuple[int, int], ...] = ()
    by_epoch: bool = False

    @functools.cached_property
    def ends(self) -> tuple[int, ...]:
        """Running count of leftover batches at the end of each run."""
        return tuple(itertools.accumulate(stop - start for start, stop in self.leftover))

    @property
    def leftover_size(self) -> int:
        """Batches in the leftover."""
        return self.ends[-1] if self.ends else 0

    def share(self, slot: int, num_slots: int) -> tuple[int, int]:
        """Slot ``slot``'s part ``[first, end)`` of the leftover, counted in leftover batches:
        near-equal and the larger parts first, so the slots leave the leftover together."""
        total = self.leftover_size
        return -(-slot * total // num_slots), -(-(slot + 1) * total // num_slots)

    def number(self, sub: SubStream, *, slot: int, num_slots: int, taken: int) -> int:
        """Number, in the sub-stream's sequence, of slot ``slot``'s batch after ``taken``."""
        if self.by_epoch:
            start, first, _ = self.block(sub, slot=slot, num_slots=num_slots, taken=taken)
            return (
                self.leftover_batch(first)
                if start < self.leftover_size
                else self.fresh(start) + first
            )
        if chunk_size(sub, num_slots) == 1:
            place, total = taken * num_slots + slot, self.leftover_size
            return self.leftover_batch(place) if place < total else self.frontier + place - total
        first, end = self.share(slot, num_slots)
        if taken < end - first:
            return self.leftover_batch(first + taken)
        fresh = global_batch(sub, slot=slot, num_slots=num_slots, taken=taken - (end - first))
        return self.frontier + fresh

    def block(
        self, sub: SubStream, *, slot: int, num_slots: int, taken: int
    ) -> tuple[int, int, int]:
        """``by_epoch``: where slot ``slot``'s batch after ``taken`` lies. The job's place of
        it (rank order) falls in a part, the leftover or an epoch after it, that starts at
        place ``start``; the batch is ``first`` of that part's (a leftover place, or batches
        from the epoch's first), and the slot's block in the part ends before ``end``."""
        total, place = self.leftover_size, taken * num_slots + slot
        if place < total:
            start, stop = 0, total
        else:
            start = place - (place - total) % sub.per_epoch
            stop = start + sub.per_epoch
        head = _below_slot(stop, slot, num_slots) - _below_slot(start, slot, num_slots)
        mine = _of_slot(start, slot, num_slots)
        return start, head + taken - mine, head + _of_slot(stop, slot, num_slots) - mine

    def fresh(self, start: int) -> int:
        """``by_epoch``: the sequence number of the first batch of the epoch after the
        leftover whose first place (rank order) is ``start``."""
        return self.frontier + start - self.leftover_size

    def read_by_job(self, num_slots: int, taken: float) -> float:
        """Batches of the sequence a job of ``num_slots`` slots has read when each has taken
        ``taken``: what the old job read before ``frontier``, then the slots' own."""
        return self.frontier - self.leftover_size + num_slots * taken

    def leftover_batch(self, place: int) -> int:
        """The sequence number of the leftover's ``place``-th batch."""
        run = bisect.bisect_right(self.ends, place)
        return self.leftover[run][0] + place - (self.ends[run - 1] if run else 0)

    def leftover_runs(self, first: int, end: int) -> list[tuple[int, int]]:
        """The sequence numbers of leftover places ``first..end-1``, as runs."""
        runs = []
        while first < end:
            run = bisect.bisect_right(self.ends, first)
            start = self.leftover_batch(first)
            length = min(end, self.ends[run]) - first
            runs.append((start, start + length))
            first += length
        return runs


EPOCH_DEAL_PLAN = 4  # the first batch plan whose deals are by_epoch (before: chunks in turn)


def fresh_deal(plan: int) -> Deal:
    """A fresh job's deal of a sub-stream under batch plan ``plan``."""
    return Deal(by_epoch=plan >= EPOCH_DEAL_PLAN)


def _of_slot(end: int, slot: int, num_slots: int) -> int:
    """How many of the places ``0..end-1`` in rank order (``taken × num_slots + slot``) are
    slot ``slot``'s."""
    return max(0, -(-(end - slot) // num_slots))


def _below_slot(end: int, slot: int, num_slots: int) -> int:
    """How many of the places ``0..end-1`` in rank order are those of slots below ``slot``."""
    return end // num_slots * slot + min(end % num_slots, slot)


def visit_run(
    sub: SubStream, deal: Deal, *, seed: int, slot: int, num_slots: int, taken: int, limit: int
) -> int:
    """How many of slot ``slot``'s batches from its ``taken``-th on are of one visit of one
    unit (the same epoch and place), counted up to ``limit``: the share of the unit the
    slot's read is for."""

    def visit(t: int) -> tuple[int, int]:
        number = deal.number(sub, slot=slot, num_slots=num_slots, taken=t)
        return locate(sub, seed=seed, number=number)[:2]

    first, run = visit(taken), 1
    while run < limit and visit(taken + run) == first:
        run += 1
    return run


def locate(sub: SubStream, *, seed: int, number: int) -> tuple[int, int, int]:
    """``(epoch, place in sub.units, batch of that unit's cut)`` of batch ``number``."""
    epoch, offset = divmod(number, sub.per_epoch)
    order, ends = _epoch_layout(sub, seed, epoch)
    pos = bisect.bisect_right(ends, offset)
    return epoch, order[pos], offset - (ends[pos - 1] if pos else 0)


@functools.lru_cache(maxsize=64)
def _epoch_layout(sub: SubStream, seed: int, epoch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The epoch's order of ``sub.units`` places, and the running batch count at the end
    of each."""
    parts = (epoch, sub.part) if sub.part else (epoch,)  # part 0: the unsplit bucket's order
    rng = make_rng(seed, SUBSTREAM_ORDER, sub.source, sub.bucket + 1, *parts)
    order = tuple(rng.permutation(len(sub.units)).tolist())
    return order, tuple(itertools.accumulate(sub.batches[i] for i in order))
