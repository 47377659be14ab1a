"""``preprocess inspect``: a human summary of a cache."""

from __future__ import annotations

from pathlib import Path

from preprocess.index import read_index


def summarize(cache: Path) -> str:
    """Hours, utterances, buckets (counts and the padding they imply), shards and rejections."""
    index = read_index(cache)
    totals = index["totals"]
    features = index["features"]
    lines = [
        f"cache {cache}: format {index['format_version']}, features {index['features_digest']} "
        f"({features['sample_rate']} Hz, hop {features['hop_length']}, {features['n_mels']} mels, "
        f"{features['mel_scale']} scale)",
        f"{totals['utterances']} utterances, {totals['hours']:.3f} h, {totals['frames']} frames, "
        f"{totals['shards']} shards, {sum(s['bytes'] for s in index['shards']) / 1e6:.1f} MB",
        "",
        "bucket  seconds        frames       utts  shards  pad if padded to bucket max",
    ]
    for bucket in index["buckets"]:
        shards = [s for s in index["shards"] if s["bucket"] == bucket["bucket"]]
        samples = sum(s["samples"] for s in shards)
        frames = sum(s["frames"] for s in shards)
        longest = max((s["max_frames"] for s in shards), default=0)
        padding = 1 - frames / (samples * longest) if samples else 0.0
        lines.append(
            f"{bucket['bucket']:>6}  {bucket['min_seconds']:>5.2f}–{bucket['max_seconds']:<6.2f}  "
            f"{bucket['min_frames']:>5}–{bucket['max_frames']:<5}  {samples:>5}  {len(shards):>6}  "
            f"{padding:6.1%}"
        )
    lines += ["", f"rejected: {totals['rejected']} of {totals['discovered']} discovered"]
    lines += [f"  {n:>6}  {reason}" for reason, n in totals["rejected_by_reason"].items()]
    return "\n".join(lines)
