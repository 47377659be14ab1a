"""The build plan: length buckets and the exact contents of every shard, fixed before decoding.

Lengths come from audio headers or the manifest (the decoder pads or trims to them within
one hop), so bucketing, shard boundaries and file names depend only on the corpus and the
config. That is what makes a killed build resumable shard by shard, and what lets
``--part K/N`` machines build disjoint shards of one cache. The plan is made from the
merged scans with numpy, a few arrays of 8 bytes per utterance, and saved beside them, so
every part and every rerun uses the same one without making it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from melcache.bounded import read_json
from melcache.features import FeatureConfig
from melcache.format import FORMAT_VERSION, shard_name, temp_path
from melcache.storage import BYTES_PER_VALUE
from preprocess.config import BuildConfig
from preprocess.inputs.records import Rejection, key_base, key_digest
from preprocess.plan.scan import Scan

# Per-sample bytes besides the mel: three 512-byte tar headers, npy header, json.
SAMPLE_OVERHEAD_BYTES = 2048
_ARRAYS = ("members", "shards", "suffix_ordinals", "suffix_numbers", "rejected")


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A length bucket; ``min_frames`` and ``max_frames`` are inclusive."""

    bucket: int
    min_frames: int
    max_frames: int
    min_seconds: float
    max_seconds: float


@dataclasses.dataclass(frozen=True, slots=True)  # one per utterance of a shard being written
class PlannedUtterance:
    """What the writer needs of one utterance: its key, source, where its transcript is, its
    length at the target rate, the hash of its text the scan saw, and in a tar where its audio
    is."""

    key: str
    source: str
    locator: int
    samples: int
    content: int
    audio_at: int = -1  # in a tar: where the audio member's bytes start


@dataclasses.dataclass(frozen=True)
class PlannedShard:
    """One shard to write: its name, bucket and utterances in on-disk order."""

    name: str
    bucket: int
    number: int
    items: tuple[PlannedUtterance, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the build will write. ``shards`` is ``[bucket, start, stop]`` per shard
    (its number is its row) over ``members``, the ordinals of the utterances in on-disk order;
    keys that share a base get the suffix ``_N`` (``suffix_numbers``) by ordinal; ``rejected``
    are the ordinals refused by their length alone."""

    buckets: tuple[Bucket, ...]
    members: np.ndarray
    shards: np.ndarray
    suffix_ordinals: np.ndarray
    suffix_numbers: np.ndarray
    rejected: np.ndarray
    digest: str
    seconds: float
    estimated_bytes: int

    def __len__(self) -> int:
        return len(self.shards)

    def name(self, number: int) -> str:
        """File name of shard ``number``."""
        return shard_name(int(self.shards[number, 0]), number)

    def bucket(self, number: int) -> int:
        """Length bucket of shard ``number``."""
        return int(self.shards[number, 0])

    def shard_members(self, number: int) -> np.ndarray:
        """Ordinals of shard ``number``'s utterances, in on-disk order."""
        _, start, stop = self.shards[number]
        return self.members[start:stop]

    def key_suffix(self, ordinal: int) -> int:
        """The ``_N`` of an utterance whose key base another one has, else 0."""
        place = int(np.searchsorted(self.suffix_ordinals, ordinal))
        found = place < len(self.suffix_ordinals) and self.suffix_ordinals[place] == ordinal
        return int(self.suffix_numbers[place]) if found else 0


def planned_shard(plan: Plan, scan: Scan, number: int) -> PlannedShard:
    """Shard ``number`` with what its writer needs of each utterance, from the scans."""
    items = []
    for ordinal in plan.shard_members(number).tolist():
        part, local = scan.locate(ordinal)
        source, suffix = part.source(local), plan.key_suffix(ordinal)
        columns = part.columns
        items.append(
            PlannedUtterance(
                key_base(source) + (f"_{suffix}" if suffix else ""),
                source,
                int(columns["locator"][local]),
                int(columns["samples"][local]),
                int(columns["content"][local]),
                int(columns["audio_at"][local]),
            )
        )
    return PlannedShard(plan.name(number), plan.bucket(number), number, tuple(items))


def length_rejections(
    plan: Plan, scan: Scan, config: BuildConfig, sample_rate: int
) -> Iterator[Rejection]:
    """Each utterance refused by its length, with the reason."""
    for ordinal in plan.rejected:
        part, local = scan.locate(int(ordinal))
        samples = int(part.columns["samples"][local])
        yield Rejection(part.source(local), _length_problem(samples / sample_rate, config))


def _length_problem(seconds: float, config: BuildConfig) -> str:
    if seconds == 0:
        return "empty audio: no samples"
    if seconds < config.min_seconds:
        return f"too short: {seconds:.3f} s < min_seconds {config.min_seconds} s"
    return f"too long: {seconds:.2f} s > max_seconds {config.max_seconds} s"


def make_plan(scan: Scan, features: FeatureConfig, config: BuildConfig, keep_audio: bool) -> Plan:
    """Filter by duration, choose bucket edges, cut each bucket into shards and give every
    key its suffix; every step is a numpy pass, not a Python object per utterance."""
    ordinals, samples = scan.column("ordinal"), scan.column("samples")
    seconds = samples / features.sample_rate
    accepted = (samples > 0) & (seconds >= config.min_seconds) & (seconds <= config.max_seconds)
    del seconds
    rejected = ordinals[~accepted]
    ordinals, samples = ordinals[accepted], samples[accepted]
    frames = features.num_frames(samples)
    buckets = _buckets(np.sort(frames), features, config)
    # On-disk order: by length, then ordinal; the loader batches within a shard, so a shard of
    # near-equal lengths pads little (5.6 % → 1.7 % on 4 h of speech, budget 8000).
    order = np.lexsort((ordinals, frames))
    members, frames = ordinals[order], frames[order]
    per_frame = features.n_mels * BYTES_PER_VALUE[config.storage]
    estimate = (frames * per_frame).astype(np.int64) + SAMPLE_OVERHEAD_BYTES
    if keep_audio:  # 16-bit FLAC is at most raw PCM size
        estimate += 2 * samples[order]
    shards = _cut_shards(frames, estimate, buckets, config)
    suffix_ordinals, suffix_numbers = _key_suffixes(scan, ordinals, scan.column("key")[accepted])
    plan = Plan(
        tuple(buckets),
        members,
        shards,
        suffix_ordinals,
        suffix_numbers,
        rejected,
        digest="",
        seconds=float(samples.sum()) / features.sample_rate,
        estimated_bytes=int(estimate.sum()),
    )
    digest = _digest(plan, scan, features, config, keep_audio)
    return dataclasses.replace(plan, digest=digest)


def _frames_at(seconds: float, features: FeatureConfig) -> int:
    return features.num_frames(round(seconds * features.sample_rate))


def _buckets(frames: np.ndarray, features: FeatureConfig, config: BuildConfig) -> list[Bucket]:
    """Bucket edges: from the config, or so that each bucket holds equal total duration."""
    lowest, highest = (
        _frames_at(config.min_seconds, features),
        _frames_at(config.max_seconds, features),
    )
    if config.bucket_edges_seconds:
        inner = [_frames_at(s, features) for s in config.bucket_edges_seconds]
    else:  # the first length past each 1/num_buckets of the total duration starts a bucket
        cumulative = np.cumsum(frames, dtype=np.int64)
        total = int(cumulative[-1]) if len(frames) else 0
        targets = [total * (i + 1) / config.num_buckets for i in range(config.num_buckets - 1)]
        places = np.searchsorted(cumulative, targets, side="left")
        inner = [int(frames[p]) + 1 for p in places if p < len(frames)]
    edges = sorted({e for e in inner if lowest < e <= highest})
    starts, ends = [lowest, *edges], [*(e - 1 for e in edges), highest]
    per_frame = features.hop_length / features.sample_rate
    return [
        Bucket(
            i,
            lo,
            hi,
            round(max(lo * per_frame, config.min_seconds), 3),
            round(min((hi + 1) * per_frame, config.max_seconds), 3),
        )
        for i, (lo, hi) in enumerate(zip(starts, ends, strict=True))
    ]


def _cut_shards(
    frames: np.ndarray, estimate: np.ndarray, buckets: list[Bucket], config: BuildConfig
) -> np.ndarray:
    """``[bucket, start, stop]`` per shard over length-sorted utterances: each shard capped
    by sample count and estimated bytes, and never spanning two buckets."""
    # Enough shards that many ranks × workers can stream in parallel, even on a small corpus.
    max_samples = min(config.shard_max_samples, max(1, -(-len(frames) // config.min_shards)))
    total = np.cumsum(estimate, dtype=np.int64)
    bounds = np.searchsorted(frames, [b.min_frames for b in buckets[1:]], side="left")
    rows: list[tuple[int, int, int]] = []
    for bucket, (lo, hi) in enumerate(zip([0, *bounds], [*bounds, len(frames)], strict=True)):
        start = int(lo)
        while start < hi:  # one step per shard, not per utterance
            before = int(total[start - 1]) if start else 0
            fits = int(np.searchsorted(total, before + config.shard_max_bytes, side="right"))
            stop = max(start + 1, min(start + max_samples, fits, int(hi)))
            rows.append((bucket, start, stop))
            start = stop
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def _key_suffixes(
    scan: Scan, ordinals: np.ndarray, hashes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``_2``, ``_3``, … for each utterance whose key base an earlier one has, by ordinal.

    Only utterances whose base hash repeats are looked at as strings (a handful in a clean
    corpus); a suffixed key never equals another utterance's base.
    """
    taken, counts = np.unique(hashes, return_counts=True)
    clashing = ordinals[np.isin(hashes, taken[counts > 1])]
    numbers: dict[int, int] = {}
    bases: set[str] = set()
    made: set[str] = set()
    for ordinal in clashing.tolist():
        part, local = scan.locate(ordinal)
        base = key_base(part.source(local))
        if base not in bases:
            bases.add(base)  # the first keeps its plain key
            continue
        number = 1
        while True:
            number += 1
            key = f"{base}_{number}"
            place = np.searchsorted(taken, key_digest(key))
            if key not in made and not (place < len(taken) and taken[place] == key_digest(key)):
                break
        made.add(key)
        numbers[ordinal] = number
    return (
        np.array(list(numbers), dtype=np.int64),
        np.array(list(numbers.values()), dtype=np.int64),
    )


def _digest(
    plan: Plan, scan: Scan, features: FeatureConfig, config: BuildConfig, keep_audio: bool
) -> str:
    """Hash of everything that decides the shards' bytes: equal digests, identical caches."""
    h = hashlib.sha256()
    head = {
        "format": FORMAT_VERSION,
        "features": features.to_dict(),
        "build": config.to_dict(),
        "keep_audio": keep_audio,
    }
    h.update(json.dumps(head, sort_keys=True).encode())
    places = np.searchsorted(scan.column("ordinal"), plan.members)
    for name in ("content", "samples"):  # text, speaker and source; then length
        h.update(np.ascontiguousarray(scan.column(name)[places]).tobytes())
    for array in (plan.shards, plan.suffix_ordinals, plan.suffix_numbers):
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]


def save_plan(plan: Plan, folder: Path, inputs: str) -> None:
    """Write ``plan`` into ``folder`` (whole or not at all), tagged with the ``inputs`` it
    was made from."""
    temp = temp_path(folder)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    for name in _ARRAYS:
        np.save(temp / f"{name}.npy", getattr(plan, name))
    meta = {
        "inputs": inputs,
        "digest": plan.digest,
        "seconds": plan.seconds,
        "estimated_bytes": plan.estimated_bytes,
        "buckets": [dataclasses.asdict(b) for b in plan.buckets],
    }
    (temp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rename(temp, folder)
    except OSError:  # another part saved the same plan first
        shutil.rmtree(temp, ignore_errors=True)


def load_plan(folder: Path, inputs: str) -> Plan | None:
    """The plan saved in ``folder`` if it was made from ``inputs``, else ``None``."""
    try:
        meta: dict[str, Any] = read_json(folder / "meta.json")
        if meta.get("inputs") != inputs:
            return None
        arrays = {
            n: np.load(folder / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in _ARRAYS
        }
    except (OSError, ValueError):
        return None
    return Plan(
        buckets=tuple(Bucket(**b) for b in meta["buckets"]),
        digest=meta["digest"],
        seconds=meta["seconds"],
        estimated_bytes=meta["estimated_bytes"],
        **arrays,
    )
