"""A real-sized cache as the loader's planner sees it, drawn without building audio.

A 50 h or 200 h cache takes hours to synthesise and build here; the schedule, the units, the
even cut and the FLOP model need only each utterance's frames and text length. So a table of
utterances is drawn (durations 0.8–32 s, log-normal around 3.75 s, texts at the characters per
second of ``benchmarks.common.speech``'s espeak-ng pool), bucketed and cut into shards by the build's
own planner (``preprocess.plan.shard_plan``: default buckets, 128 MB shards at fp16 storage), and
the loader's real planning code runs over index entries made from it, with
``melcache.loader.reads.shards.read_shard`` answering from the table (empty mels: nothing decodes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import numpy as np

import melcache.loader.reads.shards as shard_reads
from benchmarks.common.sentences import plan_pool
from melcache.batch_plans import BATCH_PLAN_VERSION
from melcache.features import FeatureConfig
from melcache.loader.batch import utf8_tokens
from melcache.loader.data_config import DataConfig
from melcache.loader.schedule import make_schedule, substreams
from melcache.loader.spec import MixCache, StreamSpec
from melcache.reader import RawSample
from melcache.storage import BYTES_PER_VALUE
from preprocess.config import BuildConfig
from preprocess.plan.shard_plan import SAMPLE_OVERHEAD_BYTES, _buckets, _cut_shards

# A mean of 4.8 s: 37,500 utterances in 50 h, as the cache.
MIN_SECONDS, MAX_SECONDS, MEDIAN_SECONDS, SIGMA = 0.8, 32.0, 3.75, 0.7
LOCATION = "synthetic://cache"


@dataclasses.dataclass(frozen=True)
class SyntheticCache:
    """Index entries of a drawn cache, and each shard's samples as the reader would give."""

    shards: tuple[dict, ...]
    samples: dict[str, list[RawSample]]
    hours: float


def chars_per_second() -> float:
    """Characters per second of speech in the espeak-ng pool (its own duration model)."""
    lines = plan_pool(0)
    seconds = [0.85 * len(line.text.split()) * 60 / line.speed + 0.3 for line in lines]
    return sum(len(line.text) for line in lines) / sum(seconds)


def draw_seconds(hours: float, seed: int = 0) -> np.ndarray:
    """Utterance durations (s) of a drawn cache of about ``hours``: log-normal, 0.8–32 s."""
    rng = np.random.default_rng([seed, 39])
    count = math.ceil(hours * 3600 / (MEDIAN_SECONDS * math.exp(SIGMA**2 / 2)))
    return np.clip(rng.lognormal(math.log(MEDIAN_SECONDS), SIGMA, count), MIN_SECONDS,
                   MAX_SECONDS)  # fmt: skip


def draw_cache(hours: float, seed: int = 0) -> SyntheticCache:
    """``hours`` of utterances cut into shards as the default build cuts them."""
    features, config = FeatureConfig(), BuildConfig(min_seconds=0.5, max_seconds=MAX_SECONDS)
    seconds = draw_seconds(hours, seed)
    frames = np.sort([features.num_frames(round(s * features.sample_rate)) for s in seconds])
    per_frame = features.n_mels * BYTES_PER_VALUE[config.storage]
    estimate = (frames * per_frame).astype(np.int64) + SAMPLE_OVERHEAD_BYTES
    buckets = _buckets(frames, features, config)
    rate = chars_per_second() * features.hop_length / features.sample_rate  # chars per frame
    shards, samples = [], {}
    for number, (bucket, start, stop) in enumerate(_cut_shards(frames, estimate, buckets, config)):
        name = f"shard-{number:06d}.tar"
        held = [int(f) for f in frames[start:stop]]
        samples[name] = [
            RawSample(f"{name}/{i}", b"", "fp16", "a" * max(1, round(f * rate)), None, f,
                      int(bucket), None)
            for i, f in enumerate(held)
        ]  # fmt: skip
        shards.append({"name": name, "bucket": int(bucket), "samples": len(held),
                       "frames": sum(held), "min_frames": held[0], "max_frames": held[-1]})  # fmt: skip
    total = float(frames.sum()) * features.hop_length / features.sample_rate / 3600
    return SyntheticCache(tuple(shards), samples, total)


def synthetic_spec(
    cache: SyntheticCache,
    data: DataConfig,
    *,
    rank: int,
    world_size: int,
    seed: int = 0,
    plan: int = BATCH_PLAN_VERSION,
) -> StreamSpec:
    """The spec ``make_loader`` would give rank ``rank`` of ``world_size`` over the cache
    (``plan``: the even cut's sort, ``melcache.batch_plans.sort_order``)."""
    sources = (MixCache(LOCATION, cache.shards),)
    subs = substreams([cache.shards], data, data.sync_buckets)
    schedule = make_schedule(subs, [1.0], seed=seed, sync=data.sync_buckets)
    return StreamSpec(sources=sources, subs=subs, schedule=schedule, data=data, rank=rank,
                      world_size=world_size, seed=seed, n_mels=FeatureConfig().n_mels,
                      pad_value=0.0, tokenizer=utf8_tokens, plan=plan)  # fmt: skip


@contextlib.contextmanager
def reading(cache: SyntheticCache) -> Iterator[None]:
    """Within it the loader's shard reads answer from ``cache``'s table."""
    real = shard_reads.read_shard
    shard_reads.read_shard = lambda location, entry, *_: cache.samples[entry["name"]]
    try:
        yield
    finally:
        shard_reads.read_shard = real
