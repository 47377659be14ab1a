"""``preprocess verify``: every shard through the loader's own reader, then checks across shards.

Per shard, :mod:`melcache.reader` checks size, sha256 and xxh3_128 (where recorded), member
names and metadata types as the loader does; verify goes on past the first problem to list
them all, and adds what only a full pass can check: every mel decoded (finite, its frame
count the metadata's, inside its bucket), foreign members, totals against the index. Across shards: duplicate
keys, shards on disk that the index does not list, totals, ``rejected.jsonl`` and
``stats.zarr``.

A cache in an object store (``s3://``) is checked the same, each shard read once by ranged
GETs; its table is checked against the index's digests of it, not rebuilt from the shards
(that would read every shard a second time: verify the local cache before ``push``), and its
derived fields are not checked (stores serve mel shards only so far).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from melcache.bounded import loads_json
from melcache.codec import decode_mel
from melcache.errors import ShardError, UserError
from melcache.extras import cache_extras
from melcache.format import AUDIO_MEMBER, REJECTED_NAME, SHARD_PATTERN, finite_mel
from melcache.index import index_storage, read_index, read_stats
from melcache.location import member_location, read_bytes
from melcache.reader import integrity_problems, load_shard, raw_sample, shard_samples
from melcache.remote import objectstore
from melcache.storage import MEL_MEMBERS, STEP, STORAGE_OF_MEMBER
from melcache.table import Table
from preprocess.check.verify_fields import field_problems
from preprocess.job.pool import ordered_map
from preprocess.write.index_table import table_problems


@dataclasses.dataclass(frozen=True)
class SampleRules:
    """What every sample of a cache must be: a mel of ``n_mels`` channels, stored as
    ``storage``, no value below the log floor by more than the storage's rounding, and
    exactly the index's ``extras`` fields."""

    n_mels: int
    storage: str
    lowest: float
    extras: tuple[str, ...] = ()


def verify(cache: Path | str, workers: int = 1) -> list[str]:
    """Return every problem found in ``cache`` (empty when the cache is sound)."""
    index = read_index(cache)
    n_mels = index["features"]["n_mels"]
    floor = math.log(index["features"]["log_floor"])
    rules = SampleRules(n_mels, index_storage(index), floor - STEP / 2, cache_extras(index))
    buckets = {b["bucket"]: b for b in index["buckets"]}
    jobs = [
        (cache, shard, rules, buckets.get(shard["bucket"]), index["keep_audio"])
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
        f"{name}: shard not listed in index.json"
        for name in _stored_shards(cache)
        if name not in listed
    ]
    problems += _check_totals(cache, index, n_mels)
    if not objectstore.is_store(cache):
        sound = not problems  # damaged shards: the table's own digest only, no blame for theirs
        problems += table_problems(cache, index, workers, shards_sound=sound)
        problems += field_problems(cache, index)  # derived fields against their shards and rows
    elif "table" in index:
        try:
            Table(cache, index, sha256=True)  # size, digests and columns against the index
        except (UserError, ShardError) as exc:
            problems.append(str(exc))
    return problems


def _stored_shards(cache: Path | str) -> list[str]:
    """The names of the shard files the cache's folder or prefix holds."""
    if objectstore.is_store(cache):
        names = objectstore.list_sizes(str(cache))
        return sorted(n for n in names if "/" not in n and SHARD_PATTERN.match(n))
    return [path.name for path in sorted(Path(cache).glob("*.tar"))]


def _check_shard_job(
    job: tuple[Path | str, dict[str, Any], SampleRules, dict[str, Any] | None, bool],
) -> tuple[list[str], list[str]]:
    return check_shard(*job)


def check_shard(
    cache: Path | str,
    entry: dict[str, Any],
    rules: SampleRules,
    bucket: dict[str, Any] | None,
    keep_audio: bool,
) -> tuple[list[str], list[str]]:
    """Problems in one shard and the keys it holds."""
    name = entry["name"]  # read_index has checked it against the shard-name pattern
    location = member_location(cache, name)
    if not objectstore.is_store(cache) and not Path(location).is_file():
        return [f"{name}: shard missing"], []  # a store says so as it is read
    if bucket is None:
        return [f"{name}: bucket {entry['bucket']} is not in the index"], []
    try:
        data = load_shard(location)
    except ShardError as exc:
        return [str(exc)], []
    problems = integrity_problems(data, entry, name)
    foreign: list[str] = []
    keys: list[str] = []
    frames: list[int] = []
    try:
        for sample in shard_samples(data, name, on_unknown=foreign.append):
            keys.append(str(sample["__key__"]))
            frames.append(_check_sample(name, sample, rules, bucket, keep_audio, problems))
    except ShardError as exc:
        problems.append(str(exc))
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
    rules: SampleRules,
    bucket: dict[str, Any],
    keep_audio: bool,
    problems: list[str],
) -> int:
    """Check one sample beyond what the reader checks, appending problems; return its frame
    count (0 if unreadable)."""
    where = f"{shard}:{sample['__key__']}"
    if keep_audio and AUDIO_MEMBER not in sample:
        problems.append(f"{where}: missing member {AUDIO_MEMBER}")
    try:  # members and metadata, as the loader checks them
        raw = raw_sample(sample, shard)
    except ShardError as exc:
        problems.append(str(exc))
        raw = None
    member = MEL_MEMBERS[rules.storage]
    if any(m in sample for m in STORAGE_OF_MEMBER if m != member):
        problems.append(f"{where}: a mel member other than the index's {member}")
    try:  # the mel on its own, so a bad one is reported whatever the metadata says
        mel = (
            decode_mel(sample[member], rules.storage, rules.n_mels, where)
            if member in sample
            else None
        )
    except ShardError as exc:
        problems.append(str(exc))
        mel = None
    if raw is None or mel is None:
        return 0
    frames = mel.shape[0]
    if raw.frames != frames:
        problems.append(f"{where}: json frames {raw.frames} != mel frames {frames}")
    if not finite_mel(mel):
        problems.append(f"{where}: mel has NaN or infinite values")
    elif (lowest := float(mel.min())) < rules.lowest:
        problems.append(f"{where}: mel value {lowest} below the log floor {rules.lowest}")
    if not bucket["min_frames"] <= frames <= bucket["max_frames"]:
        problems.append(
            f"{where}: {frames} frames outside bucket {bucket['bucket']} "
            f"[{bucket['min_frames']}, {bucket['max_frames']}]"
        )
    if sorted(raw.extras) != sorted(rules.extras):
        problems.append(
            f"{where}: json extras {sorted(raw.extras)} != the index's build.extras "
            f"{sorted(rules.extras)}"
        )
    if raw.bucket != bucket["bucket"]:
        problems.append(f"{where}: json bucket {raw.bucket} != shard bucket {bucket['bucket']}")
    return frames


def _check_totals(cache: Path | str, index: dict[str, Any], n_mels: int) -> list[str]:
    problems: list[str] = []
    totals = index["totals"]
    samples = sum(s["samples"] for s in index["shards"])
    if samples != totals["utterances"]:
        problems.append(
            f"index.json: shards hold {samples} samples, totals say {totals['utterances']}"
        )
    if totals["utterances"] + totals["rejected"] != totals["discovered"]:
        problems.append("index.json: utterances + rejected != discovered")
    counted = _rejection_records(member_location(cache, REJECTED_NAME))
    if isinstance(counted, str):
        problems.append(f"{REJECTED_NAME}: unreadable ({counted})")
    elif counted != totals["rejected"]:
        problems.append(f"{REJECTED_NAME}: {counted} records, index says {totals['rejected']}")
    try:
        read_stats(cache, n_mels)
    except UserError as exc:
        problems.append(str(exc))
    return problems


def _rejection_records(location: str) -> int | str:
    """How many records ``rejected.jsonl`` holds, or why it cannot be read: a line that is
    not a JSON object with a reason counts as none."""
    records = 0
    try:
        for line in bytes(read_bytes(location)).splitlines():
            record = loads_json(line)
            records += isinstance(record, dict) and bool(record.get("reason"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        return str(exc)
    return records
