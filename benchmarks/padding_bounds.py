"""How little padding any cut of a cache's units could reach: the loader's even cut against the
least padding of every cut with the same batch counts.

    python -m benchmarks.padding_bounds [--hours 3 50 200 | --cache CACHE ...] [--extra 0 1 2]
        [--any-cut-hours 50] [--target 2.5]

Over one epoch of every sub-stream of a drawn cache (``benchmarks/synthetic_cache.py``; with
``--cache``, of built caches, their frames read from their tables), with the loader's own units
and counts at ``batch_frames`` 32000: the padding of the even cut the loader makes (the same
every epoch: it sorts by padded length; ``--frames-cut``: equal frames, batch plan 2, instead of
the default's equal cost), then, by dynamic programming, the least padding of any cut into the
same number of batches of consecutive lengths, (a) under the even cut's own largest batch, so
batches keep their near-equal cost, and (b) under the budget alone, whatever their costs; then
(c) the least padding of any cut of the whole cache (its utterances sorted, across buckets and
units) into as many batches under the budget: no loader whose batches hold that many frames pads
less on this cache. ``--extra k`` gives every unit ``k`` batches more than the loader's count:
fewer utterances a batch; ``--target P``, the fewest batches an epoch at which any cut (c) pads
at most ``P`` %. Sampled windows of a few hundred steps (``schedule_bench --parts synthetic``)
weight the units as the schedule draws them; this is the steady state. First, per cache, the
same epoch as the stream of ``data.sync_buckets = false`` cuts it (each shard greedily). Prints
one JSON line per cache and count.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from benchmarks.synthetic_cache import SyntheticCache, draw_cache
from melcache.access import open_cache
from melcache.loader.batching import (
    make_rng,
    padding_fraction,
    plan_batches,
    plan_even_batches,
    round_up,
)
from melcache.loader.data_config import DataConfig
from melcache.loader.schedule import substreams
from melcache.reader import RawSample

BATCH_FRAMES = 32_000


def least_padded(lengths: np.ndarray, count: int, max_batch_size: int, cap: int) -> int:
    """Least padded frames of a cut of ``lengths`` (padded, longest first) into ``count`` runs
    of consecutive places, each of at most ``max_batch_size`` samples and ``cap`` padded frames
    (its size × its first length; a sample over the cap alone). ``O(count × n ×
    max_batch_size)`` numpy work: an analysis, not something the loader could run per visit.
    Consecutive runs lose nothing: swapping two samples of unlike length between batches never
    lowers both batches' longest."""
    n, never = len(lengths), np.iinfo(np.int64).max // 4
    sizes = np.clip(cap // lengths, 1, max_batch_size)  # the largest run from each place
    best = np.full(n + 1, never, dtype=np.int64)
    best[0] = 0
    for _ in range(count):
        after = np.full(n + 1, never, dtype=np.int64)
        for size in range(1, max_batch_size + 1):
            start = np.arange(n + 1 - size)
            fits = (sizes[start] >= size) & (best[start] < never)
            cost = np.where(fits, best[start] + size * lengths[start], never)
            np.minimum(after[size:], cost, out=after[size:])
        best = after
    return int(best[n])


def padded_frames(batches: Sequence[Sequence[int]], frames: Sequence[int], pad: int) -> int:
    """Padded frames of ``batches`` (places into ``frames``): each ``B × round_up(longest)``."""
    return sum(len(b) * round_up(max(frames[i] for i in b), pad) for b in batches)


def least_pct_of_any_cut(cache: SyntheticCache, data: DataConfig, batches: int) -> float:
    """(c): the least padding (%) of any cut of all of ``cache``'s utterances into ``batches``
    batches under the largest budget, whatever bucket or unit they are in."""
    frames = np.asarray([s.frames for entry in cache.shards
                         for s in cache.samples[entry["name"]]], dtype=np.int64)  # fmt: skip
    lengths = np.sort(round_up(frames, data.pad_multiple))[::-1]
    budget = max(data.budget(entry["bucket"]) for entry in cache.shards)
    padded = least_padded(lengths, batches, data.max_batch_size, budget)
    return round(100 * padding_fraction(int(frames.sum()), padded), 2)


def fewest_batches(cache: SyntheticCache, data: DataConfig, target: float, start: int) -> dict:
    """The fewest batches an epoch, from ``start`` on, at which some cut of ``cache`` pads at
    most ``target`` %: (c) falls as the count grows (splitting a batch never pads more)."""

    def reaches(count: int) -> bool:
        return least_pct_of_any_cut(cache, data, count) <= target

    utterances = sum(len(samples) for samples in cache.samples.values())
    count = start + bisect.bisect_left(range(start, utterances), True, key=reaches)
    real = sum(s.frames for samples in cache.samples.values() for s in samples)
    return {"hours": round(cache.hours, 1), "target_pct": target,
            "fewest_batches_of_any_cut": count, "real_frames_per_batch": round(real / count),
            "least_pct_there": least_pct_of_any_cut(cache, data, count)}  # fmt: skip


def bounds(
    cache: SyntheticCache, data: DataConfig, extra: int, attention: int, any_cut: bool
) -> dict:
    """One epoch of ``cache``: real frames, batches, and padded frames of the even
    cut (``attention``: its attention frames, 0 for equal frames) and of the least cuts (a),
    (b) and, with ``any_cut``, (c), as padding percentages (None where not asked)."""
    real = batches = even = tight = loose = 0
    pad = data.pad_multiple
    subs = substreams([cache.shards], data, sync=True)
    for sub in subs:
        for unit, count in zip(sub.units, sub.batches, strict=True):
            frames = [s.frames for i in unit for s in cache.samples[cache.shards[i]["name"]]]
            count = min(len(frames), count + extra)
            cut = plan_even_batches(frames, rng=make_rng(0, 4), count=count,
                                    max_batch_size=data.max_batch_size, pad_multiple=pad,
                                    attention_frames=attention)  # fmt: skip
            largest = max(padded_frames([b], frames, pad) for b in cut)
            lengths = np.sort(round_up(np.asarray(frames, dtype=np.int64), pad))[::-1]
            real, batches = real + sum(frames), batches + count
            even += padded_frames(cut, frames, pad)
            tight += least_padded(lengths, count, data.max_batch_size, largest)
            loose += least_padded(lengths, count, data.max_batch_size, data.budget(sub.bucket))

    def pct(padded: int) -> float:
        return round(100 * padding_fraction(real, padded), 2)

    anywhere = least_pct_of_any_cut(cache, data, batches) if any_cut else None

    return {"hours": round(cache.hours, 1), "extra_batches_a_unit": extra,
            "attention_frames": attention,
            "batches_per_epoch": batches, "real_frames_per_batch": round(real / batches),
            "padding_pct_even_cut": pct(even), "least_pct_at_its_largest_batch": pct(tight),
            "least_pct_at_the_budget": pct(loose),
            "least_pct_of_any_cut_of_the_cache": anywhere}  # fmt: skip


def stream_before(cache: SyntheticCache, data: DataConfig) -> dict:
    """The same epoch as ``data.sync_buckets = false`` streams it: each shard cut greedily."""
    real = padded = batches = 0
    pad = data.pad_multiple
    for number, entry in enumerate(cache.shards):
        frames = [s.frames for s in cache.samples[entry["name"]]]
        cut = plan_batches(frames, rng=make_rng(0, 2, 0, number), batch_frames=data.budget(
            entry["bucket"]), max_batch_size=data.max_batch_size, pad_multiple=pad)  # fmt: skip
        real, batches = real + sum(frames), batches + len(cut)
        padded += padded_frames(cut, frames, pad)
    return {"hours": round(cache.hours, 1), "stream": "sync_buckets = false",
            "batches_per_epoch": batches, "real_frames_per_batch": round(real / batches),
            "padding_pct": round(100 * padding_fraction(real, padded), 2)}  # fmt: skip


def built_cache(location: str) -> SyntheticCache:
    """A built cache as this benchmark sees it: its index entries and each shard's utterance
    frames, from its table (no shard is read; texts are left empty)."""
    with open_cache(location) as cache:
        starts, frames = cache.table.column("shard_rows").tolist(), cache.lengths.tolist()
        entries, features = tuple(cache.index["shards"]), cache.index["features"]
    samples = {
        entry["name"]: [RawSample(str(row), b"", "fp16", "", None, frames[row], entry["bucket"],
                                  None) for row in range(starts[i], starts[i + 1])]
        for i, entry in enumerate(entries)
    }  # fmt: skip
    hours = sum(frames) * features["hop_length"] / features["sample_rate"] / 3600
    return SyntheticCache(entries, samples, hours)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hours", type=float, nargs="*", default=[3.0, 50.0, 200.0],
                   help="drawn caches of these hours (default: 3 50 200)")  # fmt: skip
    p.add_argument("--cache", nargs="*", default=[],
                   help="built caches (folders or URLs) instead of drawn ones")  # fmt: skip
    p.add_argument("--extra", type=int, nargs="*", default=[0, 1, 2],
                   help="batches a unit more than the loader cuts it into (default: 0 1 2)")  # fmt: skip
    p.add_argument("--frames-cut", action="store_true",
                   help="the equal-frames cut (batch plan 2), not the default's equal cost")  # fmt: skip
    p.add_argument("--any-cut-hours", type=float, default=50.0,
                   help="(c) for caches of at most these hours: its dynamic programme grows "
                        "with utterances x batches, 30 s at 50 h (default: 50)")  # fmt: skip
    p.add_argument("--target", type=float, default=None,
                   help="also the fewest batches an epoch at which any cut pads at most this "
                        "many percent (c, searched from the loader's count)")  # fmt: skip
    args = p.parse_args(argv)
    data = dataclasses.replace(DataConfig(batch_frames=BATCH_FRAMES), num_workers=0)
    attention = 0 if args.frames_cut else data.attention
    caches = map(built_cache, args.cache) if args.cache else map(draw_cache, args.hours)
    for cache in caches:
        hours = cache.hours
        print(json.dumps(stream_before(cache, data)), flush=True)
        rows = []
        for extra in args.extra:
            rows.append(bounds(cache, data, extra, attention, hours <= args.any_cut_hours))
            print(json.dumps(rows[-1]), flush=True)
        if args.target is not None and rows:
            start = min(row["batches_per_epoch"] for row in rows)
            print(json.dumps(fewest_batches(cache, data, args.target, start)), flush=True)


if __name__ == "__main__":
    main()
