"""What each ``python -m preprocess`` subcommand runs, once ``preprocess/arguments.py`` has parsed
its arguments. The build's modules import torch, so each command imports what it needs when
it runs: ``--help`` and a mistyped option stay fast."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from melcache.errors import UserError
from melcache.host.cpus import allotment
from preprocess.config import load_config

if TYPE_CHECKING:
    from preprocess.write.staged import StoreOut

log = logging.getLogger("preprocess")


def run_build(args: argparse.Namespace) -> int:
    """``build``: plan, decode and write the shards (or a dry run's plan)."""
    from preprocess.build import BuildOptions, build
    from preprocess.check.inspect import describe_plan
    from preprocess.job.part import choose_part

    features, config = load_config(args.config)
    if args.storage is not None:
        config = dataclasses.replace(config, storage=args.storage)
    part, part_from = choose_part(args.part)
    workers, workers_from = resolve_workers(args.workers)
    out, store = _build_out(args.out, args.staging)
    options = BuildOptions(
        args.src,
        out,
        workers,
        part,
        args.keep_audio,
        args.dry_run,
        args.rescan,
        args.where,
        args.columns,
        said=f"{part_from}; workers {workers} ({workers_from})",
        store=store,
    )
    started = time.perf_counter()
    outcome = build(options, features, config)
    if args.dry_run and outcome.plan is not None and outcome.scan is not None:
        print(describe_plan(outcome.plan, outcome.scan, features, config))
    if outcome.index is None:
        return 0
    totals = outcome.index["totals"]
    if totals["utterances"] == 0:  # a cache to inspect, but nothing to train on: not success
        reasons = ", ".join(f"{n} {r}" for r, n in totals["rejected_by_reason"].items())
        raise UserError(
            f"nothing left to build in {args.out}: of {totals['discovered']} inputs "
            f"{totals['rejected']} were rejected ({reasons or 'none'}) and "
            f"{totals['filtered_out']} left out by --where; see {args.out}/rejected.jsonl, "
            f"or python -m preprocess inspect {args.out}"
        )
    wall = time.perf_counter() - started
    left_out = f"; {totals['filtered_out']} left out by --where" if args.where else ""
    print(
        f"{args.out}: {totals['utterances']} utterances, {totals['hours']:.3f} h in "
        f"{totals['shards']} shards; {totals['rejected']} rejected (see {args.out}/rejected.jsonl)"
        f"{left_out}; {wall:.1f} s wall, {totals['seconds'] / max(wall, 1e-9):.0f}x real time"
    )
    return 0


def run_derive(args: argparse.Namespace) -> int:
    """``derive``: a field over every cached mel, beside the mel shards."""
    from preprocess.derive import DeriveOptions, default_device, derive
    from preprocess.job.part import choose_part

    part, part_from = choose_part(args.part)
    workers, workers_from = resolve_workers(args.workers)
    device = args.device or default_device()
    log.info(
        "deriving %s of %s: part %d/%d (%s); workers %d (%s); device %s",
        args.field, args.cache, *part, part_from, workers, workers_from, device,
    )  # fmt: skip
    options = DeriveOptions(
        args.cache, args.field, args.encoder, args.checkpoint, part, workers, device, args.replace
    )
    started = time.perf_counter()
    entry = derive(options)
    if entry is not None:
        totals = entry["totals"]
        print(
            f"{args.cache}: field {args.field} in {len(entry['shards'])} shards, "
            f"{totals['frames']} frames, {totals['bytes']} bytes; "
            f"{time.perf_counter() - started:.1f} s wall"
        )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """``verify``: every problem, one line each; exit 1 when any."""
    from preprocess.check.verify import verify

    problems = verify(args.cache, workers=resolve_workers(args.workers)[0])
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.cache}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.cache}: OK")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """``inspect``: the cache's summary, and its pictures with ``--png``."""
    from preprocess.check.inspect import plot_cache, summarize

    if args.key is not None:
        return run_inspect_key(args)
    print(summarize(args.cache))
    if args.png is not None:
        paths = plot_cache(
            args.cache, args.png, batch_frames=args.batch_frames, max_batch_size=args.max_batch_size
        )
        for path in paths:
            print(f"wrote {path}")
    return 0


def run_inspect_key(args: argparse.Namespace) -> int:
    """``inspect --key``: one utterance, and its mel drawn with ``--png``."""
    from preprocess.check.show import show_utterance

    print(show_utterance(args.cache, args.key, args.png))
    return 0


def run_index_table(args: argparse.Namespace) -> int:
    """``index-table``: utterances.table for a cache built before it."""
    from preprocess.write.index_table import index_table

    index = index_table(args.cache, workers=resolve_workers(args.workers)[0])
    table = index["table"]
    rows = index["totals"]["utterances"]
    print(
        f"{args.cache}: wrote {table['name']}, {rows} utterances, {table['bytes']} bytes "
        f"({table['bytes'] / max(rows, 1):.1f} per utterance); index.json lists it"
    )
    return 0


def _build_out(out: Path | str, staging: Path | None) -> tuple[Path, StoreOut | None]:
    """Where ``build`` writes: ``--out`` itself, or for ``s3://`` its staging folder and the
    store it publishes to."""
    from melcache.remote import objectstore
    from preprocess.write.staged import StoreOut, default_staging

    if isinstance(out, Path):
        if staging is not None:
            raise UserError(f"--staging {staging}: only for --out s3://…; --out {out} is a folder")
        return out, None
    if not objectstore.is_store(out):
        raise UserError(f"--out {out}: build writes to a folder or to s3://bucket/prefix")
    objectstore.split(out)  # no bucket named: one line now
    staging = staging if staging is not None else default_staging(out)
    return staging, StoreOut(out, staging)


def run_push(args: argparse.Namespace) -> int:
    """``push``: publish a finished cache to an object store, index.json last."""
    from preprocess.write.push import push

    counts = push(args.cache, args.destination)
    print(
        f"{args.destination}: {counts['uploaded']} objects uploaded, {counts['kept']} already there"
    )
    return 0


def resolve_workers(asked: int | None) -> tuple[int, str]:
    """``--workers``, or the CPUs this process may use (its affinity mask and cgroup quota:
    a Slurm or container job gets fewer than the machine has); and which it was."""
    if asked is not None:
        return asked, "--workers"
    cpus = allotment()
    return cpus.cpus, f"the CPUs this process may use: {cpus.describe()}"
