"""Scan one part's share of a corpus into columns on disk; read every part's back.

A scan holds what planning needs of each utterance as flat arrays, not one Python object
per utterance (about 50 bytes and a few microseconds each): its ordinal, its length at the
target rate, where its transcript is, a hash of its text and one of its key, and its source
path, all the sources' bytes end to end. Part K of N writes ``OUT/.build/scan-N/part-K/``,
atomically, so N machines sharing ``OUT`` scan a corpus once between them, and a rerun
whose corpus listing is unchanged (:func:`preprocess.sources.unchanged`) does not scan again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import uuid
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from melcache.format import temp_path
from preprocess.audio import AudioError, probe, resampled_length
from preprocess.parallel import Runner
from preprocess.sources import (
    Corpus,
    Found,
    Rejection,
    clean_text,
    content_hash,
    key_base,
    key_hash,
    read_transcript_file,
    share,
    text_problem,
    transcript_path,
    unchanged,
)

SCAN_VERSION = 1
_COLUMNS = {"ordinal": "q", "samples": "q", "locator": "q", "content": "Q", "key": "Q"}
_BATCH = 4096  # inputs handed to the workers at once: keeps them busy, bounds what waits


def scan_folder(build_folder: Path, parts: int) -> Path:
    """Where the scans of an N-part build live."""
    return build_folder / f"scan-{parts}"


def part_folder(build_folder: Path, part: int, parts: int) -> Path:
    """Where part K's scan lives."""
    return scan_folder(build_folder, parts) / f"part-{part}"


def scan_meta(folder: Path) -> dict[str, Any] | None:
    """The description of a finished scan in ``folder``, or ``None``."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("version") == SCAN_VERSION else None


def scan_is_current(folder: Path, corpus: Corpus, sample_rate: int) -> bool:
    """Whether a finished scan in ``folder`` is of this corpus, at this rate, and its
    listing is unchanged since (one stat per folder or listing file)."""
    meta = scan_meta(folder)
    if meta is None or meta.get("corpus") != [corpus.kind, corpus.root, corpus.listing]:
        return False
    try:
        stamps = json.loads((folder / "stamps.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("sample_rate") == sample_rate and unchanged(corpus, [tuple(s) for s in stamps])


def stamps_digest(stamps: list[tuple[str, int, int]]) -> str:
    """One string for a corpus listing's state: parts that agree on it scanned one corpus."""
    return hashlib.sha256(json.dumps(stamps).encode()).hexdigest()[:16]


def scan_part(
    corpus: Corpus, folder: Path, part: int, parts: int, sample_rate: int, run: Runner
) -> None:
    """Scan part ``part`` of ``parts`` into ``folder``: read the transcripts and audio headers
    of its share (headers only where the manifest gives no length) with ``run``'s workers."""
    columns = {name: array(code) for name, code in _COLUMNS.items()}
    sources, ends = bytearray(), array("q")
    rejections: list[list[str]] = []
    stamps: list[tuple[str, int, int]] = []
    resolve = functools.partial(_resolve, corpus=corpus, sample_rate=sample_rate)

    def keep(item: Found, samples: int, content: int) -> None:
        for name, value in zip(
            _COLUMNS,
            (item.ordinal, samples, item.locator, content, key_hash(key_base(item.source))),
            strict=True,
        ):
            columns[name].append(value)
        sources.extend(item.source.encode())
        ends.append(len(sources))

    def settle(batch: list[Found]) -> None:
        outside = [item for item in batch if _needs_worker(item)]
        resolved = iter(run(resolve, outside, 64))
        for item in batch:  # in ordinal order, whichever process resolved it
            result = next(resolved) if _needs_worker(item) else resolve(item)
            if isinstance(result, str):
                rejections.append([item.source, result])
            else:
                keep(item, *result)
        bar.update(len(batch))
        batch.clear()

    batch: list[Found] = []
    with tqdm(desc=f"scan {part}/{parts}", unit="utt", disable=None) as bar:
        for item in share(corpus, part, parts, sample_rate, stamps):
            if isinstance(item, Rejection):
                rejections.append([item.source, item.reason])
                continue
            batch.append(item)
            if len(batch) >= _BATCH:
                settle(batch)
        settle(batch)
    meta = {
        "version": SCAN_VERSION,
        "corpus": [corpus.kind, corpus.root, corpus.listing],
        "sample_rate": sample_rate,
        "part": part,
        "parts": parts,
        "scan_id": uuid.uuid4().hex,  # a rescan of any part makes the plan again
        "listing": stamps_digest(stamps),
    }
    _save(folder, columns, sources, ends, meta, {"stamps": stamps, "rejections": rejections})


def _resolve(item: Found, corpus: Corpus, sample_rate: int) -> tuple[int, int] | str:
    """``(samples, content hash)`` of an input, reading its transcript file and audio header
    as needed (in a worker), or the reason it is rejected."""
    text = item.text
    if text is None:
        try:
            text = read_transcript_file(transcript_path(corpus, item.source, item.locator))
        except ValueError as exc:
            return str(exc)
        problem = text_problem(item.source, text, item.speaker)
        if problem is not None:
            return problem
        text = clean_text(text)
    samples = item.samples
    if samples is None:
        try:
            count, rate = probe(corpus.audio_path(item.source))
        except AudioError as exc:
            return str(exc)
        samples = resampled_length(count, rate, sample_rate)
    return samples, content_hash(item.source, text, item.speaker)


def _needs_worker(item: Found) -> bool:
    return item.text is None or item.samples is None


def _save(
    folder: Path,
    columns: dict[str, array],
    sources: bytearray,
    ends: array,
    meta: dict[str, Any],
    lists: dict[str, list],
) -> None:
    """Write the columns under a temporary name, then rename: a scan is whole or absent."""
    temp = temp_path(folder)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    for name, column in columns.items():
        np.save(temp / f"{name}.npy", np.frombuffer(column, column.typecode))
    np.save(temp / "source.npy", np.frombuffer(sources, np.uint8))
    np.save(temp / "source_end.npy", np.frombuffer(ends, np.int64))
    for name, items in lists.items():
        (temp / f"{name}.json").write_text(json.dumps(items))  # \u escapes keep lone surrogates
    (temp / "meta.json").write_text(json.dumps(meta))
    try:
        os.rename(temp, folder)
    except OSError:  # another process wrote the same scan first: keep theirs
        shutil.rmtree(temp, ignore_errors=True)


class ScanPart:
    """One part's scan, memory-mapped: its columns are paged in as they are used."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.meta: dict[str, Any] = json.loads((folder / "meta.json").read_text())
        load = functools.partial(np.load, mmap_mode="r", allow_pickle=False)
        self.columns = {name: load(folder / f"{name}.npy") for name in _COLUMNS}
        self.source_bytes = load(folder / "source.npy")
        self.source_ends = load(folder / "source_end.npy")

    def __len__(self) -> int:
        return len(self.columns["ordinal"])

    def source(self, local: int) -> str:
        """The source path of this part's ``local``-th utterance."""
        start = int(self.source_ends[local - 1]) if local else 0
        return bytes(self.source_bytes[start : int(self.source_ends[local])]).decode()


class Scan:
    """Every part's scan of one corpus, looked up by ordinal."""

    def __init__(self, folder: Path, parts: int) -> None:
        self.parts = [ScanPart(folder / f"part-{k}") for k in range(parts)]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def has_inputs(self) -> bool:
        """Whether any part found an utterance or a rejection at all."""
        return len(self) > 0 or any(
            (p.folder / "rejections.json").read_text().strip() != "[]" for p in self.parts
        )

    def column(self, name: str) -> np.ndarray:
        """A numeric column of every part, in ordinal order."""
        merged = np.concatenate([p.columns[name] for p in self.parts])
        if len(self.parts) == 1:
            return merged
        order = np.argsort(np.concatenate([p.columns["ordinal"] for p in self.parts]))
        return merged[order]

    def locate(self, ordinal: int) -> tuple[ScanPart, int]:
        """The part holding an utterance, and its place there."""
        part = self.parts[ordinal % len(self.parts)]
        return part, int(np.searchsorted(part.columns["ordinal"], ordinal))

    def rejections(self) -> Iterator[Rejection]:
        """What every part rejected while scanning."""
        for part in self.parts:
            for source, reason in json.loads((part.folder / "rejections.json").read_text()):
                yield Rejection(source, reason)
