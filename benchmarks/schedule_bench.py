"""Ranks in step: how much of a DDP step's compute the ranks would waste waiting, sync on vs off.

    python -m benchmarks.schedule_bench [--hours 3] [--data /tmp/melcache-schedule] [--steps 120]

Makes (or reuses) an espeak-ng corpus with ``benchmarks.speech`` and its cache with the real
``preprocess build`` (default build config: 10 length buckets, ~35 utterances a shard), then:

1. ``loader``: 8 real loaders in this process (rank r of 8, one logical worker each,
   ``batch_frames`` 32000), ``--steps`` steps each, with ``data.sync_buckets`` true and false
   (false is the stream of the previous release). Per step: whether all ranks' batches are
   of one bucket, and the FLOP-model cost of each rank's batch; efficiency = Σ mean ÷ Σ max
   over ranks (the share of the step's GPU time the ranks would not spend waiting).
2. ``plans``: the same from the loader's own readers without decoding a mel (shards read,
   batches planned, costs from the planned utterances' lengths), at 8, 64 and 512 ranks: sync
   on; "unsynced" (the same bucket sub-streams, each rank drawing its bucket by itself, which is
   what the previous release's stream amounts to); and the previous release's stream itself
   where the cache has enough shards for it.
3. ``throughput``: loader samples/s, sync on vs off, in alternating turns (a change in the
   machine's load falls on both alike).

The FLOP model is ``configs/base.toml``'s transformer (d 512, 12 layers, a prefix LM over
text + mel): per utterance slot ``24·d²·S + 4·d·S²`` with ``S`` = padded text + mel length.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.speech import make_corpus
from melcache.batching import round_up
from melcache.reader import RawSample
from train.collate import utf8_tokens
from train.data import DataConfig, StreamLoader, make_loader
from train.schedule import make_schedule
from train.stream import planned_stream

DIM = 512  # configs/base.toml
BATCH_FRAMES = 32_000


def step_cost(mel_frames: int, text_tokens: int, batch: int) -> float:
    """FLOP model of one forward of ``batch`` slots of padded length ``mel + text``."""
    length = mel_frames + text_tokens
    return batch * (24 * DIM * DIM * length + 4 * DIM * length * length)


def efficiency(costs: Sequence[Sequence[float]]) -> float:
    """Σ over steps of the ranks' mean cost ÷ Σ of their max: the GPU time not spent waiting."""
    return sum(sum(c) / len(c) for c in costs) / sum(max(c) for c in costs)


def summary(name: str, ranks: int, buckets: list[list[int]], costs: list[list[float]]) -> dict:
    """One JSON-able line: share of steps in one bucket and the efficiency."""
    same = sum(len(set(b)) == 1 for b in buckets) / len(buckets)
    return {"measure": name, "ranks": ranks, "steps": len(buckets),
            "one_bucket_share": round(same, 3), "efficiency": round(efficiency(costs), 3)}  # fmt: skip


def measure_loaders(cache: Path, data: DataConfig, ranks: int, steps: int) -> dict:
    """Part 1: real loaders, rank r of ``ranks``, batches decoded."""
    streams = [iter(make_loader(cache, data, rank=r, world_size=ranks)) for r in range(ranks)]
    buckets, costs = [], []
    for _ in range(steps):
        batches = [next(s) for s in streams]
        buckets.append([b.bucket for b in batches])
        costs.append([step_cost(b.mel.shape[1], b.text.shape[1], len(b)) for b in batches])
    for stream in streams:
        stream.close()
    return summary(f"loader sync_buckets={data.sync_buckets}", ranks, buckets, costs)


def planned(loader: StreamLoader, unsynced: bool) -> Iterator[tuple[int, list[RawSample]]]:
    """One rank's batches (bucket, samples) from the loader's readers, no mel decoded."""
    spec = loader.spec
    if unsynced:  # the same sub-streams, each rank choosing among all of them by itself
        schedule = make_schedule(spec.subs, loader.weights, seed=spec.seed, sync=False)
        spec = dataclasses.replace(spec, schedule=schedule)
    for _, _, samples, _, entries in planned_stream(spec, 0):
        yield entries[0]["bucket"], samples


def measure_plans(cache: Path, data: DataConfig, ranks: int, steps: int, how: str) -> dict:
    """Part 2: the same from plans, at any number of ranks: one rank's plan after the other
    (ranks plan independently), so only one rank's shards are open at a time."""
    sync = how != "previous"
    options = dataclasses.replace(data, sync_buckets=sync, num_workers=0)
    per_rank = []
    for r in range(ranks):
        stream = planned(make_loader(cache, options, rank=r, world_size=ranks), how == "unsynced")
        batches = [next(stream) for _ in range(steps)]
        per_rank.append([(b, cost_of(samples, data.pad_multiple)) for b, samples in batches])
        stream.close()
    steps_of = list(zip(*per_rank, strict=True))
    buckets = [[b for b, _ in step] for step in steps_of]
    costs = [[c for _, c in step] for step in steps_of]
    return summary(f"plans {how}", ranks, buckets, costs)


def cost_of(samples: list[RawSample], pad_multiple: int) -> float:
    mel = round_up(max(s.frames for s in samples), pad_multiple)
    text = round_up(max(len(utf8_tokens(s.text)) for s in samples), pad_multiple)
    return step_cost(mel, text, len(samples))


def measure_throughput(cache: Path, data: DataConfig, seconds: float, rounds: int) -> list[dict]:
    """Part 3: samples/s of one loader per setting, in alternating turns."""
    settings = {sync: make_loader(cache, dataclasses.replace(data, sync_buckets=sync))
                for sync in (False, True)}  # fmt: skip
    streams = {sync: iter(loader) for sync, loader in settings.items()}
    for stream in streams.values():
        next(stream)  # workers started
    counts = {sync: [0, 0.0] for sync in settings}
    for turn in range(2 * rounds):
        sync = bool(turn % 2) ^ bool(turn // 2 % 2)  # off, on, on, off, ...
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            counts[sync][0] += len(next(streams[sync]))
        counts[sync][1] += time.perf_counter() - start
    for stream in streams.values():
        stream.close()
    return [{"measure": f"throughput sync_buckets={sync}", "samples_per_s": round(n / t, 1)}
            for sync, (n, t) in counts.items()]  # fmt: skip


def ensure_cache(root: Path, hours: float) -> Path:
    """The corpus and its cache, made once and reused."""
    corpus, cache = make_corpus(root / "corpus", hours), root / "cache"
    if not (cache / "index.json").exists():
        build = [sys.executable, "-m", "preprocess", "build", "--src", str(corpus)]
        subprocess.run([*build, "--out", str(cache)], check=True)
    return cache


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hours", type=float, default=3.0)
    p.add_argument("--data", type=Path, default=Path("/tmp/melcache-schedule"))
    p.add_argument("--cache", type=Path, help="an existing cache instead of --hours/--data")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 512])
    p.add_argument("--turn-seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    cache = args.cache or ensure_cache(args.data, args.hours)
    data = DataConfig(batch_frames=BATCH_FRAMES, num_workers=0, shard_check="off")
    for sync in (True, False):
        print(json.dumps(measure_loaders(cache, dataclasses.replace(data, sync_buckets=sync), 8,
                                         args.steps)), flush=True)  # fmt: skip
    shards = len(json.loads((cache / "index.json").read_text())["shards"])
    for ranks in args.ranks:
        for how in ("on", "unsynced", "previous"):
            if how == "previous" and ranks > shards:
                print(json.dumps({"measure": "plans previous", "ranks": ranks,
                                  "refused": f"{shards} shards < {ranks} workers"}))  # fmt: skip
                continue
            print(json.dumps(measure_plans(cache, data, ranks, args.steps, how)), flush=True)
    loader_data = dataclasses.replace(data, num_workers=2, shard_check="fast")
    for line in measure_throughput(cache, loader_data, args.turn_seconds, args.rounds):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
