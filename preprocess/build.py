"""``preprocess build``: scan → plan → write shards in parallel → index.

Each part scans its share of the corpus (:mod:`preprocess.plan.scan`); the plan is made from all
the scans and saved beside them (:mod:`preprocess.plan.shard_plan`). Each shard is written whole and
acknowledged by a receipt (:mod:`preprocess.write.mel_shard`). A rerun reuses the scans and the plan of
an unchanged corpus and skips every shard with a valid receipt, so a build killed at any
moment resumes where it was and ends byte-identical to an uninterrupted one. The index is
written last, from the receipts, by the part that finds them all. With ``--out s3://…`` the
build is staged in a local folder and each shard published as it is finished; the parts then
meet through the store (:mod:`preprocess.write.staged`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from melcache.errors import UserError
from melcache.features import FeatureConfig
from melcache.format import (
    FORMAT_VERSION,
)
from preprocess.config import BuildConfig
from preprocess.inputs.corpus import open_corpus
from preprocess.inputs.records import RECEIPTS, Corpus
from preprocess.job.owners import running_build, sweep_temps
from preprocess.job.part import Meeting
from preprocess.job.pool import Runner, ordered_map
from preprocess.plan.scan import (
    Scan,
    part_folder,
    scan_folder,
    scan_is_current,
    scan_meta,
    scan_part,
)
from preprocess.plan.shard_plan import (
    Plan,
    length_rejections,
    load_plan,
    make_plan,
    planned_shard,
    save_plan,
)
from preprocess.write.finish import finish_cache
from preprocess.write.mel_shard import (
    build_shard_job,
    init_worker,
    recipe,
    valid_receipts,
)
from preprocess.write.staged import StoreOut

log = logging.getLogger(__name__)


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
    where: str | None = None
    columns: str | None = None
    said: str = ""  # where the part and the worker count came from, for the first line
    store: StoreOut | None = None  # --out s3://…: ``out`` is then the staging folder


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a build ended: the index once the cache is complete, or the plan and scan after a
    dry run; neither while other parts still scan or write."""

    index: dict[str, Any] | None = None
    plan: Plan | None = None
    scan: Scan | None = None


def build(options: BuildOptions, features: FeatureConfig, config: BuildConfig) -> Outcome:
    """Build (or resume) this part of the cache; with ``dry_run``, scan and plan only."""
    corpus = open_corpus(options.src, options.out, options.where, options.columns)
    if config.extras and corpus.kind in ("folder", "ljspeech"):
        raise UserError(
            f"build.extras = {list(config.extras)}: {options.src} is a {corpus.kind} corpus, "
            "which has no per-utterance fields to carry; list them in a JSONL manifest"
        )
    k, n = options.part
    whole = "the whole corpus" if n == 1 else f"part {k}/{n} (0-based)"
    if options.store is not None:
        options.store.check()  # a store that cannot be reached: one line, before any other
    where = options.out if options.store is None else options.store.destination
    staged = "" if options.store is None else f" (staged in {options.out})"
    log.info("building %s of %s into %s%s: %s", whole, options.src, where, staged, options.said)
    if options.store is not None:
        options.store.pull_state()  # a rerun on another host finds its scan and receipts
    state = options.out / RECEIPTS
    state.mkdir(parents=True, exist_ok=True)
    meeting = Meeting(*options.part)
    try:
        with (
            running_build(state, options.part),
            ordered_map(options.workers, init_worker, (features,)) as run,
        ):
            prepared = _scan_and_plan(corpus, options, features, config, run, meeting)
            if prepared is None:
                return Outcome()
            scan, plan = prepared
            if options.dry_run:
                return Outcome(plan=plan, scan=scan)
            made_by = recipe(corpus, features, config, options.keep_audio)
            receipts = _complete(options, plan, made_by)
            todo = [i for i in range(len(plan)) if i % n == k and plan.name(i) not in receipts]
            _write_shards(run, todo, plan, scan, corpus, options, features, config, receipts)
        meeting.barrier()  # under torchrun: every rank's shards are written
        return _finish(options, corpus, features, config, made_by, scan, plan, meeting)
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
    if options.store is not None:
        options.store.push_folder(own)
    listing = (scan_meta(own) or {}).get("listing")

    def scanned() -> int:  # parts whose scan saw the corpus as this one's did
        if options.store is not None:  # the parts meet through the store
            options.store.pull_state()
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
    if options.store is not None and meeting.collective:  # the barrier counted nothing here
        options.store.pull_state()
    scan = Scan(scan_folder(state, n), n)
    if not scan.has_inputs():
        raise UserError(f"--src {options.src} holds no audio files")
    inputs = _plan_inputs(scan, features, config, options.keep_audio)
    folder = scan_folder(state, n) / "plan"
    # Under torchrun rank 0 plans for all, unless their staging folders may be on other hosts
    # (each part makes the same plan from the same scans).
    planner = not meeting.collective or k == 0 or options.store is not None
    plan = load_plan(folder, inputs) if planner else None
    if planner and plan is None:
        plan = make_plan(scan, features, config, options.keep_audio)
        save_plan(plan, folder, inputs)
    meeting.barrier()  # under torchrun: rank 0 has saved the plan
    if not planner:
        plan = load_plan(folder, inputs)
    assert plan is not None, "rank 0 saved the plan before the barrier"  # internal invariant
    return scan, plan


def _plan_inputs(scan: Scan, features: FeatureConfig, config: BuildConfig, keep_audio: bool) -> str:
    """What a saved plan was made from: the config and the identity of every part's scan."""
    inputs = [FORMAT_VERSION, features.to_dict(), config.to_dict(), keep_audio]
    inputs += [meta["scan_id"] for meta in scan.metas]
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _finish(
    options: BuildOptions,
    corpus: Corpus,
    features: FeatureConfig,
    config: BuildConfig,
    made_by: str,
    scan: Scan,
    plan: Plan,
    meeting: Meeting,
) -> Outcome:
    """Write the index if every shard is complete (by rank 0 under torchrun)."""
    receipts = _complete(options, plan, made_by)
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
        return Outcome()
    # Every shard is complete: temporary files and scan folders left are of killed writers.
    sweep_temps(options.out)
    sweep_temps(scan_folder(options.out / RECEIPTS, options.part[1]))
    if corpus.spool is not None:  # Parquet audio, copied for the writers: no longer needed
        shutil.rmtree(corpus.spool, ignore_errors=True)
    rejections = [*scan.rejections(), *length_rejections(plan, scan, config, features.sample_rate)]
    index = finish_cache(
        options.out,
        plan,
        [receipts[plan.name(i)] for i in range(len(plan))],
        rejections,
        features,
        config,
        options.keep_audio,
        scan.filtered,
    )
    if options.store is not None:
        wrote = options.store.publish_cache(plan)
        log.info(
            "part %d/%d: every shard is in %s; %s",
            k,
            n,
            options.store.destination,
            "wrote index.json" if wrote else "index.json was already written, with these bytes",
        )
    return Outcome(index=index)


def _complete(options: BuildOptions, plan: Plan, made_by: str) -> dict[str, dict[str, Any]]:
    """The receipts of the shards already complete: in ``OUT``, or in the store."""
    if options.store is None:
        return valid_receipts(options.out, plan, made_by)
    return options.store.complete(plan, made_by, options.part)


def _write_shards(
    run: Runner,
    todo: Sequence[int],
    plan: Plan,
    scan: Scan,
    corpus: Corpus,
    options: BuildOptions,
    features: FeatureConfig,
    config: BuildConfig,
    receipts: dict[str, dict[str, Any]],
) -> None:
    shards = [planned_shard(plan, scan, i) for i in todo]  # the pool submits all at once
    # Longest first: the plan ends with its longest utterances' shards, so in plan order the
    # build ended with one worker on a long shard while the others had nothing left to do.
    shards.sort(key=lambda shard: -sum(item.samples for item in shard.items))
    common = (corpus, options.out, features, config, options.keep_audio, plan.digest)
    jobs = ((shard, *common) for shard in shards)
    total = sum(len(plan.shard_members(i)) for i in todo)
    seconds = 0.0
    with tqdm(total=total, desc="build", unit="utt", disable=None) as bar:
        for receipt in run(build_shard_job, jobs):
            if options.store is not None:
                options.store.publish_shard(receipt)
            receipts[receipt["name"]] = receipt
            seconds += receipt["seconds"]
            bar.set_postfix(hours=f"{seconds / 3600:.2f}", refresh=False)
            bar.update(receipt["planned"])
