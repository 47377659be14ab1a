"""Write one shard and its receipt (in a pool worker); read the receipts back.

Each shard is written under a temporary name, renamed when complete, then acknowledged by a
receipt in ``OUT/.build/``: its count, digests (sha256, xxh3_128), rejections, feature sums,
and which plan and recipe (corpus and config) it belongs to; its table rows are made as it is
written and kept beside the receipt. Transcripts are read again from the corpus here and must
hash as the scan saw them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from melcache.bounded import read_json
from melcache.codec import encode_mel
from melcache.errors import UserError
from melcache.extras import META_FIELD, value_problem
from melcache.features import FeatureConfig
from melcache.format import encode_sample, temp_path, write_atomic
from melcache.storage import FP16, MEL_MEMBERS
from melcache.tar.writer import HashingStream, SampleTarWriter, open_tar_writer
from preprocess.config import BuildConfig
from preprocess.inputs.archives import audio_input
from preprocess.inputs.audio import AudioError, encode_flac, load_mono
from preprocess.inputs.corpus import read_transcript
from preprocess.inputs.records import RECEIPTS, Corpus, clean_text, utterance_hash
from preprocess.job.pool import keep_freed_memory
from preprocess.plan.shard_plan import Plan, PlannedShard, PlannedUtterance
from preprocess.write.extractor import MelExtractor
from preprocess.write.index_table import RowsBuilder, save_shard_rows

log = logging.getLogger(__name__)

# ---- pool ------------------------------------------------------------------------------
_extractor: MelExtractor | None = None


def init_worker(features: FeatureConfig) -> None:
    # One thread per process: processes already use every core, and a fixed thread count
    # keeps float sums (hence fp16 bytes) identical whatever --workers is.
    global _extractor
    torch.set_num_threads(1)
    keep_freed_memory()
    _extractor = MelExtractor(features)


def build_shard_job(
    job: tuple[PlannedShard, Corpus, Path, FeatureConfig, BuildConfig, bool, str],
) -> dict[str, Any]:
    return build_shard(*job)


# ---- one shard -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Tally:
    """What one shard's writer has seen so far."""

    sums: np.ndarray
    squares: np.ndarray
    rows: RowsBuilder
    frames: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    digests: dict[str, str] = dataclasses.field(default_factory=dict)  # sha256, xxh3_128
    rejected: list[dict[str, str]] = dataclasses.field(default_factory=list)
    # Samples made but not yet written: (key, meta, mel member bytes, flac bytes or None).
    pending: list[tuple[str, dict[str, Any], bytes, bytes | None]] = dataclasses.field(
        default_factory=list
    )


# Samples written together: written one by one between two mels, the tar headers, json and
# hashing found their code cold in the caches; a group costs ~16 x 100 KB of memory.
_GROUP = 16


def build_shard(
    task: PlannedShard,
    corpus: Corpus,
    out: Path,
    features: FeatureConfig,
    config: BuildConfig,
    keep_audio: bool,
    digest: str,
) -> dict[str, Any]:
    """Decode, featurise and write one shard atomically; then write and return its receipt."""
    # A per-process temp name: an orphaned worker of a killed build cannot scribble on a rerun's.
    final = out / task.name
    temp = temp_path(final)
    zeros = np.zeros(features.n_mels, np.float64)
    tally = _Tally(zeros, zeros.copy(), RowsBuilder(MEL_MEMBERS[config.storage], keep_audio))
    try:
        with open(temp, "wb") as raw:
            stream = HashingStream(raw)
            with open_tar_writer(stream) as writer:
                for item, said in zip(task.items, _transcripts(task, corpus), strict=True):
                    _write_utterance(
                        writer, item, said, corpus, task.bucket, features, config, keep_audio, tally
                    )
                _write_pending(writer, tally, MEL_MEMBERS[config.storage])
        tally.digests = stream.hexdigests()
        if tally.frames:
            os.replace(temp, final)
            save_shard_rows(final, tally.rows.finish(), tally.digests["sha256"])
        else:  # every utterance was rejected: no empty tar, the receipt says so
            temp.unlink()
        receipt = _receipt(task, final, digest, recipe(corpus, features, config, keep_audio), tally)
        write_atomic(out / RECEIPTS / f"{task.name}.json", json.dumps(receipt).encode())
    except OSError as exc:
        raise UserError(
            f"cannot write {final}: {exc.strerror}; free space and rerun to resume"
        ) from None
    finally:
        temp.unlink(missing_ok=True)  # renamed when complete; whatever failed leaves nothing
    return receipt


_Transcript = tuple[str | None, str | None, dict[str, Any]]  # text, speaker, the row's fields


def _transcripts(task: PlannedShard, corpus: Corpus) -> list[_Transcript]:
    """Each utterance's text, speaker and row fields, read again from the corpus (not held for
    the whole corpus) and checked against the hash the scan saw. A shard's all at once: read
    between two utterances' mels, each found this code cold in the caches (92 µs, not 24)."""
    found = []
    for item in task.items:
        said: _Transcript = (None, None, {})
        try:
            said = read_transcript(corpus, item.source, item.locator)
            content = utterance_hash(item.source, said[0], said[1])
        except ValueError as exc:
            content = str(exc)
        if content != item.content:
            detail = f" ({content})" if isinstance(content, str) else ""
            raise UserError(
                f"{corpus.audio_path(item.source)}: transcript or speaker changed since the "
                f"corpus was scanned{detail}; rerun with --rescan"
            )
        found.append(said)
    return found


def _write_utterance(
    writer: SampleTarWriter,
    item: PlannedUtterance,
    said: _Transcript,
    corpus: Corpus,
    bucket: int,
    features: FeatureConfig,
    config: BuildConfig,
    keep_audio: bool,
    tally: _Tally,
) -> None:
    assert _extractor is not None, "worker not initialised"  # internal invariant, not user input
    text, speaker, row = said
    extras = {name: row.get(name) for name in config.extras}
    bad = next(((n, p) for n, v in extras.items() if (p := value_problem(v))), None)
    if bad is not None:
        reason = f"field {bad[0]!r} (build.extras) {bad[1]}"
        tally.rejected.append({"source": item.source, "reason": reason, "stage": "decode"})
        return
    try:
        audio = load_mono(
            audio_input(corpus, item.source, item.audio_at),
            features.sample_rate,
            item.samples,
            config.silence_dbfs,
            tolerance=features.hop_length,
        )
    except AudioError as exc:
        tally.rejected.append({"source": item.source, "reason": str(exc), "stage": "decode"})
        return
    mel16, mel32 = _extractor.compute(audio)
    # Cast once and square in place: the same float64 sums, bit for bit, as summing with
    # dtype=float64 and squaring into a float64 array, for one cast instead of two.
    mel64 = mel32.astype(np.float64)
    sums = mel64.sum(axis=0)  # a non-finite value makes its column's sum so
    if not np.isfinite(sums).all():  # finite float audio far beyond ±1 overflows the spectrum
        reason = "non-finite mel: audio samples far outside [-1, 1]"
        tally.rejected.append({"source": item.source, "reason": reason, "stage": "decode"})
        return
    meta = {
        "text": clean_text(text or ""),
        "speaker": speaker,
        "seconds": round(item.samples / features.sample_rate, 4),
        "frames": int(mel16.shape[0]),
        "sample_rate": features.sample_rate,
        "source": item.source,
        "bucket": bucket,
        # Absent without: old shards unchanged. In name order, as the json member holds them
        # and as the table's rows made from it have them.
        **({META_FIELD: dict(sorted(extras.items()))} if extras else {}),
    }
    flac = encode_flac(audio, features.sample_rate) if keep_audio else None
    stored = encode_mel(mel16 if config.storage == FP16 else mel32, config.storage)
    tally.pending.append((item.key, meta, stored, flac))
    if len(tally.pending) == _GROUP:
        _write_pending(writer, tally, MEL_MEMBERS[config.storage])
    tally.sums += sums
    tally.squares += np.square(mel64, out=mel64).sum(axis=0)
    tally.frames.append(meta["frames"])
    tally.seconds += meta["seconds"]


def _write_pending(writer: SampleTarWriter, tally: _Tally, mel_member: str) -> None:
    """Write the samples made so far, in order, and add their table rows."""
    for key, meta, stored, flac in tally.pending:
        written = writer.write(encode_sample(key, stored, meta, flac, mel_member))
        tally.rows.add(key, meta, written.spans, written.data, meta["source"], written.offset)
    tally.pending.clear()


def _receipt(
    task: PlannedShard, final: Path, digest: str, made_by: str, tally: _Tally
) -> dict[str, Any]:
    frames = tally.frames
    return {
        "plan": digest,
        "recipe": made_by,
        "name": task.name,
        "bucket": task.bucket,
        "planned": len(task.items),
        "samples": len(frames),
        "frames": sum(frames),
        "min_frames": min(frames, default=0),
        "max_frames": max(frames, default=0),
        "seconds": tally.seconds,
        "bytes": final.stat().st_size if frames else 0,
        "sha256": tally.digests["sha256"] if frames else None,
        "xxh3_128": tally.digests["xxh3_128"] if frames else None,
        "rejected": tally.rejected,
        "mel_sum": tally.sums.tolist(),
        "mel_sum_squares": tally.squares.tolist(),
    }


def recipe(corpus: Corpus, features: FeatureConfig, config: BuildConfig, keep_audio: bool) -> str:
    """Which corpus (by place) and config a build is of, whatever the corpus now holds."""
    what = [
        *corpus.identity(),
        features.to_dict(),
        config.to_dict(),
        keep_audio,
    ]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def valid_receipts(
    out: Path,
    plan: Plan,
    made_by: str,
    complete: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, dict[str, Any]]:
    """Receipts of shards already complete for this very plan (by default: the shard is in
    ``out`` at its size; ``complete`` judges otherwise, e.g. by a store's listing). Receipts
    of an earlier plan of the same corpus and config (the corpus changed since) are dropped
    with their shards, to be written again; another corpus's or config's are refused."""
    done: dict[str, dict[str, Any]] = {}
    planned = {plan.name(i) for i in range(len(plan))}
    stale = 0
    for path in sorted((out / RECEIPTS).glob("*.json")):
        try:
            receipt = read_json(path)
        except (OSError, ValueError):
            continue  # a receipt is written atomically; unreadable means foreign: rebuild
        if receipt.get("plan") != plan.digest and receipt.get("recipe") == made_by:
            stale += 1
            path.unlink(missing_ok=True)
            if receipt.get("name") not in planned:  # no longer in the plan: not overwritten
                (out / str(receipt.get("name"))).unlink(missing_ok=True)
            continue
        if receipt.get("plan") != plan.digest:
            raise UserError(
                f"--out {out} holds a build of a different corpus or config "
                f"({path.name} has plan {receipt.get('plan')}, this build is {plan.digest}); "
                "use another --out or delete that folder"
            )
        if receipt["name"] in planned and (complete or _shard_here(out))(receipt):
            done[receipt["name"]] = receipt
    if stale:
        log.info("%d shards of an earlier scan of this corpus are written again", stale)
    return done


def _shard_here(out: Path) -> Callable[[dict[str, Any]], bool]:
    """Whether a receipt's shard is complete in ``out`` (none is written when it is empty)."""

    def complete(receipt: dict[str, Any]) -> bool:
        shard = out / receipt["name"]
        return receipt["samples"] == 0 or (
            shard.is_file() and shard.stat().st_size == receipt["bytes"]
        )

    return complete
