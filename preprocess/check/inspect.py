"""``preprocess inspect``: a text summary of a cache, and with ``--png`` its pictures
(matplotlib, an optional extra)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from melcache.batch_plans import make_rng, padding_fraction, plan_batches, round_up
from melcache.codec import decode_mel
from melcache.errors import UserError
from melcache.features import FeatureConfig
from melcache.fields.format import FIELDS_KEY
from melcache.fields.store import FieldStore
from melcache.index import index_storage, read_index
from melcache.location import member_location
from melcache.reader import ShardCheck, read_shard
from melcache.table import Table
from preprocess.config import BuildConfig
from preprocess.plan.scan import Scan
from preprocess.plan.shard_plan import Plan, length_rejections
from preprocess.write.finish import reason_kind

SHARDS_PER_BUCKET = 16  # enough samples for a faithful histogram without reading a huge cache


def summarize(cache: Path | str) -> str:
    """Hours, utterances, buckets (counts and the padding they imply), shards and rejections."""
    index = read_index(cache)
    totals = index["totals"]
    features = index["features"]
    megabytes = sum(s.get("bytes", 0) for s in index["shards"]) / 1e6
    hours = max(totals["hours"], 1e-9)
    lines = [
        f"cache {cache}: format {index['format_version']}, features {index['features_digest']} "
        f"({features['sample_rate']} Hz, hop {features['hop_length']}, {features['n_mels']} mels, "
        f"{features['mel_scale']} scale)",
        f"{totals['utterances']} utterances, {totals['hours']:.3f} h, {totals['frames']} frames, "
        f"{totals['shards']} shards, {megabytes:.1f} MB, {megabytes / hours:.1f} MB per hour "
        f"(mels stored as {index_storage(index)})",
        "",
        "bucket  seconds        frames       utts  shards  pad if padded to bucket max",
    ]
    for bucket in index["buckets"]:
        shards = [s for s in index["shards"] if s["bucket"] == bucket["bucket"]]
        samples = sum(s["samples"] for s in shards)
        frames = sum(s["frames"] for s in shards)
        longest = max((s["max_frames"] for s in shards), default=0)
        padding = padding_fraction(frames, samples * longest)
        lines.append(
            f"{bucket['bucket']:>6}  {bucket['min_seconds']:>5.2f}–{bucket['max_seconds']:<6.2f}  "
            f"{bucket['min_frames']:>5}–{bucket['max_frames']:<5}  {samples:>5}  {len(shards):>6}  "
            f"{padding:6.1%}"
        )
    lines += ["", f"rejected: {totals['rejected']} of {totals['discovered']} discovered"]
    if totals.get("filtered_out"):
        lines.insert(-1, f"left out by --where: {totals['filtered_out']}")
    lines += [f"  {n:>6}  {reason}" for reason, n in totals["rejected_by_reason"].items()]
    lines += _text_lines(cache, index)
    lines += _field_lines(cache, index, hours)
    return "\n".join(lines)


def _text_lines(cache: Path | str, index: dict[str, Any]) -> list[str]:
    """Text × frames per bucket, from the table (none without one): characters per second
    (5th / 50th / 95th percentile) and the padding of the text, and of text then frames as
    one sequence (``data.sequence = "text+frames"``), each padded to the bucket's longest.
    Characters, not tokens: a model's tokenizer is the loader's (``docs/loader.md``)."""
    if not index.get("table"):
        return []
    table = Table(str(cache), index)
    chars = table.column("text_length").astype(np.int64)
    frames = table.column("frames").astype(np.int64)
    starts = table.column("shard_rows").astype(np.int64)
    bucket_of = np.repeat([s["bucket"] for s in index["shards"]], np.diff(starts))
    per_second = index["features"]["sample_rate"] / index["features"]["hop_length"]
    lines = ["", "bucket  text chars/s (p5 / p50 / p95)  text pad  text+frames pad  (by the table)"]
    for bucket in np.unique(bucket_of).tolist():
        held = bucket_of == bucket
        rate = chars[held] * per_second / np.maximum(frames[held], 1)
        low, mid, high = np.percentile(rate, [5, 50, 95])
        text, both = chars[held], chars[held] + frames[held]
        lines.append(
            f"{bucket:>6}  {low:6.1f} / {mid:6.1f} / {high:6.1f}           "
            f"{padding_fraction(text.sum(), len(text) * text.max()):6.1%}  "
            f"{padding_fraction(both.sum(), len(both) * both.max()):14.1%}"
        )
    return lines


def _field_lines(cache: Path | str, index: dict[str, Any], hours: float) -> list[str]:
    """One line per derived field: what it holds, its size and where it came from; a score's
    percentiles (a field of one number per utterance), to choose a ``data.where`` by."""
    fields = index.get(FIELDS_KEY, {})
    lines = ["", f"derived fields: {len(fields) or 'none'}"] if fields else []
    for name, entry in fields.items():
        made = entry["provenance"]
        megabytes = entry["totals"]["bytes"] / 1e6
        weights = (made.get("checkpoint_sha256") or "none")[:12]
        shape = ", ".join(map(str, entry["shape"]))
        held = (
            f"[{shape}] per utterance"
            if entry.get("per_utterance")
            else f"[T, {shape}] at {entry['frame_rate']}x the mel's frame rate"
        )
        lines.append(
            f"  {name}: {entry['dtype']} {held}, {entry['totals']['frames']} frames, "
            f"{megabytes:.2f} MB ({megabytes / hours:.1f} MB per hour); {made['encoder']}, "
            f"weights sha256 {weights}…, provenance {entry['provenance_digest']}"
        )
        if "values" in entry:
            values = FieldStore(cache, index, [name], by="inspect").values(name)
            low, mid, high = np.percentile(values, [5, 50, 95]).tolist()
            lines.append(
                f"    values p5 / p50 / p95: {low:.4g} / {mid:.4g} / {high:.4g} "
                f'(data.where = "{name} >= …" selects on it)'
            )
    return lines


def describe_plan(plan: Plan, scan: Scan, features: FeatureConfig, config: BuildConfig) -> str:
    """What a build would write (``build --dry-run``): utterances, hours, buckets, shards, the
    expected size, and what it rejects before decoding, by reason."""
    counts = np.diff(plan.shards[:, 1:], axis=1)[:, 0] if len(plan) else np.zeros(0, np.int64)
    lines = [
        f"plan {plan.digest}: {len(plan.members)} utterances, {plan.seconds / 3600:.3f} h in "
        f"{len(plan)} shards, about {plan.estimated_bytes / 1e9:.2f} GB",
        "",
        "bucket  seconds        frames       utts  shards",
    ]
    for bucket in plan.buckets:
        mine = plan.shards[:, 0] == bucket.bucket
        lines.append(
            f"{bucket.bucket:>6}  {bucket.min_seconds:>5.2f}–{bucket.max_seconds:<6.2f}  "
            f"{bucket.min_frames:>5}–{bucket.max_frames:<5}  {int(counts[mine].sum()):>5}  "
            f"{int(mine.sum()):>6}"
        )
    rejected = Counter(reason_kind(r.reason) for r in scan.rejections())
    rejected.update(
        reason_kind(r.reason) for r in length_rejections(plan, scan, config, features.sample_rate)
    )
    if scan.filtered:
        lines += ["", f"left out by --where: {scan.filtered}"]
    lines += ["", f"rejected before decoding: {sum(rejected.values())}"]
    lines += [f"  {n:>6}  {reason}" for reason, n in sorted(rejected.items())]
    return "\n".join(lines)


def plot_cache(
    cache: Path, out_dir: Path, *, batch_frames: int, max_batch_size: int, examples: int = 3
) -> list[Path]:
    """Write durations.png, mels.png and rejected.png into ``out_dir``; return their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("inspect --png needs matplotlib: pip install 'melcache[plot]'") from None
    index = read_index(cache)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = _read_samples(cache, index)
    paths = [out_dir / "durations.png", out_dir / "mels.png", out_dir / "rejected.png"]
    _plot_durations(plt, index, samples, batch_frames, max_batch_size, paths[0])
    _plot_mels(plt, index, samples, examples, paths[1])
    _plot_rejected(plt, index, paths[2])
    return paths


def _read_samples(cache: Path, index: dict[str, Any]) -> list[dict[str, Any]]:
    """Metadata (and the mel, for the first sample of each shard) of up to 16 shards per bucket."""
    taken: dict[int, int] = {}
    samples: list[dict[str, Any]] = []
    n_mels = index["features"]["n_mels"]
    hop_seconds = index["features"]["hop_length"] / index["features"]["sample_rate"]
    for shard in index["shards"]:
        if taken.setdefault(shard["bucket"], 0) >= SHARDS_PER_BUCKET:
            continue
        taken[shard["bucket"]] += 1
        location = member_location(cache, shard["name"])
        for i, raw in enumerate(read_shard(location, shard, ShardCheck("off"))):
            meta = {"shard": shard["name"], "seconds": raw.frames * hop_seconds}
            meta.update(text=raw.text, frames=raw.frames, bucket=raw.bucket)
            if i == 0:
                mel = decode_mel(raw.mel, raw.storage, n_mels, f"{location}:{raw.key}")
                meta["mel"] = mel.copy()
            samples.append(meta)
    return samples


def bucket_padding(
    frames_by_shard: dict[str, list[int]], batch_frames: int, max_batch_size: int
) -> float:
    """Padded ÷ all frames when the loader batches these shards under ``batch_frames``."""
    real = padded = 0
    for number, frames in enumerate(frames_by_shard.values()):
        batches = plan_batches(
            frames,
            rng=make_rng(0, number),
            batch_frames=batch_frames,
            max_batch_size=max_batch_size,
            pad_multiple=8,
        )
        for batch in batches:
            lengths = [frames[i] for i in batch]
            real += sum(lengths)
            padded += len(lengths) * round_up(max(lengths), 8)
    return padding_fraction(real, padded)


def _plot_durations(
    plt: Any,
    index: dict[str, Any],
    samples: list[dict[str, Any]],
    batch_frames: int,
    max_batch_size: int,
    path: Path,
) -> None:
    figure, axis = plt.subplots(figsize=(10, 4.5))
    seconds = [s["seconds"] for s in samples]
    axis.hist(seconds, bins=min(80, max(10, len(seconds) // 4)), color="#4c72b0")
    top = axis.get_ylim()[1]
    for bucket in index["buckets"]:
        axis.axvline(bucket["min_seconds"], color="#c44e52", linewidth=1)
        shards: dict[str, list[int]] = {}
        for s in samples:
            if s["bucket"] == bucket["bucket"]:
                shards.setdefault(s["shard"], []).append(s["frames"])
        if shards:
            share = bucket_padding(shards, batch_frames, max_batch_size)
            middle = (bucket["min_seconds"] + min(bucket["max_seconds"], max(seconds))) / 2
            axis.text(
                middle, top * 0.95, f"{share:.1%}", ha="center", va="top", fontsize=8, rotation=90
            )
    axis.set_xlabel("utterance duration (s)")
    axis.set_ylabel("utterances")
    total = index["totals"]["utterances"]
    counted = f"{len(seconds)} utterances" if len(seconds) == total else (
        f"{len(seconds)} of {total} utterances (up to {SHARDS_PER_BUCKET} shards a bucket read)"
    )  # fmt: skip
    axis.set_title(
        f"{counted}; red: bucket edges; text: padding at batch_frames={batch_frames}", fontsize=10
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_mels(
    plt: Any, index: dict[str, Any], samples: list[dict[str, Any]], examples: int, path: Path
) -> None:
    chosen = [s for s in samples if "mel" in s]
    chosen = [chosen[int(i)] for i in np.linspace(0, len(chosen) - 1, min(examples, len(chosen)))]
    if not chosen:  # an empty cache: every utterance was rejected
        figure, axis = plt.subplots(figsize=(10, 2.6))
        axis.text(0.5, 0.5, "no utterance in this cache", ha="center", va="center")
        axis.set_axis_off()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return
    figure, axes = plt.subplots(len(chosen), 1, figsize=(10, 2.6 * len(chosen)), squeeze=False)
    hop_seconds = index["features"]["hop_length"] / index["features"]["sample_rate"]
    for axis, sample in zip(axes[:, 0], chosen, strict=True):
        mel = sample["mel"].astype(np.float32).T
        axis.imshow(
            mel,
            origin="lower",
            aspect="auto",
            extent=(0, mel.shape[1] * hop_seconds, 0, mel.shape[0]),
        )
        text = sample["text"] if len(sample["text"]) <= 90 else sample["text"][:87] + "…"
        axis.set_title(text, fontsize=9)
        axis.set_ylabel("mel band")
    axes[-1, 0].set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _plot_rejected(plt: Any, index: dict[str, Any], path: Path) -> None:
    reasons = index["totals"]["rejected_by_reason"]
    figure, axis = plt.subplots(figsize=(8, 1.5 + 0.4 * max(1, len(reasons))))
    if reasons:
        axis.barh(list(reasons), list(reasons.values()), color="#dd8452")
        axis.invert_yaxis()
        axis.set_xlabel("utterances")
    else:
        axis.text(0.5, 0.5, "nothing rejected", ha="center", va="center")
        axis.set_axis_off()
    totals = index["totals"]
    axis.set_title(f"rejected: {totals['rejected']} of {totals['discovered']} discovered")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
