"""Command line: ``python -m preprocess {build,derive,verify,inspect,index-table,push}``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from melcache.errors import UserError
from melcache.location import is_url
from melcache.storage import STORAGES
from preprocess.commands import (
    resolve_workers,
    run_build,
    run_derive,
    run_index_table,
    run_inspect,
    run_push,
    run_verify,
)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; user errors print one line and return 2."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return args.run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full or gone while writing the index: say which file
        where = f"{exc.filename}: " if exc.filename else ""  # a store's error names its object
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130


def _cache(text: str) -> Path | str:
    """A cache argument: a folder, or a URL prefix kept as written (a Path would fold its
    ``//``)."""
    return text if is_url(text) else Path(text)


def _part(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part {text!r}: expected K/N such as 0/4") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"--part {text!r}: K must be in 0..N-1")
    return k, n


def _workers(text: str) -> int:
    try:
        workers = int(text)
    except ValueError:
        workers = 0
    if workers < 1:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: expected a whole number ≥ 1")
    return workers


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m preprocess",
        description="Decode a speech corpus once into length-bucketed log-mel WebDataset shards.",
        epilog="The data path: corpus → preprocess build → shards (the format: melcache/, "
        "shards/README.md) → torchrun -m train. Bad input is one line on stderr and exit 2.",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    pool = argparse.ArgumentParser(add_help=False)  # the option build and verify share
    pool.add_argument(
        "--workers",
        type=_workers,
        default=None,
        help=f"processes (default: the CPUs this process may use, here {resolve_workers(None)[0]})",
    )

    _add_build(commands, pool)
    _add_derive(commands, pool)
    _add_verify(commands, pool)
    _add_inspect(commands)
    _add_index_table(commands, pool)
    _add_push(commands)
    return parser


_BUILD_DESCRIPTION = (
    "Decode, resample and featurise a corpus into tar shards bucketed by length, then "
    "write index.json. Rerunning the same command after an interruption resumes and gives "
    "byte-identical shards. SRC is a folder of audio with <stem>.txt/.lab/.normalized.txt "
    "transcripts, an LJSpeech folder (metadata.csv + wavs/), WebDataset audio tars (a folder "
    "of .tar, one .tar or a {000..999} pattern; <key>.mp3/.flac/.wav + <key>.json), Parquet "
    "files (the same ways; an audio column of bytes or {bytes, path} and a text column; "
    "needs pyarrow), or a JSONL manifest "
    "(audio_filepath, text, speaker, and duration or num_samples + sampling_rate to plan "
    "without opening the audio). The scan of the corpus and the plan are kept in "
    "OUT/.build/ and reused while the corpus listing is unchanged."
)


def _add_build(commands: argparse._SubParsersAction, pool: argparse.ArgumentParser) -> None:
    """``build``: corpus in, cache out; every option of the build."""
    build = commands.add_parser(
        "build",
        parents=[pool],
        help="build (or resume) a cache",
        description=_BUILD_DESCRIPTION,
    )
    build.add_argument(
        "--src", type=Path, required=True, help="corpus folder, .jsonl manifest, tars or Parquet"
    )
    build.add_argument(
        "--out",
        type=_cache,
        default=Path("shards"),
        help="output folder (default: shards), or s3://bucket/prefix: built in --staging and "
        "each shard uploaded as it is finished",
    )
    build.add_argument(
        "--staging",
        type=Path,
        help="with --out s3://…: the local folder the build is staged in (default: one under "
        "$TMPDIR named after the destination, so a rerun finds it)",
    )
    build.add_argument(
        "--config",
        type=Path,
        help="TOML with [features] and [build], or a preset name: chattts (the default: "
        "ChatTTS/vocos mel), hifigan",
    )
    build.add_argument(
        "--part",
        type=_part,
        metavar="K/N",
        help="scan 1/N of the corpus and write 1/N of the shards, meeting the other parts in a "
        "shared OUT or store (default: the rank under torchrun, else the whole corpus); see shards/README.md",
    )
    build.add_argument(
        "--storage",
        choices=STORAGES,
        help="how mels are stored (default: [build] storage, else fp16): fp16, 2 bytes per "
        "value, ~69 MB per hour of 100-mel features; lz4-q5, ~32 MB per hour, each value "
        "within 2^-6 log units of the float32 mel (Lhotse's lilcom default error)",
    )
    build.add_argument(
        "--keep-audio", action="store_true", help="also store the resampled audio as FLAC"
    )
    build.add_argument(
        "--dry-run",
        action="store_true",
        help="scan and plan only: print utterances, hours, rejections, buckets, shards and the "
        "expected size; the scan and plan are kept, so the real build starts writing at once",
    )
    _add_corpus_selection(build)
    build.set_defaults(run=run_build)


def _add_corpus_selection(build: argparse.ArgumentParser) -> None:
    """The build's options for which rows of the corpus are read, and when it is scanned again."""
    build.add_argument(
        "--where",
        metavar="EXPR",
        help='keep only manifest rows, tar samples or Parquet rows whose fields match, e.g. \'language == "en" and '
        "dnsmos >= 3.2' (field names, literals, == != < <= > >= in, not in, and, or, not; a "
        "missing field compares false); the rows left out are counted, not listed",
    )
    build.add_argument(
        "--columns",
        metavar="AUDIO,TEXT[,SPEAKER]",
        help="Parquet columns holding the encoded audio, the transcript and the speaker "
        "(default: audio,text,speaker; the speaker column may be absent)",
    )
    build.add_argument(
        "--rescan",
        action="store_true",
        help="scan the corpus again even if its listing looks unchanged (after editing files in place)",
    )


def _add_derive(commands: argparse._SubParsersAction, pool: argparse.ArgumentParser) -> None:
    """``derive``: a model's output over every cached mel, stored as a field beside them."""
    derive = commands.add_parser(
        "derive",
        parents=[pool],
        help="store an encoder's output per utterance as a field of a cache",
        description="Run --encoder over every utterance's mel and store the result as field "
        "NAME in sidecar shards aligned with the mel shards (no mel shard is rewritten), "
        "listed in index.json with its provenance. Resumable, byte-deterministic, --part K/N "
        "like build; see docs/fields.md.",
    )
    derive.add_argument("cache", type=Path, help="a finished cache folder")
    derive.add_argument("--field", required=True, help="the field's name, e.g. codes")
    derive.add_argument(
        "--encoder", required=True, metavar="MODULE:FACTORY",
        help="package.module:factory returning a melcache.fields.format.FieldEncoder",
    )  # fmt: skip
    derive.add_argument(
        "--checkpoint", help="handed to the factory: a trainer run folder or a weights file"
    )
    derive.add_argument(
        "--part", type=_part, metavar="K/N",
        help="derive 1/N of the shards (0-based K), meeting the other parts in CACHE",
    )  # fmt: skip
    derive.add_argument("--device", help="torch device (default: cuda when present, else cpu)")
    derive.add_argument(
        "--replace", action="store_true",
        help="derive a field that exists with another provenance again, replacing it",
    )  # fmt: skip
    derive.set_defaults(run=run_derive)


def _add_verify(commands: argparse._SubParsersAction, pool: argparse.ArgumentParser) -> None:
    """``verify``: re-check a cache against its index."""
    verify = commands.add_parser(
        "verify",
        parents=[pool],
        help="re-check a cache against its index",
        description="Read every shard with the loader's own reader (size, sha256, xxh3_128, "
        "member names, metadata), decode every mel (dtype, shape, finite, frames, bucket), then "
        "check totals, rejected.jsonl and stats.zarr; exit 1 listing each problem.",
    )
    verify.add_argument("cache", type=_cache, help="cache folder (OUT of build) or s3://…")
    verify.set_defaults(run=run_verify)


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    """``inspect``: summarise a cache, or show one utterance."""
    inspect = commands.add_parser(
        "inspect",
        help="summarise a cache",
        description="Print hours, utterances, buckets with counts and implied padding, shards and rejections.",
    )
    inspect.add_argument("cache", type=_cache, help="cache folder (OUT of build) or s3://…")
    inspect.add_argument(
        "--png",
        type=Path,
        metavar="DIR",
        help="also write durations.png, mels.png, rejected.png here (needs matplotlib)",
    )
    inspect.add_argument(
        "--batch-frames",
        type=int,
        default=20_000,
        help="frame budget for the padding shown per bucket (default 20000)",
    )
    inspect.add_argument(
        "--max-batch-size",
        type=int,
        default=64,
        help="batch size cap for that padding (default 64)",
    )
    inspect.add_argument(
        "--key",
        help="print this one utterance (text, speaker, source, mel statistics), found through "
        "the cache's table in one read; with --png, draw its mel into DIR/KEY.png",
    )
    inspect.set_defaults(run=run_inspect)


def _add_index_table(commands: argparse._SubParsersAction, pool: argparse.ArgumentParser) -> None:
    """``index-table``: write the per-utterance table of an older cache."""
    table = commands.add_parser(
        "index-table",
        parents=[pool],
        help="write the per-utterance table of a cache built before tables existed",
        description="Read every shard's tar headers and metadata, write utterances.table (where "
        "each utterance is: shard, byte offsets and sizes, frames, text length, speaker, source; "
        "sorted by key hash) and list it in index.json, which is rewritten atomically. The build "
        "writes it itself; this is for older caches, or to rewrite a damaged table.",
    )
    table.add_argument("cache", type=Path, help="cache folder (OUT of build)")
    table.set_defaults(run=run_index_table)


def _add_push(commands: argparse._SubParsersAction) -> None:
    """``push``: publish a finished cache to an object store."""
    push = commands.add_parser(
        "push",
        help="publish a finished cache to s3://bucket/prefix",
        description="Upload every file of a finished cache in parallel, read each back and "
        "compare it, then index.json last, so readers never see half a cache. Rerun to resume: "
        "objects already there and equal are kept. Endpoint and credentials come from the "
        "standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).",
    )
    push.add_argument("cache", type=Path, help="cache folder (OUT of build)")
    push.add_argument("destination", help="s3://bucket/prefix")
    push.set_defaults(run=run_push)
