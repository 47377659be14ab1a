"""``preprocess build``: scan → plan → write shards in parallel → index.

Each part scans its share of the corpus (:mod:`preprocess.scan`); the plan is made from all
the scans and saved beside them (:mod:`preprocess.plan`). Each shard is written under a
temporary name, renamed when complete, then acknowledged by a receipt in ``OUT/.build/``
(its count, sha256, rejections and feature sums). A rerun reuses the scans and the plan of
an unchanged corpus and skips every shard with a valid receipt, so a build killed at any
moment resumes where it was and ends byte-identical to an uninterrupted one. The index is
written last, from the receipts, by the part that finds them all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from melcache.errors import UserError
from melcache.features import FeatureConfig
from melcache.format import (
    FORMAT_VERSION,
    HashingStream,
    encode_sample,
    open_tar_writer,
    temp_path,
    write_atomic,
)
from preprocess.audio import AudioError, encode_flac, load_mono
from preprocess.config import BuildConfig
from preprocess.features import MelExtractor
from preprocess.finish import finish_cache
from preprocess.owners import running_build, sweep_temps
from preprocess.parallel import Runner, ordered_map
from preprocess.parts import Meeting
from preprocess.plan import (
    Plan,
    PlannedShard,
    PlannedUtterance,
    length_rejections,
    load_plan,
    make_plan,
    planned_shard,
    save_plan,
)
from preprocess.scan import Scan, part_folder, scan_folder, scan_is_current, scan_meta, scan_part
from preprocess.sources import Corpus, clean_text, open_corpus, read_transcript, utterance_hash

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
    dry_run: bool = False
    rescan: bool = False


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a build ended: the index once the cache is complete, the plan after a dry run
    (``None`` while other parts still scan), or how many shards remain for other parts."""

    index: dict[str, Any] | None = None
    plan: Plan | None = None
    scan: Scan | None = None
    remaining: int = 0


def build(options: BuildOptions, features: FeatureConfig, config: BuildConfig) -> Outcome:
    """Build (or resume) this part of the cache; with ``dry_run``, scan and plan only."""
    corpus = open_corpus(options.src, options.out)
    state = options.out / RECEIPTS
    state.mkdir(parents=True, exist_ok=True)
    meeting = Meeting(*options.part)
    try:
        with (
            running_build(state, options.part),
            ordered_map(options.workers, _init_worker, (features,)) as run,
        ):
            prepared = _scan_and_plan(corpus, options, features, config, run, meeting)
            if prepared is None or options.dry_run:
                return Outcome(plan=prepared and prepared[1], scan=prepared and prepared[0])
            scan, plan = prepared
            made_by = recipe(corpus, features, config, options.keep_audio)
            receipts = _valid_receipts(options.out, plan, made_by)
            k, n = options.part
            todo = [i for i in range(len(plan)) if i % n == k and plan.name(i) not in receipts]
            tasks = (planned_shard(plan, scan, i) for i in todo)
            _write_shards(run, tasks, todo, plan, corpus, options, features, config, receipts)
        meeting.barrier()  # under torchrun: every rank's shards are written
        return _finish(options, features, config, corpus, scan, plan, meeting)
    finally:
        meeting.close()


def _scan_and_plan(
    corpus: Corpus,
    options: BuildOptions,
    features: FeatureConfig,
    config: BuildConfig,
    run: Runner,
    meeting: Meeting,
) -> tuple[Scan, Plan] | None:
    """Scan this part's share unless a current scan is there; once every part's scan is,
    load the plan made from them or make it. ``None``: a dry run whose other parts are due."""
    k, n = options.part
    state, rate = options.out / RECEIPTS, features.sample_rate
    own = part_folder(state, k, n)
    if not options.rescan and scan_is_current(own, corpus, rate):
        log.info("part %d/%d: the scan in %s is current; not scanning again", k, n, own)
    else:
        shutil.rmtree(own, ignore_errors=True)
        scan_part(corpus, own, k, n, rate, run, options.workers)
    listing = (scan_meta(own) or {}).get("listing")

    def scanned() -> int:  # parts whose scan saw the corpus as this one's did
        metas = (scan_meta(part_folder(state, j, n)) for j in range(n))
        return sum(1 for m in metas if m is not None and m.get("listing") == listing)

    if options.dry_run and not meeting.collective and scanned() < n:
        log.info(
            "part %d/%d scanned; %d of %d parts' scans are done: the plan is made once all are",
            k,
            n,
            scanned(),
            n,
        )
        return None
    meeting.wait("scans", scanned)
    scan = Scan(scan_folder(state, n), n)
    if not scan.has_inputs():
        raise UserError(f"--src {options.src} holds no audio files")
    inputs = _plan_inputs(scan, features, config, options.keep_audio)
    folder = scan_folder(state, n) / "plan"
    plan = None if meeting.collective and k != 0 else load_plan(folder, inputs)
    if plan is None and not (meeting.collective and k != 0):
        plan = make_plan(scan, features, config, options.keep_audio)
        save_plan(plan, folder, inputs)
    meeting.barrier()  # under torchrun: rank 0 has saved the plan
    plan = plan or load_plan(folder, inputs)
    assert plan is not None, "rank 0 saved the plan before the barrier"  # internal invariant
    return scan, plan


def _plan_inputs(scan: Scan, features: FeatureConfig, config: BuildConfig, keep_audio: bool) -> str:
    """What a saved plan was made from: the config and the identity of every part's scan."""
    inputs = [FORMAT_VERSION, features.to_dict(), config.to_dict(), keep_audio]
    inputs += [meta["scan_id"] for meta in scan.metas]
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _finish(
    options: BuildOptions,
    features: FeatureConfig,
    config: BuildConfig,
    corpus: Corpus,
    scan: Scan,
    plan: Plan,
    meeting: Meeting,
) -> Outcome:
    """Write the index if every shard is complete (by rank 0 under torchrun)."""
    made_by = recipe(corpus, features, config, options.keep_audio)
    receipts = _valid_receipts(options.out, plan, made_by)
    k, n = options.part
    remaining = len(plan) - len(receipts)
    if remaining or (meeting.collective and k != 0):
        log.info(
            "part %d/%d done: %d of %d shards complete, %d remain for the other parts; "
            "the index is written once all are",
            k,
            n,
            len(receipts),
            len(plan),
            remaining,
        )
        return Outcome(remaining=remaining)
    # Every shard is complete: temporary files and scan folders left are of killed writers.
    sweep_temps(options.out)
    sweep_temps(scan_folder(options.out / RECEIPTS, options.part[1]))
    rejections = [*scan.rejections(), *length_rejections(plan, scan, config, features.sample_rate)]
    index = finish_cache(
        options.out,
        plan,
        [receipts[plan.name(i)] for i in range(len(plan))],
        rejections,
        features,
        config,
        options.keep_audio,
    )
    return Outcome(index=index)


def _write_shards(
    run: Runner,
    tasks: Any,
    todo: Sequence[int],
    plan: Plan,
    corpus: Corpus,
    options: BuildOptions,
    features: FeatureConfig,
    config: BuildConfig,
    receipts: dict[str, dict[str, Any]],
) -> None:
    jobs = (
        (t, corpus, options.out, features, config, options.keep_audio, plan.digest) for t in tasks
    )
    total = sum(len(plan.shard_members(i)) for i in todo)
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


def _build_shard_job(
    job: tuple[PlannedShard, Corpus, Path, FeatureConfig, BuildConfig, bool, str],
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
    tally = _Tally(np.zeros(features.n_mels, np.float64), np.zeros(features.n_mels, np.float64))
    try:
        with open(temp, "wb") as raw:
            stream = HashingStream(raw)
            with open_tar_writer(stream) as writer:
                for item in task.items:
                    _write_utterance(
                        writer, item, corpus, task.bucket, features, config, keep_audio, tally
                    )
        tally.sha256 = stream.sha256.hexdigest()
        if tally.frames:
            os.replace(temp, final)
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


def _write_utterance(
    writer: Any,
    item: PlannedUtterance,
    corpus: Corpus,
    bucket: int,
    features: FeatureConfig,
    config: BuildConfig,
    keep_audio: bool,
    tally: _Tally,
) -> None:
    assert _extractor is not None, "worker not initialised"  # internal invariant, not user input
    try:  # transcripts are read again here, not held for the whole corpus
        text, speaker = read_transcript(corpus, item.source, item.locator)
        content = utterance_hash(item.source, text, speaker)
    except ValueError as exc:
        content = str(exc)
    if content != item.content:
        detail = f" ({content})" if isinstance(content, str) else ""
        raise UserError(
            f"{corpus.audio_path(item.source)}: transcript or speaker changed since the corpus "
            f"was scanned{detail}; rerun with --rescan"
        )
    try:
        audio = load_mono(
            corpus.audio_path(item.source),
            features.sample_rate,
            item.samples,
            config.silence_dbfs,
            tolerance=features.hop_length,
        )
    except AudioError as exc:
        tally.rejected.append({"source": item.source, "reason": str(exc), "stage": "decode"})
        return
    mel16, mel32 = _extractor.compute(audio)
    sums = mel32.sum(axis=0, dtype=np.float64)  # a non-finite value makes its column's sum so
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
    }
    flac = encode_flac(audio, features.sample_rate) if keep_audio else None
    writer.write(encode_sample(item.key, mel16, meta, flac))
    tally.sums += sums
    tally.squares += np.square(mel32, dtype=np.float64).sum(axis=0)
    tally.frames.append(meta["frames"])
    tally.seconds += meta["seconds"]


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
        "sha256": tally.sha256 if frames else None,
        "rejected": tally.rejected,
        "mel_sum": tally.sums.tolist(),
        "mel_sum_squares": tally.squares.tolist(),
    }


def recipe(corpus: Corpus, features: FeatureConfig, config: BuildConfig, keep_audio: bool) -> str:
    """Which corpus (by place) and config a build is of, whatever the corpus now holds."""
    what = [
        corpus.kind,
        corpus.root,
        corpus.listing,
        features.to_dict(),
        config.to_dict(),
        keep_audio,
    ]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _valid_receipts(out: Path, plan: Plan, made_by: str) -> dict[str, dict[str, Any]]:
    """Receipts of shards already complete for this very plan. Receipts of an earlier plan of
    the same corpus and config (the corpus changed since) are dropped with their shards, to
    be written again; another corpus's or config's are refused."""
    done: dict[str, dict[str, Any]] = {}
    planned = {plan.name(i) for i in range(len(plan))}
    stale = 0
    for path in sorted((out / RECEIPTS).glob("*.json")):
        try:
            receipt = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
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
        shard = out / receipt["name"]
        if receipt["name"] in planned and (
            receipt["samples"] == 0
            or (shard.is_file() and shard.stat().st_size == receipt["bytes"])
        ):
            done[receipt["name"]] = receipt
    if stale:
        log.info("%d shards of an earlier scan of this corpus are written again", stale)
    return done
