"""The files that describe a whole cache: ``index.json`` (written last) and ``stats.zarr``.

:func:`read_index` is the one reader of ``index.json``: every command and the loader go
through it, so a cache from somewhere else meets the same checks everywhere. Each shard
entry's fields are checked for type and range, and its name against the shard-name pattern,
before anything opens a file the index names.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from melcache.bounded import loads_json
from melcache.errors import UserError
from melcache.extras import META_FIELD, extras_problem
from melcache.features import FeatureConfig, features_from_dict
from melcache.format import (
    FORMAT_VERSION,
    INDEX_NAME,
    SHARD_PATTERN,
    STATS_NAME,
    temp_path,
    write_atomic,
)
from melcache.location import is_url, member_location, read_bytes
from melcache.remote import objectstore
from melcache.storage import FP16, STORAGES

# Shard entry fields: type and smallest valid value; ``bytes`` and ``sha256`` may be absent
# in a hand-made index (the loader then needs ``data.shard_check = "off"``), ``xxh3_128`` in
# one from before it was recorded.
_SHARD_INTS = {"bucket": 0, "samples": 1, "frames": 1, "min_frames": 1, "max_frames": 1}
_DIGEST_DIGITS = {"sha256": 64, "xxh3_128": 32}  # lowercase hex
_TOP_LEVEL = {
    "features": dict,
    "features_digest": str,
    "build": dict,
    "keep_audio": bool,
    "buckets": list,
    "shards": list,
    "totals": dict,
    "stats": str,
}
_TOTAL_COUNTS = ("discovered", "utterances", "frames", "shards", "rejected")


def index_storage(index: dict[str, Any]) -> str:
    """How a cache's mels are stored (``build.storage``; fp16 in caches from before it)."""
    return index["build"].get("storage", FP16)


def read_index(cache: str | Path) -> dict[str, Any]:
    """Parse and check ``index.json`` of a cache (folder or URL prefix).

    Raises :class:`UserError` naming the file and the first bad field: a missing or
    unfinished cache, another format version, bad features, or a shard entry whose name is
    not a shard name or whose counts are not integers in their range (``samples`` ≥ 1, …).
    """
    location = member_location(cache, INDEX_NAME)
    try:
        index = loads_json(bytes(read_bytes(location)).decode("utf-8"))
    except FileNotFoundError:
        raise UserError(
            f"{location} not found: not a melcache cache, or its build has not finished"
        ) from None
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{location}: cannot read the cache index ({exc}); is {cache} a finished "
            "`python -m preprocess build` output?"
        ) from None
    version = index.get("format_version") if isinstance(index, dict) else None
    if version != FORMAT_VERSION:
        raise UserError(
            f"{location}: format_version {version!r}, this melcache reads {FORMAT_VERSION}"
        )
    for key, kind in _TOP_LEVEL.items():
        if not isinstance(index.get(key), kind):
            raise UserError(
                f"{location}: index.{key} = {index.get(key)!r} is not a {kind.__name__}"
            )
    if index["stats"] != STATS_NAME:  # a name, never a path to follow
        raise UserError(f"{location}: index.stats = {index['stats']!r}, expected {STATS_NAME!r}")
    missing = sorted(set(FeatureConfig.__dataclass_fields__) - set(index["features"]))
    if missing:  # never a default in place of what the cache was built with
        raise UserError(f"{location}: index.features has no {missing[0]!r}")
    features_from_dict(index["features"], source=f"{location} [features]")
    if index_storage(index) not in STORAGES:  # a later melcache's: never read as another kind
        raise UserError(
            f"{location}: build.storage = {index_storage(index)!r} is not one this melcache "
            f"reads ({', '.join(STORAGES)}); upgrade melcache"
        )
    extras = index["build"].get(META_FIELD, [])
    problem = "a list" if not isinstance(extras, list) else extras_problem(tuple(extras))
    if problem:
        raise UserError(f"{location}: build.extras = {extras!r} is invalid: expected {problem}")
    for number, entry in enumerate(index["shards"]):
        check_shard_entry(entry, f"{location}: shards[{number}]")
    for number, bucket in enumerate(index["buckets"]):
        _check_bucket(bucket, f"{location}: buckets[{number}]")
    _check_totals(index["totals"], f"{location}: totals")
    return index


def check_shard_entry(entry: Any, where: str) -> None:
    """One shard entry's name, counts and digests (mel shards, and derived fields' shards)."""
    if not isinstance(entry, dict):
        raise UserError(f"{where} is {entry!r}, not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not SHARD_PATTERN.match(name):
        raise UserError(f"{where}.name = {name!r} is not a shard name like b00-000000.tar")
    for field, least in _SHARD_INTS.items():
        _check_count(entry.get(field), f"{where}.{field}", least)
    if "bytes" in entry:
        _check_count(entry["bytes"], f"{where}.bytes", 1)
    for field, digits in _DIGEST_DIGITS.items():
        value = entry.get(field)
        if field in entry and not (
            isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{digits}}}", value)
        ):
            raise UserError(f"{where}.{field} = {value!r} is not {digits} lowercase hex digits")
    if not entry["min_frames"] <= entry["max_frames"]:
        raise UserError(
            f"{where}: min_frames {entry['min_frames']} > max_frames {entry['max_frames']}"
        )


def _check_bucket(bucket: Any, where: str) -> None:
    if not isinstance(bucket, dict):
        raise UserError(f"{where} is {bucket!r}, not an object")
    _check_count(bucket.get("bucket"), f"{where}.bucket", 0)
    for field in ("min_frames", "max_frames"):
        _check_count(bucket.get(field), f"{where}.{field}", 1)
    for field in ("min_seconds", "max_seconds"):
        _check_seconds(bucket.get(field), f"{where}.{field}")


def _check_totals(totals: dict[str, Any], where: str) -> None:
    for field in _TOTAL_COUNTS:
        _check_count(totals.get(field), f"{where}.{field}", 0)
    for field in ("seconds", "hours"):
        _check_seconds(totals.get(field), f"{where}.{field}")
    reasons = totals.get("rejected_by_reason")
    if not isinstance(reasons, dict):
        raise UserError(f"{where}.rejected_by_reason = {reasons!r} is not an object")
    for reason, count in reasons.items():
        _check_count(count, f"{where}.rejected_by_reason[{reason!r}]", 0)


def _check_count(value: Any, where: str, least: int) -> None:
    if type(value) is not int or value < least:  # bool is an int subclass; not a count
        raise UserError(f"{where} = {value!r} is invalid: expected an integer ≥ {least}")


def _check_seconds(value: Any, where: str) -> None:
    if type(value) not in (int, float) or not 0 <= value < math.inf:  # also refuses NaN
        raise UserError(f"{where} = {value!r} is invalid: expected a finite number ≥ 0")


def write_index(out: Path, index: dict[str, Any]) -> None:
    """Write ``index.json`` atomically: its presence marks the cache complete."""
    text = json.dumps(index, indent=1, ensure_ascii=False) + "\n"
    write_atomic(out / INDEX_NAME, text.encode("utf-8"))


def write_stats(out: Path, mean: np.ndarray, std: np.ndarray, frames: int) -> None:
    """Write per-channel ``mean`` and ``std`` (float32 ``[n_mels]``) over ``frames`` frames
    as ``stats.zarr``, under a temporary name first."""
    temp, final = temp_path(out / STATS_NAME), out / STATS_NAME
    shutil.rmtree(temp, ignore_errors=True)
    zarr.save_group(str(temp), mean=mean.astype(np.float32), std=std.astype(np.float32))
    zarr.open_group(str(temp), mode="r+").attrs["frames"] = frames
    shutil.rmtree(final, ignore_errors=True)
    temp.rename(final)


def read_stats(cache: str | Path, n_mels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (float32 ``[n_mels]``) from a cache's ``stats.zarr`` (local,
    or in a store: its few small objects copied to a temporary folder, read there);
    :class:`UserError` when they are missing, unreadable or of another shape."""
    if objectstore.is_store(cache):
        with tempfile.TemporaryDirectory() as folder:
            try:
                objectstore.download_prefix(
                    member_location(cache, STATS_NAME), Path(folder, STATS_NAME)
                )
            except OSError as exc:
                raise UserError(str(exc)) from None
            return read_stats(folder, n_mels)
    path = Path(member_location(cache, STATS_NAME))
    if is_url(cache) or not path.is_dir():
        raise UserError(f"{path}: per-channel statistics not found (they need a local cache)")
    try:
        group = zarr.open_group(str(path), mode="r")
        mean, std = np.asarray(group["mean"][:]), np.asarray(group["std"][:])
    except (OSError, KeyError, ValueError, zarr.errors.BaseZarrError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from None
    if mean.shape != (n_mels,) or std.shape != (n_mels,):
        raise UserError(f"{path}: mean/std shape is {mean.shape}/{std.shape}, not [{n_mels}]")
    return mean.astype(np.float32), std.astype(np.float32)
