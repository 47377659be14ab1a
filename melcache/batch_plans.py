"""Pure planning for the streaming loader: which shards a worker reads, and how one shard's
samples are cut into batches.

Every function here is deterministic in its arguments. Randomness comes only from
:func:`make_rng`, keyed by ``(seed, purpose, epoch, ...)``, so a worker's place in the stream
is a few integers and resuming never has to replay anything.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

# Purpose tags keep the random streams of different decisions independent.
SHARD_ORDER = 1
BATCH_PLAN = 2
SUBSTREAM_ORDER = 3  # shard order of one length bucket of one cache (melcache/loader/schedule.py)
EVEN_PLAN = 4  # even cut of one shard into a count of batches known from the index
# Length jitter of the sort inside a shard in batch plan 1, as a fraction of the length (at
# least one frame, which only breaks ties): neighbours stay within about 1 % of each other
# while batch membership changes every epoch (static batches give a cyclic loss).
SORT_JITTER = 0.01
# The even cut (plan_even_batches): 3, near-equal cost B·T·(1 + T/A) a batch; 2, near-equal
# padded frames, sorted by padded length with ties in random order; 1, sorted by length with
# SORT_JITTER. 4 cuts as 3 and deals each epoch whole to the job's slots
# (melcache/loader/deal.py, Deal.by_epoch). Plans 1–3 are the batches of earlier
# releases, which their states resume.
BATCH_PLAN_VERSION = 4
COST_CUT_PLAN = 3  # the first plan that cuts by cost: attention frames matter from it on
# Batches of a unit of shards (even_units) hold at least this share of what fits: ranks in one
# bucket then cost within about 10 % of each other.
UNIT_FILL = 0.9


def make_rng(seed: int, *parts: int) -> np.random.Generator:
    """The one source of randomness: an independent generator for ``(seed, *parts)``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *parts])))


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is at least ``value``."""
    return -(-value // multiple) * multiple


def worker_shards(
    num_shards: int, *, seed: int, epoch: int, slot: int, num_slots: int, stream: int = 0
) -> list[int]:
    """Shard ids (indices into the index's shard list) that worker ``slot`` reads in ``epoch``.

    The shard list is permuted from ``(seed, epoch)`` and dealt round-robin to the
    ``num_slots = world_size × workers`` slots, so the slots' lists are disjoint and together
    cover every shard exactly once per epoch. ``stream`` tells the caches of a mix apart (0, the
    first, keys its order exactly as a one-cache loader always has).
    """
    if not 0 <= slot < num_slots <= num_shards:
        raise ValueError(f"slot {slot} of {num_slots} needs 0 <= slot < num_slots <= {num_shards}")
    parts = (epoch,) if stream == 0 else (epoch, stream)
    order = make_rng(seed, SHARD_ORDER, *parts).permutation(num_shards)
    return order[slot::num_slots].tolist()


def plan_batches(
    frames: Sequence[int],
    *,
    rng: np.random.Generator,
    batch_frames: int,
    max_batch_size: int,
    pad_multiple: int,
) -> list[list[int]]:
    """Cut one shard's samples (given by their frame counts) into batches of sample indices.

    A batch of ``B`` samples whose longest has ``n`` frames costs ``B × round_up(n,
    pad_multiple)`` frames, padding included; that never exceeds ``batch_frames``, and
    ``B <= max_batch_size``. Samples are sorted by length plus a small random jitter and cut
    greedily from the longest, so a batch holds near-equal lengths; the batch order is then
    shuffled. The last batch of a shard may be smaller: the budget is a maximum.
    """
    lengths = np.asarray(frames, dtype=np.float64)
    if len(lengths) and round_up(int(lengths.max()), pad_multiple) > batch_frames:
        raise ValueError(
            f"a sample of {int(lengths.max())} frames does not fit batch_frames = {batch_frames}"
        )
    jitter = rng.random(len(lengths)) * np.maximum(1.0, lengths * SORT_JITTER)
    order = np.argsort(-(lengths + jitter), kind="stable").tolist()
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        top = max(longest, int(frames[i]))
        full = len(current) == max_batch_size
        if current and (full or (len(current) + 1) * round_up(top, pad_multiple) > batch_frames):
            batches.append(current)
            current, top = [], int(frames[i])
        current.append(i)
        longest = top
    if current:
        batches.append(current)
    return [batches[j] for j in rng.permutation(len(batches)).tolist()]


def even_batch_count(
    samples: int, max_frames: int, *, batch_frames: int, max_batch_size: int, pad_multiple: int
) -> int:
    """How many batches :func:`plan_even_batches` cuts a shard into, from its index entry alone
    (``samples``, ``max_frames``): enough that each holds no more utterances of the shard's
    longest length than fit ``batch_frames``, nor more than ``max_batch_size``."""
    fit = min(max_batch_size, batch_frames // round_up(max_frames, pad_multiple))
    if fit < 1:
        raise ValueError(
            f"a sample of {max_frames} frames does not fit batch_frames = {batch_frames}"
        )
    return -(-samples // fit)


def even_units(
    samples: Sequence[int],
    max_frames: Sequence[int],
    *,
    batch_frames: int,
    max_batch_size: int,
    pad_multiple: int,
) -> list[list[int]]:
    """Group one bucket's shards (their index entries' ``samples`` and ``max_frames``) into
    *units*, read and cut into even batches together: length neighbours joined until the
    unit's batches hold at least :data:`UNIT_FILL` of what fits of its longest utterance.

    So a batch continues into the next shard instead of a small shard (a bucket's last) making
    a small batch, or a shard just over one batch making two half-full ones; ranks in one
    bucket then hold batches of about one cost. A shard of many batches fills them anyway and
    stays a unit of its own; the longest leftover joins the unit before it.
    """
    units: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: (max_frames[i], i)):
        current.append(i)
        count = sum(samples[j] for j in current)
        longest = max(max_frames[j] for j in current)
        fit = min(max_batch_size, batch_frames // round_up(longest, pad_multiple))
        batches = even_batch_count(count, longest, batch_frames=batch_frames,
                                   max_batch_size=max_batch_size, pad_multiple=pad_multiple)  # fmt: skip
        if count / batches >= UNIT_FILL * fit:
            units.append(current)
            current = []
    if current and units:
        units[-1].extend(current)
    elif current:
        units.append(current)
    return units


def sort_order(
    frames: Sequence[int], *, rng: np.random.Generator, pad_multiple: int, plan: int
) -> np.ndarray:
    """Places of the samples, longest first, as the even cut takes them.

    Plans 2 and 3: by length rounded up to ``pad_multiple``, ties in random order. A batch costs its
    longest sample's padded length, so every cut costs what an exact sort's would: the padding
    is the least the cut can reach, while the members of one padded length (a few to hundreds
    of samples) change batches every epoch. Plan 1 (:data:`SORT_JITTER`, earlier releases)
    jittered the lengths themselves, so neighbours of unlike padded lengths swapped places and
    batches padded more: 1.26 % against 1.00 % on a drawn 50 h cache at 8 ranks.
    """
    lengths = np.asarray(frames, dtype=np.float64)
    if plan == 1:
        jitter = rng.random(len(lengths)) * np.maximum(1.0, lengths * SORT_JITTER)
    else:  # a tie-breaker below 1: never past the next padded length
        lengths = -(-lengths // pad_multiple) * pad_multiple
        jitter = rng.random(len(lengths))
    return np.argsort(-(lengths + jitter), kind="stable")


def spread_copies(order: np.ndarray, rows: Sequence[int], count: int) -> np.ndarray:
    """``order`` (longest first) with the ``c`` copies of one row moved a batch apart: the
    ``j``-th to ``j`` batches' worth of places before the first, into batches of longer
    utterances, where it raises no batch's longest (only near the front, toward shorter ones).
    Equal lengths would otherwise put them side by side, an utterance of weight 5 heard five
    times in one step. It costs padding: a copy moved pads to a neighbour's longest (about a
    batch's range of lengths each). Any order keeps the budget: ``count`` is fit from the unit's longest
    (:func:`even_batch_count`), so equal runs of any order fit it, and the cut never exceeds
    those."""
    ranked = np.asarray(rows, np.int64)[order]
    places = len(ranked)
    by_row = np.argsort(ranked, kind="stable")  # places grouped by row, in order within each
    starts = np.flatnonzero(np.r_[True, ranked[by_row][1:] != ranked[by_row][:-1]])
    sizes = np.diff(np.r_[starts, places])
    if sizes.max(initial=1) == 1:
        return order
    group = np.repeat(np.arange(len(starts)), sizes)
    copy = np.arange(places) - starts[group]  # j: which copy of its row
    stride = places / count  # places a batch
    first = by_row[starts].astype(np.float64)
    shift = np.maximum(0.0, (sizes - 1) * stride - first)  # the front: room toward shorter
    keys = np.empty(places)
    keys[by_row] = (first + shift)[group] - copy * stride
    return order[np.argsort(keys, kind="stable")]


def plan_even_batches(
    frames: Sequence[int],
    *,
    rng: np.random.Generator,
    count: int,
    max_batch_size: int,
    pad_multiple: int,
    plan: int = BATCH_PLAN_VERSION,
    attention_frames: int = 0,
    rows: Sequence[int] | None = None,
) -> list[list[int]]:
    """Cut one shard's (or unit's) samples into ``count`` batches of near-equal padded frames
    (``B × round_up(longest)``), neighbours in length (:func:`sort_order` of ``plan``), in
    shuffled order: batches of shorter utterances hold more of them, so ranks cost alike.

    The cut is the least largest padded size that ``count`` runs of the sorted samples reach
    (never above equal counts', which :func:`even_batch_count` fits in the budget), so every
    batch keeps the budget and ``max_batch_size``, no batch is a small remainder, and the count
    is known before the shard is read, which is what lets workers share a shard and a schedule
    locate any batch of an epoch in O(1).

    Plan 3 (``attention_frames`` ``A`` > 0): near-equal *cost* ``B × T × (1 + T/A)`` instead,
    ``T`` the padded length (a transformer's attention costs what the rest of it does
    at ``T = A``, about 6 × its width), each batch within equal counts' padded frames: the
    batches of a unit's longer utterances then hold fewer of them, where equal frames would
    have them cost more.

    ``rows`` (``data.balance.spread``): each sample's table row, where a row may come more
    than once; its copies are then spread a batch apart (:func:`spread_copies`).
    """
    order = sort_order(frames, rng=rng, pad_multiple=pad_multiple, plan=plan)
    if rows is not None:
        order = spread_copies(order, rows, count)
    padded = -(-np.asarray(frames, dtype=np.int64)[order] // pad_multiple) * pad_multiple
    equal = [part for part in np.array_split(padded, count) if len(part)]
    if attention_frames and plan >= COST_CUT_PLAN:
        ends = _cost_balanced_ends(padded, equal, count, max_batch_size, attention_frames)
        return batches_at_ends(order, ends, count, rng)
    greedy = _GreedyRuns(padded, max_batch_size)
    # The search runs over caps in units of pad_multiple: a run's size × longest padded length
    # is a multiple of it, so the least cap that works is one too.
    top = max(len(part) * int(part.max()) for part in equal) // pad_multiple
    cap = least_true(1, top, lambda cap: len(greedy.ends(cap * pad_multiple)) <= count)
    return batches_at_ends(order, greedy.ends(cap * pad_multiple), count, rng)


def least_true(low: int, high: int, works: Callable[[int], bool]) -> int:
    """The least value in ``low..high`` for which ``works`` holds, by binary search: ``works``
    is false below some value and true from it on, and true at ``high``."""
    return low + bisect.bisect_left(range(low, high), True, key=works)


def batches_at_ends(
    order: np.ndarray, ends: list[int], count: int, rng: np.random.Generator
) -> list[list[int]]:
    """The batches of sample places ``order`` ending at ``ends`` (at most ``count``: the
    largest halved until there are ``count``, only smaller batches), in shuffled order."""
    runs = [range(start, end) for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    while len(runs) < count:
        big = max(range(len(runs)), key=lambda r: len(runs[r]))
        part = runs.pop(big)
        runs[big:big] = [part[: len(part) // 2], part[len(part) // 2 :]]
    places = order.tolist()
    batches = [places[run.start : run.stop] for run in runs]
    return [batches[j] for j in rng.permutation(count).tolist()]


def _cost_balanced_ends(
    padded: np.ndarray,
    equal: Sequence[np.ndarray],
    count: int,
    max_batch_size: int,
    attention_frames: int,
) -> list[int]:
    """Ends of the greedy runs of ``padded`` (longest first) under the least cost cap that
    ``count`` runs reach (``equal``: the cut into equal counts): a run from place ``i``
    holds at most ``max_batch_size`` samples, equal counts' largest padded frames and the
    cap's cost, ``padded[i] × (A + padded[i])`` a sample (``A`` × the cost ``T·(1 + T/A)``, in
    integers). Equal counts meet the cap at its top, so the search always ends within
    ``count``."""
    lengths = padded.astype(np.int64)
    cost = lengths * (attention_frames + lengths)
    frame_cap = max(len(part) * int(part[0]) for part in equal)  # each part's first: its longest
    most = np.clip(np.minimum(max_batch_size, frame_cap // lengths), 1, None)

    def ends(cap: int) -> list[int]:
        sizes = np.clip(np.minimum(most, cap // cost), 1, None).tolist()
        out, start = [], 0
        while start < len(sizes):
            start += sizes[start]
            out.append(min(start, len(sizes)))
        return out

    top = max(len(part) * int(part[0]) * (attention_frames + int(part[0])) for part in equal)
    return ends(least_true(1, top, lambda cap: len(ends(cap)) <= count))


class _GreedyRuns:
    """Greedy runs of consecutive places of the sorted samples whose size × longest padded
    length stays within a cap (the fewest such runs: each takes all it can), for the many caps
    the even cut's binary search tries.

    A run's cost grows with its size, so it ends at its first misfit: while its longest is the
    sample at ``j``, at ``cap // padded[j]`` samples. The longest changes only at the next
    longer sample (``longer[j]``, found once per cut); samples are sorted by length with a
    jitter, so that is rare and a run is found in a step or two of plain Python."""

    def __init__(self, padded: np.ndarray, max_batch_size: int) -> None:
        self.heads, self.max_batch_size = padded.tolist(), max_batch_size
        self.longer = [len(self.heads)] * len(self.heads)  # next place holding a longer one
        waiting: list[int] = []
        for place, length in enumerate(self.heads):
            while waiting and self.heads[waiting[-1]] < length:
                self.longer[waiting.pop()] = place
            waiting.append(place)

    def ends(self, cap: int) -> list[int]:
        """Where each run ends (exclusive), in order."""
        ends, start, count = [], 0, len(self.heads)
        while start < count:
            limit, longest = min(count, start + self.max_batch_size), start
            while True:
                end = max(longest, min(limit, start + cap // self.heads[longest]))
                if self.longer[longest] >= end:
                    break
                longest = self.longer[longest]
            start = max(end, start + 1)  # a sample over the cap is a batch of its own
            ends.append(start)
        return ends


def padding_fraction(real_frames: float, padded_frames: float) -> float:
    """Padding ÷ all frames, of one batch or many: ``padded_frames`` counts padding too."""
    return 1.0 - real_frames / padded_frames if padded_frames else 0.0
