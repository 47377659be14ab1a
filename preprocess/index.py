"""Writing and reading the files that make a cache complete: rejected.jsonl, stats.zarr, index.json."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds
import zarr

from preprocess.config import BuildConfig, FeatureConfig, features_from_dict
from preprocess.discover import Rejection
from preprocess.errors import UserError
from preprocess.format import FORMAT_VERSION, INDEX_NAME, REJECTED_NAME, STATS_NAME, write_atomic
from preprocess.plan import Plan


def write_cache_files(
    out: Path,
    plan: Plan,
    receipts: Sequence[dict[str, Any]],
    rejections: Sequence[Rejection],
    features: FeatureConfig,
    config: BuildConfig,
    keep_audio: bool,
) -> dict[str, Any]:
    """Write rejected.jsonl and stats.zarr, then index.json last (atomically); return the index."""
    rejected = [{"source": r.source, "reason": r.reason, "stage": r.stage} for r in rejections]
    rejected += [r for receipt in receipts for r in receipt["rejected"]]
    rejected.sort(key=lambda r: (r["source"], r["reason"]))
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejected)
    write_atomic(out / REJECTED_NAME, lines.encode("utf-8"))
    frames = sum(r["frames"] for r in receipts)
    _write_stats(out, receipts, frames)
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
        "shards": [
            {
                k: r[k]
                for k in (
                    "name",
                    "bucket",
                    "samples",
                    "frames",
                    "min_frames",
                    "max_frames",
                    "bytes",
                    "sha256",
                )
            }
            for r in written
        ],
        "totals": {
            "discovered": utterances + len(rejected),
            "utterances": utterances,
            "seconds": round(seconds, 3),
            "hours": round(seconds / 3600, 4),
            "frames": frames,
            "shards": len(written),
            "rejected": len(rejected),
            "rejected_by_reason": dict(
                sorted(Counter(_reason_kind(r["reason"]) for r in rejected).items())
            ),
        },
        "stats": STATS_NAME,
    }
    write_atomic(
        out / INDEX_NAME, (json.dumps(index, indent=1, ensure_ascii=False) + "\n").encode("utf-8")
    )
    return index


def _reason_kind(reason: str) -> str:
    """The reason without its particulars ("too long: 70.00 s > …" → "too long")."""
    return reason.split(":", 1)[0]


def _write_stats(out: Path, receipts: Sequence[dict[str, Any]], frames: int) -> None:
    """Per-channel mean and std over every frame, from the shards' running sums."""
    sums = np.sum([r["mel_sum"] for r in receipts], axis=0, dtype=np.float64)
    squares = np.sum([r["mel_sum_squares"] for r in receipts], axis=0, dtype=np.float64)
    mean = sums / max(frames, 1)
    std = np.sqrt(np.maximum(squares / max(frames, 1) - mean**2, 0.0))
    temp, final = out / f"{STATS_NAME}.{os.getpid()}.tmp", out / STATS_NAME
    shutil.rmtree(temp, ignore_errors=True)
    zarr.save_group(str(temp), mean=mean.astype(np.float32), std=std.astype(np.float32))
    zarr.open_group(str(temp), mode="r+").attrs["frames"] = frames
    shutil.rmtree(final, ignore_errors=True)
    temp.rename(final)


def read_index(cache: str | Path) -> dict[str, Any]:
    """Load ``index.json`` of a cache given as a folder or a URL prefix webdataset can open."""
    location = str(cache).rstrip("/")
    url = f"{location}/{INDEX_NAME}"
    try:
        with wds.gopen(url) as stream:
            index = json.loads(stream.read().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(
            f"{url} not found: not a melcache cache, or its build has not finished"
        ) from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{url} cannot be read: {exc}") from None
    if index.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{url} has format_version {index.get('format_version')}; this melcache reads {FORMAT_VERSION}"
        )
    return index


def index_features(index: dict[str, Any]) -> FeatureConfig:
    """The FeatureConfig a cache was built with."""
    return features_from_dict(index["features"])
