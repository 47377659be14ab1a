"""``preprocess build``: discover → probe headers → plan → write shards in parallel → index.

Each shard is written under a temporary name, renamed when complete, then acknowledged by a
receipt in ``OUT/.build/`` (its count, sha256, rejections and feature sums). A rerun skips
every shard with a valid receipt, so a build killed at any moment resumes where it was and
ends byte-identical to an uninterrupted one. The index is written last, from the receipts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from melcache.errors import UserError
from melcache.features import FeatureConfig
from melcache.format import (
    HashingStream,
    encode_sample,
    open_tar_writer,
    temp_path,
    write_atomic,
)
from preprocess.audio import AudioError, encode_flac, load_mono, probe
from preprocess.config import BuildConfig
from preprocess.discover import Rejection, Utterance, discover
from preprocess.features import MelExtractor
from preprocess.finish import finish_cache
from preprocess.owners import running_build, sweep_temps
from preprocess.parallel import Runner, ordered_map
from preprocess.plan import Plan, PlannedShard, PlannedUtterance, make_plan

log = logging.getLogger(__name__)
RECEIPTS = ".build"


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """What ``build`` was asked to do, beyond the config."""

    src: Path
    out: Path
    workers: int
    part: tuple[int, int] = (0, 1)
    keep_audio: bool = False


def build(
    options: BuildOptions, features: FeatureConfig, config: BuildConfig
) -> dict[str, Any] | None:
    """Build (or resume) the cache; return the index, or ``None`` if other parts are pending."""
    utterances, discovered_rejections = discover(options.src)
    log.info(
        "found %d utterances (%d rejected while discovering)",
        len(utterances),
        len(discovered_rejections),
    )
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / RECEIPTS).mkdir(exist_ok=True)
    with running_build(options.out / RECEIPTS):
        return _build(options, features, config, utterances, discovered_rejections)


def _build(
    options: BuildOptions,
    features: FeatureConfig,
    config: BuildConfig,
    utterances: list[Utterance],
    discovered_rejections: list[Rejection],
) -> dict[str, Any] | None:
    with ordered_map(options.workers, _init_worker, (features,)) as run:
        headers = list(
            tqdm(
                run(_probe, [u.audio for u in utterances], 256),
                total=len(utterances),
                desc="probe",
                unit="file",
                disable=None,
            )
        )
        plan = make_plan(utterances, headers, features, config, options.keep_audio)
        receipts = _valid_receipts(options.out, plan)
        k, n = options.part
        todo = [t for t in plan.shards if t.number % n == k and t.name not in receipts]
        _write_shards(run, todo, options, features, config, plan.digest, receipts)
    if len(receipts) < len(plan.shards):
        log.info(
            "part %d/%d done: %d of %d shards complete; the index is written once all parts are",
            k,
            n,
            len(receipts),
            len(plan.shards),
        )
        return None
    sweep_temps(options.out)  # every shard is complete: what is left was killed mid-write
    rejections = [*discovered_rejections, *plan.rejections]
    return finish_cache(
        options.out,
        plan,
        [receipts[t.name] for t in plan.shards],
        rejections,
        features,
        config,
        options.keep_audio,
    )


def _write_shards(
    run: Runner,
    todo: Sequence[PlannedShard],
    options: BuildOptions,
    features: FeatureConfig,
    config: BuildConfig,
    digest: str,
    receipts: dict[str, dict[str, Any]],
) -> None:
    jobs = [(t, options.out, features, config, options.keep_audio, digest) for t in todo]
    total = sum(len(t.items) for t in todo)
    seconds = 0.0
    with tqdm(total=total, desc="build", unit="utt", disable=None) as bar:
        for receipt in run(_build_shard_job, jobs):
            receipts[receipt["name"]] = receipt
            seconds += receipt["seconds"]
            bar.set_postfix(hours=f"{seconds / 3600:.2f}", refresh=False)
            bar.update(receipt["planned"])


# ---- pool ------------------------------------------------------------------------------
_extractor: MelExtractor | None = None


def _init_worker(features: FeatureConfig) -> None:
    # One thread per process: processes already use every core, and a fixed thread count
    # keeps float sums (hence fp16 bytes) identical whatever --workers is.
    global _extractor
    torch.set_num_threads(1)
    _extractor = MelExtractor(features)


def _probe(path: str) -> tuple[int, int] | str:
    try:
        return probe(path)
    except AudioError as exc:
        return str(exc)


def _build_shard_job(
    job: tuple[PlannedShard, Path, FeatureConfig, BuildConfig, bool, str],
) -> dict[str, Any]:
    return build_shard(*job)


# ---- one shard -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Tally:
    """What one shard's writer has seen so far."""

    sums: np.ndarray
    squares: np.ndarray
    frames: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    sha256: str = ""
    rejected: list[dict[str, str]] = dataclasses.field(default_factory=list)


def build_shard(
    task: PlannedShard,
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
    tally = _Tally(np.zeros(features.n_mels, np.float64), np.zeros(features.n_mels, np.float64))
    try:
        with open(temp, "wb") as raw:
            stream = HashingStream(raw)
            with open_tar_writer(stream) as writer:
                for item in task.items:
                    _write_utterance(writer, item, task.bucket, features, config, keep_audio, tally)
        tally.sha256 = stream.sha256.hexdigest()
        if tally.frames:
            os.replace(temp, final)
        else:  # every utterance was rejected: no empty tar, the receipt says so
            temp.unlink()
        receipt = _receipt(task, final, digest, tally)
        write_atomic(out / RECEIPTS / f"{task.name}.json", json.dumps(receipt).encode())
    except OSError as exc:
        raise UserError(
            f"cannot write {final}: {exc.strerror}; free space and rerun to resume"
        ) from None
    finally:
        temp.unlink(missing_ok=True)  # renamed when complete; whatever failed leaves nothing
    return receipt


def _write_utterance(
    writer: Any,
    item: PlannedUtterance,
    bucket: int,
    features: FeatureConfig,
    config: BuildConfig,
    keep_audio: bool,
    tally: _Tally,
) -> None:
    assert _extractor is not None, "worker not initialised"  # internal invariant, not user input
    utt = item.utterance
    try:
        audio = load_mono(utt.audio, features.sample_rate, item.samples, config.silence_dbfs)
    except AudioError as exc:
        tally.rejected.append({"source": utt.source, "reason": str(exc), "stage": "decode"})
        return
    mel16, mel32 = _extractor.compute(audio)
    sums = mel32.sum(axis=0, dtype=np.float64)  # a non-finite value makes its column's sum so
    if not np.isfinite(sums).all():  # finite float audio far beyond ±1 overflows the spectrum
        reason = "non-finite mel: audio samples far outside [-1, 1]"
        tally.rejected.append({"source": utt.source, "reason": reason, "stage": "decode"})
        return
    meta = {
        "text": utt.text,
        "speaker": utt.speaker,
        "seconds": round(item.samples / features.sample_rate, 4),
        "frames": int(mel16.shape[0]),
        "sample_rate": features.sample_rate,
        "source": utt.source,
        "bucket": bucket,
    }
    flac = encode_flac(audio, features.sample_rate) if keep_audio else None
    writer.write(encode_sample(utt.key, mel16, meta, flac))
    tally.sums += sums
    tally.squares += np.square(mel32, dtype=np.float64).sum(axis=0)
    tally.frames.append(meta["frames"])
    tally.seconds += meta["seconds"]


def _receipt(task: PlannedShard, final: Path, digest: str, tally: _Tally) -> dict[str, Any]:
    frames = tally.frames
    return {
        "plan": digest,
        "name": task.name,
        "bucket": task.bucket,
        "planned": len(task.items),
        "samples": len(frames),
        "frames": sum(frames),
        "min_frames": min(frames, default=0),
        "max_frames": max(frames, default=0),
        "seconds": tally.seconds,
        "bytes": final.stat().st_size if frames else 0,
        "sha256": tally.sha256 if frames else None,
        "rejected": tally.rejected,
        "mel_sum": tally.sums.tolist(),
        "mel_sum_squares": tally.squares.tolist(),
    }


def _valid_receipts(out: Path, plan: Plan) -> dict[str, dict[str, Any]]:
    """Receipts of shards already complete for this very plan; refuse another build's."""
    done: dict[str, dict[str, Any]] = {}
    planned = {t.name for t in plan.shards}
    for path in sorted((out / RECEIPTS).glob("*.json")):
        try:
            receipt = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a receipt is written atomically; unreadable means foreign: rebuild
        if receipt.get("plan") != plan.digest:
            raise UserError(
                f"--out {out} holds a build of a different corpus or config "
                f"({path.name} has plan {receipt.get('plan')}, this build is {plan.digest}); "
                "use another --out or delete that folder"
            )
        shard = out / receipt["name"]
        if receipt["name"] in planned and (
            receipt["samples"] == 0
            or (shard.is_file() and shard.stat().st_size == receipt["bytes"])
        ):
            done[receipt["name"]] = receipt
    return done
