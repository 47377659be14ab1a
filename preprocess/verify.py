"""``preprocess verify``: re-check every shard of a cache against its index."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from tqdm import tqdm

from preprocess.errors import ShardError
from preprocess.format import (
    AUDIO_MEMBER,
    MEL_MEMBER,
    META_MEMBER,
    REJECTED_NAME,
    SHARD_PATTERN,
    HashingStream,
    decode_mel,
    decode_meta,
    group_samples,
    iter_members,
)
from preprocess.index import read_index
from preprocess.parallel import ordered_map


def verify(cache: Path, workers: int = 1) -> list[str]:
    """Return every problem found in ``cache`` (empty when the cache is sound)."""
    index = read_index(cache)
    n_mels = index["features"]["n_mels"]
    buckets = {b["bucket"]: b for b in index["buckets"]}
    jobs = [
        (cache, shard, n_mels, buckets.get(shard["bucket"]), index["keep_audio"])
        for shard in index["shards"]
    ]
    problems: list[str] = []
    key_counts: Counter[str] = Counter()
    with ordered_map(workers) as run:
        results = run(_check_shard_job, jobs)
        for shard_problems, keys in tqdm(
            results, total=len(jobs), desc="verify", unit="shard", disable=None
        ):
            problems += shard_problems
            key_counts.update(keys)
    problems += [
        f"key {k!r} appears {n} times across shards" for k, n in sorted(key_counts.items()) if n > 1
    ]
    listed = {s["name"] for s in index["shards"]}
    problems += [
        f"{p.name}: shard not listed in index.json"
        for p in sorted(cache.glob("*.tar"))
        if p.name not in listed
    ]
    problems += _check_totals(cache, index, n_mels)
    return problems


def _check_shard_job(
    job: tuple[Path, dict[str, Any], int, dict[str, Any] | None, bool],
) -> tuple[list[str], list[str]]:
    return check_shard(*job)


def check_shard(
    cache: Path, entry: dict[str, Any], n_mels: int, bucket: dict[str, Any] | None, keep_audio: bool
) -> tuple[list[str], list[str]]:
    """Problems in one shard and the keys it holds."""
    name = entry["name"]
    path = cache / name
    if not SHARD_PATTERN.match(name):
        return [f"{name}: not a melcache shard name"], []
    if not path.is_file():
        return [f"{name}: shard missing"], []
    if bucket is None:
        return [f"{name}: bucket {entry['bucket']} is not in the index"], []
    problems: list[str] = []
    size = path.stat().st_size
    if size != entry["bytes"]:
        problems.append(f"{name}: {size} bytes, index says {entry['bytes']}")
    foreign: list[str] = []
    keys: list[str] = []
    frames: list[int] = []
    member_problems: list[str] = []
    with open(path, "rb") as raw:
        stream = HashingStream(raw)
        try:
            members = iter_members(stream, name, on_unknown=foreign.append)
            for sample in group_samples(members, name):
                keys.append(str(sample["__key__"]))
                frames.append(
                    _check_sample(name, sample, n_mels, bucket, keep_audio, member_problems)
                )
        except ShardError as exc:
            member_problems.append(str(exc))
        if stream.hexdigest_to_end() != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from the index (corrupt or replaced)")
    problems += member_problems
    problems += [f"{name}: foreign member {m!r} (never read)" for m in foreign]
    if len(keys) != entry["samples"]:
        problems.append(f"{name}: {len(keys)} samples, index says {entry['samples']}")
    if keys and (sum(frames), min(frames), max(frames)) != (
        entry["frames"],
        entry["min_frames"],
        entry["max_frames"],
    ):
        problems.append(f"{name}: frame totals differ from the index")
    return problems, keys


def _check_sample(
    shard: str,
    sample: dict[str, Any],
    n_mels: int,
    bucket: dict[str, Any],
    keep_audio: bool,
    problems: list[str],
) -> int:
    """Check one sample, appending problems; return its frame count (0 if unreadable)."""
    where = f"{shard}: {sample['__key__']}"
    expected = {MEL_MEMBER, META_MEMBER} | ({AUDIO_MEMBER} if keep_audio else set())
    missing = expected - set(sample)
    if missing:
        problems.append(f"{where}: missing member(s) {', '.join(sorted(missing))}")
        return 0
    try:
        mel = decode_mel(sample[MEL_MEMBER], n_mels, where)
        meta = decode_meta(sample[META_MEMBER], where)
    except ShardError as exc:
        problems.append(str(exc))
        return 0
    frames = mel.shape[0]
    if meta.get("frames") != frames:
        problems.append(f"{where}: json frames {meta.get('frames')} != mel frames {frames}")
    if not np.isfinite(mel).all():
        problems.append(f"{where}: mel has NaN or infinite values")
    if not bucket["min_frames"] <= frames <= bucket["max_frames"]:
        problems.append(
            f"{where}: {frames} frames outside bucket {bucket['bucket']} "
            f"[{bucket['min_frames']}, {bucket['max_frames']}]"
        )
    if meta.get("bucket") != bucket["bucket"]:
        problems.append(
            f"{where}: json bucket {meta.get('bucket')} != shard bucket {bucket['bucket']}"
        )
    return frames


def _check_totals(cache: Path, index: dict[str, Any], n_mels: int) -> list[str]:
    problems: list[str] = []
    totals = index["totals"]
    samples = sum(s["samples"] for s in index["shards"])
    if samples != totals["utterances"]:
        problems.append(
            f"index.json: shards hold {samples} samples, totals say {totals['utterances']}"
        )
    if totals["utterances"] + totals["rejected"] != totals["discovered"]:
        problems.append("index.json: utterances + rejected != discovered")
    try:
        lines = (cache / REJECTED_NAME).read_text(encoding="utf-8").splitlines()
        if len(lines) != totals["rejected"] or not all(json.loads(x).get("reason") for x in lines):
            problems.append(
                f"{REJECTED_NAME}: {len(lines)} records, index says {totals['rejected']}"
            )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{REJECTED_NAME}: unreadable ({exc})")
    try:
        stats = zarr.open_group(str(cache / index["stats"]), mode="r")
        if stats["mean"].shape != (n_mels,) or stats["std"].shape != (n_mels,):
            problems.append(f"{index['stats']}: mean/std shape is not [{n_mels}]")
    except (OSError, KeyError, ValueError, zarr.errors.BaseZarrError) as exc:
        problems.append(f"{index['stats']}: unreadable ({exc})")
    return problems
