"""Which sub-stream each batch comes from: one pure schedule of ``(seed, step, rank, worker)``.

A *sub-stream* is one length bucket of one cache (``bucket = -1``: the whole cache, the
stream of ``data.sync_buckets = false``), read shard after shard, epoch after epoch. Each
rank-level step ``j`` (a rank's ``j``-th batch: worker ``j % W``'s ``j // W``-th) takes its
batch from the sub-stream :meth:`Schedule.pick` names:

- bucket-synchronous: the bucket is drawn from ``x = frac(c₁ + j·φ)``, the same on every rank,
  so all ranks of a step hold batches of one length bucket and no rank waits for a longer one;
  the cache within the bucket from ``y = frac(c₂ + (j·R + r)·(√2 − 1))``, which differs per
  rank, so each step mixes caches across ranks.
- Each sub-stream's probability is its batch share: ``weight(cache) × batches per epoch ÷
  frames of the cache``, so the frames consumed follow the weights, and within a cache every
  bucket runs through its epochs at the same pace (each shard is read once per epoch of its
  sub-stream).

A Kronecker (Weyl) sequence instead of random draws: its counts stay within a few of their
expected values over every window of steps, where random draws drift by √n, so a small cache
appears at its weight over 200 batches as over 200,000, and the choice needs no state.

Within a sub-stream the epochs are one endless sequence of batches (shards permuted per epoch,
each cut into a count of batches known from the index); the ``world_size × workers`` slots of
the job take its chunks in turn, so a slot's place is one integer and any batch is located in
O(1), and slots share a shard when there are fewer shards than slots.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from melcache.batching import SUBSTREAM_ORDER, even_batch_count, make_rng
from train.config import DataConfig

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
SILVER = math.sqrt(2.0) - 1.0  # independent of GOLDEN over the rationals: a 2-D sequence
SCHEDULE_OFFSETS = 5  # purpose tag of the sequences' random starting points
WHOLE = -1  # bucket of a sub-stream that is a whole cache


@dataclasses.dataclass(frozen=True)
class SubStream:
    """One length bucket of one cache (or the whole cache), as the schedule sees it."""

    source: int  # index of the cache in the mix
    bucket: int  # length bucket, or WHOLE
    shards: tuple[int, ...]  # indices into the cache's shard list
    batches: tuple[int, ...]  # batches of each shard per epoch (the even cut)
    frames: int  # real frames in one epoch

    @property
    def per_epoch(self) -> int:
        """Batches in one epoch of the sub-stream, over all slots of the job."""
        return sum(self.batches)


def substreams(
    sources: Sequence[Sequence[Mapping[str, Any]]], data: DataConfig, sync: bool
) -> tuple[SubStream, ...]:
    """The sub-streams of a mix: one per (cache, bucket) when ``sync``, else one per cache."""
    out = []
    for source, shards in enumerate(sources):
        groups: dict[int, list[int]] = {}
        for shard_id, entry in enumerate(shards):
            groups.setdefault(entry["bucket"] if sync else WHOLE, []).append(shard_id)
        for bucket, ids in sorted(groups.items()):
            counts = [
                even_batch_count(
                    shards[i]["samples"],
                    shards[i]["max_frames"],
                    batch_frames=data.budget(shards[i]["bucket"]),
                    max_batch_size=data.max_batch_size,
                    pad_multiple=data.pad_multiple,
                )
                for i in ids
            ]
            frames = sum(shards[i]["frames"] for i in ids)
            out.append(SubStream(source, bucket, tuple(ids), tuple(counts), frames))
    return tuple(out)


def mix_weights(
    hours: Sequence[float], weights: Sequence[float] | None, temperature: float
) -> list[float]:
    """Frame shares of the caches: ``weights`` (default: each cache's hours) to the power
    ``temperature``, normalised (NeMo's temperature sampling: α < 1 lifts small caches)."""
    base = list(hours if weights is None else weights)
    powered = [w**temperature for w in base]
    total = sum(powered)
    return [w / total for w in powered]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The pure choice of a sub-stream per step (see the module docstring)."""

    groups: tuple[tuple[int, ...], ...]  # sub-stream indices drawn together (a bucket, or all)
    group_edges: tuple[float, ...]  # cumulative probabilities of the groups
    member_edges: tuple[tuple[float, ...], ...]  # cumulative, within each group
    offsets: tuple[float, float]

    def pick(self, step: int, rank: int, world_size: int) -> int:
        """Sub-stream of rank ``rank``'s batch number ``step``: the group from a sequence
        every rank shares, the member from one that runs across ranks within a step."""
        x = math.fmod(self.offsets[0] + step * GOLDEN, 1.0)
        group = _bin(self.group_edges, x)
        y = math.fmod(self.offsets[1] + (step * world_size + rank) * SILVER, 1.0)
        return self.groups[group][_bin(self.member_edges[group], y)]


def make_schedule(
    subs: Sequence[SubStream], weights: Sequence[float], *, seed: int, sync: bool
) -> Schedule:
    """The schedule of ``subs`` with cache frame shares ``weights``; ``sync`` groups them by
    bucket (drawn alike on every rank), otherwise all form one group."""
    source_frames: dict[int, int] = {}
    for sub in subs:
        source_frames[sub.source] = source_frames.get(sub.source, 0) + sub.frames
    share = [weights[s.source] * s.per_epoch / source_frames[s.source] for s in subs]
    keys = sorted({s.bucket for s in subs}) if sync else [None]
    groups = tuple(
        tuple(i for i, s in enumerate(subs) if key is None or s.bucket == key) for key in keys
    )
    mass = [sum(share[i] for i in g) for g in groups]
    rng = make_rng(seed, SCHEDULE_OFFSETS)
    return Schedule(
        groups=groups,
        group_edges=_edges(mass),
        member_edges=tuple(_edges([share[i] for i in g]) for g in groups),
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


def locate(sub: SubStream, *, seed: int, number: int) -> tuple[int, int, int]:
    """``(epoch, place in sub.shards, batch of that shard's cut)`` of batch ``number``."""
    epoch, offset = divmod(number, sub.per_epoch)
    order, ends = _epoch_layout(sub, seed, epoch)
    pos = bisect.bisect_right(ends, offset)
    return epoch, order[pos], offset - (ends[pos - 1] if pos else 0)


@functools.lru_cache(maxsize=64)
def _epoch_layout(sub: SubStream, seed: int, epoch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The epoch's order of ``sub.shards`` places, and the running batch count at the end
    of each."""
    rng = make_rng(seed, SUBSTREAM_ORDER, sub.source, sub.bucket + 1, epoch)
    order = tuple(rng.permutation(len(sub.shards)).tolist())
    return order, tuple(itertools.accumulate(sub.batches[i] for i in order))
