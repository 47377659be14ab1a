"""Resumes on another job size and worker count, on a real 3 h cache at the default batch
settings: which keys repeat before their sub-stream's epoch is whole.

    python -m benchmarks.elastic_repeats [--data /tmp/melcache-schedule] [--mix DIR]

``tests/test_elastic.py`` checks #39's acceptance on the small sample caches; this measures
it where sub-streams hold hundreds of keys (the espeak-ng 3 h cache of
``benchmarks.schedule_bench``, made once under ``--data``; ``--cache``: another; ``--mix``: a
second cache, 0.6 / 0.4 with the first). Keys are grouped by the sub-stream that holds them
(one length range of one bucket of one cache, from the cache's table). Prints one JSON line
per job change:

- ``4x0 -> Wx0`` (W = 3, 2, 1, 8): a job of 4 one-process ranks streams ``--steps`` steps,
  then its states resume a job of W ranks for as many batches. ``early_repeats``: keys read
  again, over both jobs, before every key of their sub-stream had been read since the last
  time all had, against the old job run on uninterrupted as long; ``afresh``: the same for
  a new job of W ranks started from nothing after the old one (what dropping the loader
  state repeats), which shows the count can be non-zero.
- ``4x2 -> Wx1`` (W = 2, 8): the same from a job of 4 ranks × 2 workers. Its workers serve
  alternate steps and read a sub-stream at their own pace, so even an uninterrupted 4 × 2 job
  repeats keys within an epoch's worth of a sub-stream: ``window_repeats`` is the share of
  samples, over every window of one epoch's worth of a sub-stream's samples, whose key an
  earlier sample of the window has (over all sub-streams' windows, each weighted by its
  samples), for the resumed jobs and the uninterrupted one.

Every row also says whether every step held one bucket on all ranks.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.schedule_bench import ensure_cache
from melcache.access import open_cache
from melcache.loader import Batch, DataConfig, make_loader
from melcache.loader.stream_loader import StreamLoader


@dataclasses.dataclass(frozen=True)
class Read:
    """What the checks need of one batch (not its mels: a long job's would fill memory)."""

    source: str
    bucket: int
    keys: tuple[str, ...]


Steps = list[list[Read]]
CacheArg = str | Mapping[str, float]
BATCH_FRAMES = 32_000  # the budget of #39's measures (schedule_bench's)


def run_job(
    cache: CacheArg, world_size: int, workers: int, steps: int, states: list | None = None
) -> tuple[Steps, list[dict], StreamLoader]:
    """``steps`` steps of a job of in-process ranks (every rank's batch of each), its ranks'
    states after, and its rank 0 (closed)."""

    def read(batch: Batch) -> Read:
        return Read(batch.source, batch.bucket, tuple(batch.keys))

    data = DataConfig(batch_frames=BATCH_FRAMES, num_workers=workers)
    loaders = [make_loader(cache, data, rank=r, world_size=world_size, seed=1)
               for r in range(world_size)]  # fmt: skip
    for loader in loaders if states is not None else ():
        loader.load_state_dict(states)
    streams = [iter(loader) for loader in loaders]
    out = [[read(next(stream)) for stream in streams] for _ in range(steps)]
    saved = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    return out, saved, loaders[0]


def substream_of_keys(loader: StreamLoader) -> dict[tuple[str, str], int]:
    """``(cache location, key)`` → the loader's sub-stream holding it, from each cache's table."""
    of_shard: dict[tuple[int, int], int] = {}
    for u, sub in enumerate(loader.spec.subs):
        of_shard.update({(sub.source, i): u for unit in sub.units for i in unit})
    out = {}
    for s, source in enumerate(loader.spec.sources):
        with open_cache(source.location) as cache:
            starts, keys = cache.table.column("shard_rows"), cache.keys()
        for shard in range(len(source.shards)):
            for row in range(int(starts[shard]), int(starts[shard + 1])):
                out[(source.location, keys[row])] = of_shard[(s, shard)]
    return out


def keys_by_substream(steps: Steps, of: Mapping[tuple[str, str], int]) -> dict[int, list[str]]:
    """Each sub-stream's keys in the order the job read them (step by step, rank by rank)."""
    out: dict[int, list[str]] = collections.defaultdict(list)
    for step in steps:
        for batch in step:
            for key in batch.keys:
                out[of[(batch.source, key)]].append(key)
    return out


def early_repeats(steps: Steps, of: Mapping[tuple[str, str], int], size: Mapping[int, int]) -> int:
    """Keys read again before every key of their sub-stream (``size``: its keys) had been read
    since the last time all had, over all sub-streams."""
    count = 0
    for sub, keys in keys_by_substream(steps, of).items():
        seen: set[str] = set()
        for key in keys:
            count += key in seen
            seen.add(key)
            if len(seen) == size[sub]:
                seen = set()
    return count


def window_repeats(
    steps: Steps, of: Mapping[tuple[str, str], int], size: Mapping[int, int]
) -> float:
    """The share of samples, over every window of one epoch's worth (``size``) of a
    sub-stream's samples, whose key an earlier sample of the window has, over the windows of
    every sub-stream read for at least one, each weighted by its samples. A sliding count,
    ``O(samples)``."""
    repeated = windows = 0
    for sub, keys in keys_by_substream(steps, of).items():
        width = size[sub]
        held: collections.Counter[str] = collections.Counter(keys[:width])
        for start in range(len(keys) - width + 1):
            if start:
                gone, came = keys[start - 1], keys[start + width - 1]
                held[gone] -= 1
                if not held[gone]:
                    del held[gone]
                held[came] += 1
            repeated, windows = repeated + width - len(held), windows + width
    return round(repeated / windows, 4) if windows else 0.0


def in_one_bucket(steps: Steps) -> bool:
    """Whether every step's batches are of one bucket on all ranks."""
    return all(len({batch.bucket for batch in step}) == 1 for step in steps)


def one_process_ranks(cache: CacheArg, steps: int) -> list[dict]:
    """4 one-process ranks, resumed on 3, 2, 1 and 8: early repeats, against starting afresh."""
    before, states, loader = run_job(cache, 4, 0, steps)
    of = substream_of_keys(loader)
    size = collections.Counter(of.values())
    uninterrupted = early_repeats(run_job(cache, 4, 0, 2 * steps)[0], of, size)
    rows = []
    for world in (3, 2, 1, 8):
        after, _, resumed = run_job(cache, world, 0, steps * 4 // world, states)
        afresh = run_job(cache, world, 0, steps * 4 // world)[0]
        rows.append({"resume": f"4x0 -> {world}x0", "batches_before": 4 * steps,
                     "batches_after": sum(map(len, after)), "sub_streams": len(size),
                     "early_repeats": early_repeats(before + after, of, size),
                     "uninterrupted_4x0_early_repeats": uninterrupted,
                     "afresh_early_repeats": early_repeats(before + afresh, of, size),
                     "one_bucket_every_step": in_one_bucket(before + after),
                     "changes": list(resumed.resume_changes)})  # fmt: skip
    return rows


def worker_jobs(cache: CacheArg, steps: int) -> list[dict]:
    """4 ranks × 2 workers, resumed on 2 × 1 and 8 × 1: window repeats, against the same job
    uninterrupted for as many steps."""
    before, states, loader = run_job(cache, 4, 2, steps)
    of = substream_of_keys(loader)
    size = collections.Counter(of.values())
    uninterrupted = run_job(cache, 4, 2, 2 * steps)[0]
    rows = []
    for world in (2, 8):
        after, _, resumed = run_job(cache, world, 1, steps * 4 // world, states)
        rows.append({"resume": f"4x2 -> {world}x1", "batches_before": 4 * steps,
                     "batches_after": sum(map(len, after)),
                     "window_repeats": window_repeats(before + after, of, size),
                     "uninterrupted_4x2_window_repeats": window_repeats(uninterrupted, of, size),
                     "one_bucket_every_step": in_one_bucket(before + after),
                     "changes": list(resumed.resume_changes)})  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path("/tmp/melcache-schedule"),
                   help="folder of the espeak-ng 3 h corpus and its cache, made once and reused")  # fmt: skip
    p.add_argument("--cache", type=Path, help="an existing cache instead of --data's")
    p.add_argument("--mix", type=Path, help="a second cache: also a 0.6 / 0.4 mix with it")
    p.add_argument("--steps", type=int, default=61,
                   help="steps of the old job (default: 61, a prime: mid-epoch in most sub-streams)")  # fmt: skip
    args = p.parse_args(argv)
    cache = str(args.cache or ensure_cache(args.data, 3.0))
    caches: list[tuple[str, CacheArg]] = [("one cache", cache)]
    if args.mix:
        caches.append(("mix 0.6 / 0.4", {cache: 0.6, str(args.mix): 0.4}))
    for name, arg in caches:
        for row in one_process_ranks(arg, args.steps) + worker_jobs(arg, args.steps):
            print(json.dumps({"caches": name, **row}), flush=True)


if __name__ == "__main__":
    main()
