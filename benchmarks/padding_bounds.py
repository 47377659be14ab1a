"""How little padding any cut of a cache could reach: the loader's even cut against the least
padding of every cut of its units with the same batch counts, and of any cut of the whole cache.

    python -m benchmarks.padding_bounds [--hours 3 50 200 | --cache CACHE ...] [--extra 0 1 2]
        [--cost-slack 0 5 10] [--any-cut-hours 50] [--target 2.5]

Over one epoch of every sub-stream of a drawn cache (``benchmarks/synthetic_cache.py``; with
``--cache``, of built caches, their frames read from their tables), with the loader's own units
and counts at ``batch_frames`` 32000: the padding of the even cut the loader makes (the same
every epoch: it sorts by padded length; ``--frames-cut``: equal frames, batch plan 2, instead of
the default's equal cost), then, by dynamic programming, the least padding of any cut of each
unit into the same number of batches of consecutive lengths, (a) under the even cut's largest
padded frames ``B × T``, so no batch holds more; (a') under its largest cost ``B·T·(A + T)``
raised by each ``--cost-slack`` percent (the cost cut only), so no batch costs more than that;
(b) under the budget alone, whatever their costs; then (c) the least padding of any cut of the
whole cache (its utterances sorted, across buckets and units) into as many batches an epoch,
each within the largest budget and ``max_batch_size``: no loader of that many batches pads less
on this cache. ``--extra k`` gives every unit ``k`` batches more than the loader's count: fewer
utterances a batch. ``--target P`` adds a line: the fewest batches an epoch, from the loader's
count on, at which (c) is at most ``P`` %. Sampled windows of a few hundred steps
(``schedule_bench --parts synthetic``) weight the units as the schedule draws them; this is the
steady state. First, per cache, the same epoch as the stream of ``data.sync_buckets = false``
cuts it (each shard greedily). Prints one JSON line per cache and count.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from benchmarks.synthetic_cache import SyntheticCache, draw_cache
from melcache.access import open_cache
from melcache.batch_plans import (
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


def loader_data() -> DataConfig:
    """The loader's ``[data]`` these bounds are taken at: its defaults at ``BATCH_FRAMES``."""
    return dataclasses.replace(DataConfig(batch_frames=BATCH_FRAMES), num_workers=0)


def least_padded(
    lengths: np.ndarray,
    count: int,
    max_batch_size: int,
    cap: int,
    *,
    attention: int = 0,
    cost_cap: int = 0,
) -> int:
    """Least padded frames of a cut of ``lengths`` (padded, longest first) into ``count`` runs
    of consecutive places, each of at most ``max_batch_size`` samples and ``cap`` padded frames
    (its size × its first length; a sample over the cap alone) and, with ``cost_cap``, at most
    that cost (its size × ``T × (attention + T)``, ``T`` its first length). ``O(count × n ×
    max_batch_size)`` numpy work: an analysis, not something the loader could run per visit.
    Consecutive runs lose nothing: swapping two samples of unlike length between batches never
    lowers both batches' longest."""
    n, never = len(lengths), np.iinfo(np.int64).max // 4
    sizes = np.clip(cap // lengths, 1, max_batch_size)  # the largest run from each place
    if cost_cap:
        sizes = np.clip(np.minimum(sizes, cost_cap // (lengths * (attention + lengths))), 1, None)
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


def pct(real: int, padded: int) -> float:
    """Padding as a percentage, to two places."""
    return round(100 * padding_fraction(real, padded), 2)


def all_frames(cache: SyntheticCache) -> np.ndarray:
    """Every utterance's frames, shard after shard."""
    return np.asarray([s.frames for entry in cache.shards
                       for s in cache.samples[entry["name"]]], dtype=np.int64)  # fmt: skip


def padded_frames(batches: Sequence[Sequence[int]], frames: Sequence[int], pad: int) -> int:
    """Padded frames of ``batches`` (places into ``frames``): each ``B × round_up(longest)``."""
    return sum(len(b) * round_up(max(frames[i] for i in b), pad) for b in batches)


def unit_padded(
    frames: list[int], count: int, data: DataConfig, budget: int, attention: int,
    slacks: Sequence[int],
) -> dict[str, int]:  # fmt: skip
    """Padded frames of one unit's even cut into ``count`` batches (``even``) and of its least
    cuts (a) ``frames``, (a') ``cost+S`` for each slack ``S`` (when ``attention``: the cost
    cut) and (b) ``budget``."""
    pad, most = data.pad_multiple, data.max_batch_size
    cut = plan_even_batches(frames, rng=make_rng(0, 4), count=count, max_batch_size=most,
                            pad_multiple=pad, attention_frames=attention)  # fmt: skip
    lengths = np.sort(round_up(np.asarray(frames, dtype=np.int64), pad))[::-1]
    sized = [(len(b), round_up(max(frames[i] for i in b), pad)) for b in cut]  # (B, T)
    out = {"even": sum(size * t for size, t in sized),
           "frames": least_padded(lengths, count, most, max(size * t for size, t in sized)),
           "budget": least_padded(lengths, count, most, budget)}  # fmt: skip
    if attention:
        dearest = max(size * t * (attention + t) for size, t in sized)
        for slack in slacks:
            cap = dearest * (100 + slack) // 100
            out[f"cost+{slack}"] = least_padded(
                lengths, count, most, budget, attention=attention, cost_cap=cap
            )
    return out


def bounds(
    cache: SyntheticCache, data: DataConfig, extra: int, attention: int, slacks: Sequence[int],
    any_cut: bool,
) -> dict:  # fmt: skip
    """One epoch of ``cache``: real frames, batches, and the padding of the even cut
    (``attention``: its attention frames, 0 for equal frames) and of the least cuts (a), (a')
    at each of ``slacks``, (b) and, with ``any_cut``, (c) (None where not taken)."""
    real = batches = 0
    padded: collections.Counter[str] = collections.Counter()
    for sub in substreams([cache.shards], data, sync=True):
        for unit, count in zip(sub.units, sub.batches, strict=True):
            frames = [s.frames for i in unit for s in cache.samples[cache.shards[i]["name"]]]
            count = min(len(frames), count + extra)
            real, batches = real + sum(frames), batches + count
            padded.update(unit_padded(frames, count, data, data.budget(sub.bucket), attention,
                                      slacks))  # fmt: skip
    by_cost = {str(s): pct(real, padded[f"cost+{s}"]) for s in slacks} if attention else None
    return {"hours": round(cache.hours, 1), "extra_batches_a_unit": extra,
            "attention_frames": attention,
            "batches_per_epoch": batches, "real_frames_per_batch": round(real / batches),
            "padding_pct_even_cut": pct(real, padded["even"]),
            "least_pct_at_its_largest_batch": pct(real, padded["frames"]),
            "least_pct_at_its_largest_cost_plus_slack": by_cost,
            "least_pct_at_the_budget": pct(real, padded["budget"]),
            "least_pct_of_any_cut_of_the_cache":
                least_pct_of_any_cut(cache, data, batches) if any_cut else None}  # fmt: skip


def least_pct_of_any_cut(cache: SyntheticCache, data: DataConfig, batches: int) -> float:
    """(c): the least padding (%) of any cut of all of ``cache``'s utterances into ``batches``
    batches under the largest budget, whatever bucket or unit they are in."""
    frames = all_frames(cache)
    lengths = np.sort(round_up(frames, data.pad_multiple))[::-1]
    budget = max(data.budget(entry["bucket"]) for entry in cache.shards)
    return pct(int(frames.sum()), least_padded(lengths, batches, data.max_batch_size, budget))


def loader_batches(cache: SyntheticCache, data: DataConfig) -> int:
    """The batches an epoch of ``cache`` the loader cuts (its units' counts, from the index)."""
    return sum(sum(sub.batches) for sub in substreams([cache.shards], data, sync=True))


def fewest_batches(cache: SyntheticCache, data: DataConfig, target: float, start: int) -> dict:
    """The fewest batches an epoch from ``start`` on at which some cut of ``cache`` pads at most
    ``target`` %: ``start`` where it does already, None where not even one utterance a batch
    does. (c) never rises with the count (splitting a batch never pads more), so the count is
    doubled until it is reached, then bisected."""
    frames, found = all_frames(cache), {}

    def reaches(count: int) -> bool:
        if count not in found:
            found[count] = least_pct_of_any_cut(cache, data, count)
        return found[count] <= target

    utterances = len(frames)
    low, high = start - 1, min(start, utterances)  # not reached at low (or below start)
    while not reaches(high):
        if high == utterances:
            return {"hours": round(cache.hours, 1), "target_pct": target,
                    "fewest_batches_of_any_cut": None}  # fmt: skip
        low, high = high, min(2 * high, utterances)
    count = low + 1 + bisect.bisect_left(range(low + 1, high), True, key=reaches)
    return {"hours": round(cache.hours, 1), "target_pct": target,
            "fewest_batches_of_any_cut": count,
            "real_frames_per_batch": round(int(frames.sum()) / count),
            "least_pct_there": found[count]}  # fmt: skip


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
            "padding_pct": pct(real, padded)}  # fmt: skip


def built_cache(location: str) -> SyntheticCache:
    """A built cache as this benchmark sees it: its index entries and each shard's utterance
    frames, from its table (no shard is read; texts are left empty)."""
    with open_cache(location) as cache:
        starts, frames = cache.table.column("shard_rows").tolist(), cache.lengths.tolist()
        entries, features = tuple(cache.index["shards"]), cache.index["features"]
    samples = {
        entry["name"]: [
            RawSample(
                key=str(row),
                mel=b"",
                storage="fp16",
                text="",
                speaker=None,
                frames=frames[row],
                bucket=entry["bucket"],
                audio=None,
            )
            for row in range(starts[i], starts[i + 1])
        ]
        for i, entry in enumerate(entries)
    }
    hours = sum(frames) * features["hop_length"] / features["sample_rate"] / 3600
    return SyntheticCache(entries, samples, hours)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--hours", type=float, nargs="+", default=[3.0, 50.0, 200.0],
                       help="drawn caches of these hours (default: 3 50 200)")  # fmt: skip
    which.add_argument("--cache", nargs="+", default=[],
                       help="built caches (folders or URLs) instead of drawn ones")  # fmt: skip
    p.add_argument("--extra", type=int, nargs="*", default=[0, 1, 2],
                   help="batches a unit more than the loader cuts it into (default: 0 1 2)")  # fmt: skip
    p.add_argument("--frames-cut", action="store_true",
                   help="the equal-frames cut (batch plan 2), not the default's equal cost")  # fmt: skip
    p.add_argument(
        "--cost-slack", type=int, nargs="*", default=[0],
        help="(a'): percents above the even cut's largest cost (default: 0)",
    )  # fmt: skip
    p.add_argument(
        "--any-cut-hours", type=float, default=50.0,
        help="(c) and --target for caches of at most these hours: its dynamic programme grows "
        "with utterances x batches, 30 s at 50 h (default: 50)",
    )  # fmt: skip
    p.add_argument(
        "--target", type=float, default=None,
        help="also the fewest batches an epoch, from the loader's count, at which any cut (c) "
        "pads at most this many percent",
    )  # fmt: skip
    args = p.parse_args(argv)
    data = loader_data()
    attention = 0 if args.frames_cut else data.attention
    caches = map(built_cache, args.cache) if args.cache else map(draw_cache, args.hours)
    for cache in caches:
        any_cut = cache.hours <= args.any_cut_hours
        print(json.dumps(stream_before(cache, data)), flush=True)
        for extra in args.extra:
            row = bounds(cache, data, extra, attention, args.cost_slack, any_cut)
            print(json.dumps(row), flush=True)
        if args.target is not None and any_cut:
            start = loader_batches(cache, data)
            print(json.dumps(fewest_batches(cache, data, args.target, start)), flush=True)


if __name__ == "__main__":
    main()
