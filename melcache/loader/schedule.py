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
(`melcache/loader/deal.py`: batch plan 4; earlier plans, chunks of the sequence in turn), so a slot's
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

from melcache.batch_plans import even_batch_count, even_units, make_rng
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
