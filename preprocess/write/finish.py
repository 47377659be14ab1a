"""The end of a build: rejected.jsonl, stats.zarr, then index.json, from the shards' receipts."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from melcache.errors import UserError
from melcache.features import FeatureConfig
from melcache.fields.format import FIELDS_KEY
from melcache.format import FORMAT_VERSION, INDEX_NAME, REJECTED_NAME, STATS_NAME, write_atomic
from melcache.index import read_index, write_index, write_stats
from preprocess.config import BuildConfig
from preprocess.inputs.records import Rejection, printable
from preprocess.plan.shard_plan import Plan
from preprocess.write.index_table import write_cache_table

log = logging.getLogger(__name__)

_SHARD_FIELDS = (
    "name",
    "bucket",
    "samples",
    "frames",
    "min_frames",
    "max_frames",
    "bytes",
    "sha256",
)


def finish_cache(
    out: Path,
    plan: Plan,
    receipts: Sequence[dict[str, Any]],
    rejections: Sequence[Rejection],
    features: FeatureConfig,
    config: BuildConfig,
    keep_audio: bool,
    filtered: int,
) -> dict[str, Any]:
    """Write rejected.jsonl and stats.zarr, then index.json last (atomically); return the
    index. ``filtered`` inputs were left out by ``--where``: counted, not listed."""
    rejected = [
        {"source": printable(r.source), "reason": printable(r.reason), "stage": r.stage}
        for r in rejections
    ]
    rejected += [r for receipt in receipts for r in receipt["rejected"]]
    rejected.sort(key=lambda r: (r["source"], r["reason"]))
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejected)
    write_atomic(out / REJECTED_NAME, lines.encode("utf-8"))
    frames = sum(r["frames"] for r in receipts)
    _write_stats(out, receipts, frames, features.n_mels)
    written = [r for r in receipts if r["samples"] > 0]
    seconds = sum(r["seconds"] for r in receipts)
    utterances = sum(r["samples"] for r in receipts)
    index = {
        "format_version": FORMAT_VERSION,
        "features": features.to_dict(),
        "features_digest": features.digest(),
        "build": config.to_dict(),
        "plan_digest": plan.digest,
        "keep_audio": keep_audio,
        "buckets": [
            {
                "bucket": b.bucket,
                "min_seconds": b.min_seconds,
                "max_seconds": b.max_seconds,
                "min_frames": b.min_frames,
                "max_frames": b.max_frames,
            }
            for b in plan.buckets
        ],
        "shards": [_shard_entry(r) for r in written],
        "totals": {
            "discovered": utterances + len(rejected),
            "utterances": utterances,
            "seconds": round(seconds, 3),
            "hours": round(seconds / 3600, 4),
            "frames": frames,
            "shards": len(written),
            "rejected": len(rejected),
            "filtered_out": filtered,
            "rejected_by_reason": dict(
                sorted(Counter(reason_kind(r["reason"]) for r in rejected).items())
            ),
        },
        "stats": STATS_NAME,
    }
    index["table"] = write_cache_table(out, index)  # from the shards: every input layout alike
    _keep_fields(out, index)
    write_index(out, index)
    return index


def _keep_fields(out: Path, index: dict[str, Any]) -> None:
    """A build run again over a cache with derived fields (``preprocess derive``) keeps them
    when it ends with the same mel shards; when the shards changed, the fields, bound to the
    old ones, are dropped from the index, saying so (their folders stay until derived again)."""
    if not (out / INDEX_NAME).is_file():
        return
    try:
        old = read_index(out)
        fields, before = old.get(FIELDS_KEY), [(s["name"], s["sha256"]) for s in old["shards"]]
    except (UserError, KeyError, TypeError):
        return  # an index this build replaces anyway
    if not fields:
        return
    if before == [(s["name"], s["sha256"]) for s in index["shards"]]:
        index[FIELDS_KEY] = fields
        return
    log.warning(
        "%s: the mel shards changed, so the fields %s derived from the old ones are no longer "
        "listed; run preprocess derive again", out, ", ".join(sorted(fields)),
    )  # fmt: skip


def _shard_entry(receipt: dict[str, Any]) -> dict[str, Any]:
    entry = {k: receipt[k] for k in _SHARD_FIELDS}
    # The receipt of a shard written by the previous release (a killed build resumed) has no
    # xxh3_128; the loader then checks that shard's sha256.
    if "xxh3_128" in receipt:
        entry["xxh3_128"] = receipt["xxh3_128"]
    return entry


def reason_kind(reason: str) -> str:
    """The reason without its particulars ("too long: 70.00 s > …" → "too long")."""
    return reason.split(":", 1)[0]


def _write_stats(out: Path, receipts: Sequence[dict[str, Any]], frames: int, n_mels: int) -> None:
    """Per-channel mean and std over every frame, from the shards' running sums (zeros over
    no frame: a cache every utterance of which was rejected)."""
    sums, squares = np.zeros(n_mels), np.zeros(n_mels)
    for receipt in receipts:
        sums += np.asarray(receipt["mel_sum"], np.float64)
        squares += np.asarray(receipt["mel_sum_squares"], np.float64)
    mean = sums / max(frames, 1)
    std = np.sqrt(np.maximum(squares / max(frames, 1) - mean**2, 0.0))
    write_stats(out, mean, std, frames)
