"""Scan one part's share of a corpus into columns on disk; read every part's back.

A scan holds what planning needs of each utterance as flat arrays, not one Python object
per utterance (about 50 bytes and a few microseconds each): its ordinal, its length at the
target rate, where its transcript is, a hash of its text and one of its key, and its source
path, all the sources' bytes end to end. Part K of N writes ``OUT/.build/scan-N/part-K/``,
atomically, so N machines sharing ``OUT`` scan a corpus once between them, and a rerun
whose corpus listing is unchanged (:func:`preprocess.inputs.corpus.unchanged`) does not scan
again. Within a part, each worker process scans one piece
(:class:`preprocess.inputs.records.Slice`) on its own, reading the listing, transcripts and
headers itself: nothing per utterance crosses between processes, and the planning process
never holds the columns while they are made.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import uuid
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from melcache.bounded import read_json
from melcache.errors import UserError
from melcache.format import temp_path
from preprocess.inputs.archives import audio_input
from preprocess.inputs.audio import AudioError, probe, resampled_length
from preprocess.inputs.corpus import read_transcript_file, share, transcript_path, unchanged
from preprocess.inputs.records import (
    FILTERED,
    Corpus,
    Found,
    Rejection,
    Slice,
    Stamp,
    key_base,
    key_digest,
    unit_of,
    utterance_hash,
)
from preprocess.job.pool import Runner

log = logging.getLogger(__name__)

SCAN_VERSION = 2  # 2: a tar locator is its member's first header, not its data
_COLUMNS = {
    "ordinal": "q",
    "samples": "q",
    "locator": "q",
    "content": "Q",
    "key": "Q",
    "audio_at": "q",  # -1 but in tars: not read by the plan
}
# A scan's stamps and rejections grow with the corpus (a stamp per folder); far below this.
LISTING_LIMIT = 2**30

SCAN_META = "meta.json"  # written last: a scan folder holding it is finished


def scan_folder(build_folder: Path, parts: int) -> Path:
    """Where the scans of an N-part build live."""
    return build_folder / f"scan-{parts}"


def part_folder(build_folder: Path, part: int, parts: int) -> Path:
    """Where part K's scan lives."""
    return scan_folder(build_folder, parts) / f"part-{part}"


def scan_meta(folder: Path) -> dict[str, Any] | None:
    """The description of a finished scan in ``folder``, or ``None``."""
    try:
        meta = read_json(folder / SCAN_META)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("version") == SCAN_VERSION else None


def scan_is_current(folder: Path, corpus: Corpus, sample_rate: int) -> bool:
    """Whether a finished scan in ``folder`` is of this corpus, at this rate, its listing is
    unchanged since (one stat per folder or listing file), and its Parquet spool is there."""
    meta = scan_meta(folder)
    if meta is None or meta.get("corpus") != corpus.identity():
        return False
    if corpus.spool is not None:  # Parquet: the writers read the audio the scan spooled
        taken = Slice(meta["part"], meta["parts"])
        held = (rel for number, rel in enumerate(corpus.archives) if taken.holds(number))
        if not all(os.path.isfile(corpus.archive_path(rel)) for rel in held):
            log.info("the Parquet spool of %s is gone (deleted with a complete cache)", folder)
            return False
    try:
        stamps = read_json(folder / "stamps.json", LISTING_LIMIT)
    except (OSError, ValueError):
        return False
    return meta.get("sample_rate") == sample_rate and unchanged(corpus, [tuple(s) for s in stamps])


def stamps_digest(stamps: list[tuple[str, int, int]]) -> str:
    """One string for a corpus listing's state: parts that agree on it scanned one corpus."""
    return hashlib.sha256(json.dumps(stamps).encode()).hexdigest()[:16]


def scan_part(
    corpus: Corpus,
    folder: Path,
    part: int,
    parts: int,
    sample_rate: int,
    run: Runner,
    pieces: int,
) -> None:
    """Scan part ``part`` of ``parts`` into ``folder`` as ``pieces`` pieces, one per worker
    of ``run``: each reads its own inputs' transcripts and audio headers (headers only where
    the manifest gives no length)."""
    temp = temp_path(folder)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    jobs = [
        (corpus, temp / f"piece-{j}", Slice(part, parts, j, pieces), sample_rate)
        for j in range(pieces)
    ]
    results = list(run(_scan_piece_job, jobs))
    stamps = [stamps for stamps, _ in results]
    if any(s != stamps[0] for s in stamps):
        raise UserError(f"--src {corpus.root} changed while it was scanned; run the build again")
    (temp / "stamps.json").write_text(json.dumps(stamps[0]))  # \u escapes keep lone surrogates
    meta = {
        "version": SCAN_VERSION,
        "corpus": corpus.identity(),
        "sample_rate": sample_rate,
        "filtered": sum(filtered for _, filtered in results),
        "part": part,
        "parts": parts,
        "pieces": pieces,
        "scan_id": uuid.uuid4().hex,  # a rescan of any part makes the plan again
        "listing": stamps_digest(stamps[0]),
    }
    (temp / SCAN_META).write_text(json.dumps(meta))
    try:
        os.rename(temp, folder)
    except OSError:  # another process wrote the same scan first: keep theirs
        shutil.rmtree(temp, ignore_errors=True)


def _scan_piece_job(job: tuple[Corpus, Path, Slice, int]) -> tuple[list[Stamp], int]:
    return scan_piece(*job)


def scan_piece(
    corpus: Corpus, folder: Path, taken: Slice, sample_rate: int
) -> tuple[list[Stamp], int]:
    """Scan one slice of the corpus into ``folder``; return the listing stamps it saw and how
    many inputs ``--where`` left out."""
    columns = {name: array(code) for name, code in _COLUMNS.items()}
    ordinals, lengths, locators, contents, keys, audio_at = columns.values()
    sources, ends = bytearray(), array("q")
    rejections: list[list[str]] = []
    stamps: list[Stamp] = []
    filtered = 0
    shown = taken.piece == 0  # the pieces are interleaved, so one bar shows them all
    label = f"scan {taken.part}/{taken.parts}" + (
        f" (1 of {taken.pieces} pieces)" if taken.pieces > 1 else ""
    )
    with tqdm(desc=label, unit="utt", disable=None if shown else True) as bar:
        for item in share(corpus, taken, sample_rate, stamps):
            bar.update()
            if isinstance(item, Rejection) and item.stage == FILTERED:
                filtered += 1
                continue
            result = (
                item.reason if isinstance(item, Rejection) else _resolve(item, corpus, sample_rate)
            )
            if isinstance(result, str):
                rejections.append([item.source, result])
            else:
                ordinals.append(item.ordinal)
                lengths.append(result[0])
                locators.append(item.locator)  # type: ignore[union-attr]
                contents.append(result[1])
                keys.append(key_digest(key_base(item.source)))
                audio_at.append(item.audio_at)  # type: ignore[union-attr]
                sources.extend(item.source.encode())
                ends.append(len(sources))
    folder.mkdir()
    for name, column in columns.items():
        np.save(folder / f"{name}.npy", np.frombuffer(column, column.typecode))
    np.save(folder / "source.npy", np.frombuffer(sources, np.uint8))
    np.save(folder / "source_end.npy", np.frombuffer(ends, np.int64))
    (folder / "rejections.json").write_text(json.dumps(rejections))  # \u escapes: surrogates
    return stamps, filtered


def _resolve(item: Found, corpus: Corpus, sample_rate: int) -> tuple[int, int] | str:
    """``(samples, content hash)`` of an input, reading its transcript file and audio header
    as needed (in a worker), or the reason it is rejected."""
    content = item.content
    if content is None:
        try:
            text = read_transcript_file(transcript_path(corpus, item.source, item.locator))
        except ValueError as exc:
            return str(exc)
        content = utterance_hash(item.source, text, item.speaker)
        if isinstance(content, str):
            return content
    samples = item.samples
    if samples is None:
        try:
            count, rate = probe(audio_input(corpus, item.source, item.audio_at))
        except AudioError as exc:
            return str(exc)
        samples = resampled_length(count, rate, sample_rate)
    return samples, content


class ScanPiece:
    """One piece of a part's scan, memory-mapped: its columns are paged in as they are used."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        load = functools.partial(np.load, mmap_mode="r", allow_pickle=False)
        self.columns = {name: load(folder / f"{name}.npy") for name in _COLUMNS}
        self.source_bytes = load(folder / "source.npy")
        self.source_ends = load(folder / "source_end.npy")

    def __len__(self) -> int:
        return len(self.columns["ordinal"])

    def source(self, local: int) -> str:
        """The source path of this piece's ``local``-th utterance."""
        start = int(self.source_ends[local - 1]) if local else 0
        return bytes(self.source_bytes[start : int(self.source_ends[local])]).decode()


class Scan:
    """Every part's scan of one corpus, looked up by ordinal."""

    def __init__(self, folder: Path, parts: int) -> None:
        self.metas = [scan_meta(folder / f"part-{k}") or {} for k in range(parts)]
        self.parts = [
            [ScanPiece(folder / f"part-{k}" / f"piece-{j}") for j in range(meta["pieces"])]
            for k, meta in enumerate(self.metas)
        ]
        self.pieces = [piece for part in self.parts for piece in part]
        self.kind: str = self.metas[0]["corpus"][0]

    def __len__(self) -> int:
        return sum(len(p) for p in self.pieces)

    @property
    def filtered(self) -> int:
        """Inputs ``--where`` left out, in every part."""
        return sum(meta.get("filtered", 0) for meta in self.metas)

    def has_inputs(self) -> bool:
        """Whether any part found an utterance or a rejection at all."""
        return len(self) > 0 or self.filtered > 0 or next(self.rejections(), None) is not None

    def column(self, name: str) -> np.ndarray:
        """A numeric column of every piece, in ordinal order."""
        merged = np.concatenate([p.columns[name] for p in self.pieces])
        if len(self.pieces) == 1:
            return merged
        # Sorted per call, not kept: the permutation would add 8 B per utterance to the
        # planning process's peak for the whole plan, to save ~0.1 s per million rows.
        order = np.argsort(np.concatenate([p.columns["ordinal"] for p in self.pieces]))
        return merged[order]

    def locate(self, ordinal: int) -> tuple[ScanPiece, int]:
        """The piece holding an utterance (as :class:`Slice` deals them), and its place there."""
        unit = unit_of(self.kind, ordinal)
        part = self.parts[unit % len(self.parts)]
        piece = part[(unit // len(self.parts)) % len(part)]
        return piece, int(np.searchsorted(piece.columns["ordinal"], ordinal))

    def rejections(self) -> Iterator[Rejection]:
        """What every piece rejected while scanning."""
        for piece in self.pieces:
            path = piece.folder / "rejections.json"
            try:
                listed = read_json(path, LISTING_LIMIT)
            except (OSError, ValueError) as exc:
                raise UserError(f"{path}: unreadable ({exc}); rerun with --rescan") from None
            for source, reason in listed:
                yield Rejection(source, reason)
