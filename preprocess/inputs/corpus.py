"""The corpus: which inputs a part scans, and each utterance's transcript when it is written.

Three layouts are read here, and two kinds of archive by their own modules (WebDataset tars,
:mod:`preprocess.inputs.archives`; Parquet, :mod:`preprocess.inputs.parquet`):

1. a folder searched recursively, audio with a transcript beside it
   (``<stem>.normalized.txt``, ``<stem>.txt`` or ``<stem>.lab``, in that order of preference);
2. an LJSpeech folder: ``metadata.csv`` rows ``id|text`` or ``id|text|normalized``, audio
   under ``wavs/``;
3. a JSONL manifest (NeMo / Lhotse convention): ``audio_filepath``, ``text``, optional
   ``speaker``, and optionally the length, ``duration`` (seconds) or ``num_samples`` with
   ``sampling_rate``, which spares opening the audio while planning. Relative paths are
   relative to the manifest's folder, and every path must lie inside it.

Every input (an audio file of the folder in sorted order, a row, a line) has an *ordinal*,
its place in the listing; part K of N scans the inputs whose ordinal is K modulo N, so N
parts share the work and the merged result does not depend on N. Transcripts are not kept:
an utterance records where its transcript is (a suffix number, a line's byte offset) and the
writer reads it again. Everything is an utterance or a :class:`Rejection` with a plain
reason, so "written + rejected = discovered" can be checked at the end. Transcripts must be
UTF-8 (a BOM is allowed); anything else is rejected rather than guessed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from melcache.bounded import SMALL_FILE_LIMIT, open_regular
from melcache.errors import UserError
from melcache.format import is_unicode
from preprocess.inputs.archives import find_archives, parse_text_member, read_member, tar_samples
from preprocess.inputs.audio import AUDIO_EXTENSIONS
from preprocess.inputs.parquet import SPOOL, check_columns, parquet_rows, parse_columns
from preprocess.inputs.records import (
    FILTERED,
    RECEIPTS,
    Corpus,
    Found,
    Rejection,
    Slice,
    Stamp,
    found,
    listed_samples,
    listed_speaker,
    parse_json,
    stamp,
)
from preprocess.inputs.where import Where

TRANSCRIPT_SUFFIXES = (".normalized.txt", ".txt", ".lab")
# A relative path with no empty, "." or ".." component: what normpath would leave as it is.
_PLAIN_PATH = re.compile(r"(?!/)(?:(?!\.\.?(?:/|$))[^/]+/)*(?!\.\.?$)[^/]+$")


def open_corpus(
    src: Path, out: Path, where: str | None = None, columns: str | None = None
) -> Corpus:
    """The layout of ``src``, built into ``out``, selecting by ``where`` (a manifest, tars or
    Parquet) and, for Parquet, reading ``columns`` (``AUDIO,TEXT[,SPEAKER]``);
    :class:`UserError` when it is missing, a file but no manifest, or an option is bad."""
    archives = find_archives(str(src))
    if columns is not None and (archives is None or archives[0] != "parquet"):
        raise UserError(f"--columns names Parquet columns; --src {src} is not Parquet")
    if archives is not None:
        kind, root, names = archives
        if where is not None:
            Where(where)  # a bad expression fails here, before any scan
        if kind == "tars":
            return Corpus(kind, root, archives=names, where=where)
        audio_text_speaker = parse_columns(columns)
        check_columns(root, names, audio_text_speaker)
        spool = os.path.join(os.path.abspath(out), RECEIPTS, SPOOL)
        return Corpus(
            kind, root, archives=names, where=where, columns=audio_text_speaker, spool=spool
        )
    if not src.exists():
        raise UserError(f"--src {src} does not exist")
    if not src.is_dir():
        if src.suffix != ".jsonl":
            raise UserError(f"--src {src} is a file but not a .jsonl manifest")
        if where is not None:
            Where(where)  # a bad expression fails here, before any scan
        _check_listing(src)
        return Corpus("manifest", str(src.parent.resolve()), str(src.resolve()), where=where)
    if where is not None:
        raise UserError(
            f"--where selects on metadata, which a JSONL manifest, tars or Parquet have; "
            f"--src {src} is a folder"
        )
    root = str(src.resolve())
    if (src / "metadata.csv").exists():
        _check_listing(src / "metadata.csv")
        return Corpus("ljspeech", root, os.path.join(root, "metadata.csv"))
    return Corpus("folder", root, exclude=os.path.realpath(out))


def _check_listing(path: Path) -> None:
    """:class:`UserError` unless ``path`` opens as a regular file: a FIFO would block the scan."""
    try:
        open_regular(path).close()
    except OSError as exc:
        raise UserError(f"cannot read --src listing {path}: {exc.strerror or exc}") from None


def share(
    corpus: Corpus, taken: Slice, sample_rate: int, stamps: list[Stamp]
) -> Iterator[Found | Rejection]:
    """The inputs of a slice of the corpus, in ordinal order; ``stamps`` receives what tells
    later whether the corpus listing changed (every folder walked, or the listing)."""
    if corpus.kind == "folder":
        return _folder_share(corpus, taken, stamps)
    if corpus.kind in ("tars", "parquet"):
        return _archive_share(corpus, taken, sample_rate, stamps)
    assert corpus.listing is not None  # internal invariant: open_corpus sets it
    stamps.append(stamp(corpus.root, os.path.relpath(corpus.listing, corpus.root)))
    if corpus.kind == "ljspeech":
        stamps.append(stamp(corpus.root, "wavs"))
        return _ljspeech_share(corpus, taken)
    return _manifest_share(corpus, taken, sample_rate)


def _archive_share(
    corpus: Corpus, taken: Slice, sample_rate: int, stamps: list[Stamp]
) -> Iterator[Found | Rejection]:
    """The samples of this slice's whole archives (archive number ≡ part mod parts), tars or
    Parquet files; every archive is stamped."""
    read = tar_samples if corpus.kind == "tars" else parquet_rows
    where = Where(corpus.where) if corpus.where is not None else None
    for number, rel in enumerate(corpus.archives):
        stamps.append(stamp(corpus.root, rel))
        if taken.holds(number):
            yield from read(corpus, number, rel, sample_rate, where)


def unchanged(corpus: Corpus, stamps: list[Stamp]) -> bool:
    """Whether every listing recorded by :func:`share` is as it was (same mtime and size):
    nothing was added, removed or renamed since the scan."""
    return all(stamp(corpus.root, rel) == (rel, mtime, size) for rel, mtime, size in stamps)


def _folder_share(corpus: Corpus, taken: Slice, stamps: list[Stamp]) -> Iterator[Found | Rejection]:
    # Strings and one listing per folder rather than pathlib and a stat per candidate
    # transcript: 2.5–3× faster per file, which matters at tens of millions of files.
    ordinal = -1
    for source, problem, files in _walk_files(corpus.root, stamps, corpus.exclude):
        name = os.path.basename(source)
        stem, extension = os.path.splitext(name)
        if problem is None and extension.lower() not in AUDIO_EXTENSIONS:
            continue
        ordinal += 1
        if not taken.holds(ordinal):
            continue
        if problem is not None:
            yield Rejection(source, problem)
        elif name not in files:  # a FIFO would block the decoder forever
            yield Rejection(source, "not a regular file: pipe, socket, device or dangling symlink")
        else:
            suffix = next((i for i, s in enumerate(TRANSCRIPT_SUFFIXES) if stem + s in files), None)
            if suffix is None:
                reason = "no transcript beside the audio (.normalized.txt, .txt or .lab)"
                yield Rejection(source, reason)
            elif not is_unicode(source):  # a byte that is not UTF-8 in a name (Latin-1 archives)
                yield Rejection(source, "file name is not valid UTF-8")
            else:
                speaker = os.path.dirname(source) or None
                yield Found(ordinal, source, suffix, None, speaker, None)


def _walk_files(
    root: str, stamps: list[Stamp], exclude: str | None
) -> Iterator[tuple[str, str | None, frozenset[str]]]:
    """Sorted recursive walk following symlinks, by path relative to ``root``:
    ``(path, None, names of the regular files beside it)`` per file, or ``(path, problem,
    …)`` for a folder or link that cannot be searched (a loop, no permission). Each folder
    listed is stamped; ``exclude`` is never entered."""
    seen: set[str] = set()
    nothing: frozenset[str] = frozenset()

    def visit(folder: str, prefix: str) -> Iterator[tuple[str, str | None, frozenset[str]]]:
        real = os.path.realpath(folder)
        if real == exclude:
            return
        if real in seen:
            yield prefix[:-1], "symlink loop: folder already visited, not searched again", nothing
            return
        seen.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            if not prefix:
                raise UserError(f"cannot list --src {folder}: {exc.strerror}") from None
            yield prefix[:-1], f"unreadable folder: {exc.strerror}", nothing
            return
        stamps.append(stamp(root, prefix or "."))
        listed: list[tuple[os.DirEntry[str], bool | OSError]] = []  # entry, is it a folder
        for entry in entries:
            try:
                listed.append((entry, entry.is_dir(follow_symlinks=True)))
            except OSError as exc:  # a link to itself: ELOOP
                listed.append((entry, exc))
        files = frozenset(e.name for e, kind in listed if kind is False and e.is_file())
        for entry, kind in listed:
            if isinstance(kind, OSError):
                yield prefix + entry.name, f"symlink loop: {kind.strerror}", nothing
            elif kind:
                yield from visit(entry.path, prefix + entry.name + "/")
            else:
                yield prefix + entry.name, None, files

    yield from visit(root, "")


def read_transcript_file(path: str) -> str:
    """A transcript file's text; :class:`ValueError` with the reason when it cannot be used."""
    name = os.path.basename(path)
    try:
        with open_regular(path) as file:
            return file.read().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"transcript not UTF-8: {name}") from None
    except OSError as exc:
        raise ValueError(f"transcript unreadable: {name}: {exc.strerror or exc}") from None


def transcript_path(corpus: Corpus, source: str, suffix: int) -> str:
    """The transcript file beside a folder corpus's audio file."""
    return os.path.join(corpus.root, os.path.splitext(source)[0] + TRANSCRIPT_SUFFIXES[suffix])


# ---- listings: metadata.csv and the manifest ---------------------------------------------
def _lines(path: str, taken: Slice) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset, bytes)`` of the lines in a slice."""
    offset = 0
    try:
        with open_regular(path) as file:
            for number, raw in enumerate(file, start=1):
                if taken.holds(number):
                    yield number, offset, raw
                offset += len(raw)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def _ljspeech_share(corpus: Corpus, taken: Slice) -> Iterator[Found | Rejection]:
    wavs = os.path.join(corpus.root, "wavs")
    try:
        present = {e.name for e in os.scandir(wavs) if e.is_file()}
    except FileNotFoundError:
        present = set()  # every row is then "audio file not found", counted
    except OSError as exc:
        raise UserError(f"cannot list {wavs}: {exc.strerror}") from None
    assert corpus.listing is not None
    for number, offset, raw in _lines(corpus.listing, taken):
        where = f"metadata.csv:{number}"
        try:
            uid, text = parse_metadata_row(raw, number)
        except ValueError as exc:
            yield Rejection(where, str(exc))
            continue
        if uid is None:
            continue
        name = next((uid + e for e in AUDIO_EXTENSIONS if uid + e in present), None)
        if name is None:
            yield Rejection(f"wavs/{uid}.wav", "audio file not found (listed in metadata.csv)")
            continue
        yield found(number, f"wavs/{name}", offset, text, None, None)


def parse_metadata_row(raw: bytes, number: int) -> tuple[str | None, str]:
    """``(id, text)`` of a metadata.csv row, ``(None, "")`` for a blank one; :class:`ValueError`
    with the reason for a malformed one."""
    try:
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError("metadata.csv row is not valid UTF-8") from None
    if not line:
        return None, ""
    fields = line.split("|")
    if len(fields) not in (2, 3) or not fields[0].strip():
        raise ValueError("malformed metadata.csv row: expected id|text or id|text|normalized")
    uid = fields[0].strip()
    if uid in (".", "..") or "/" in uid or "\\" in uid:  # ids name files inside wavs/ only
        raise ValueError("malformed metadata.csv row: id is a path")
    return uid, fields[2] if len(fields) == 3 and fields[2].strip() else fields[1]


def _manifest_share(corpus: Corpus, taken: Slice, sample_rate: int) -> Iterator[Found | Rejection]:
    assert corpus.listing is not None
    name = os.path.basename(corpus.listing)
    where = Where(corpus.where) if corpus.where is not None else None
    for number, offset, raw in _lines(corpus.listing, taken):
        if not raw.strip():
            continue
        try:
            source, text, speaker, samples, entry = parse_manifest_line(
                raw, corpus.root, sample_rate
            )
        except ValueError as exc:
            yield Rejection(f"{name}:{number}", str(exc))
            continue
        except LookupError as exc:  # the line is readable but its audio is not usable
            yield Rejection(exc.args[0], exc.args[1])
            continue
        if where is not None and not where(entry):
            yield Rejection(source, corpus.where or "", stage=FILTERED)  # counted, not listed
            continue
        yield found(number, source, offset, text, speaker, samples)


def parse_manifest_line(
    raw: bytes, root: str, sample_rate: int
) -> tuple[str, str | None, str | None, int | None, dict[str, Any]]:
    """``(source, text, speaker, samples at sample_rate or None, the whole row)`` of one
    manifest line.

    :class:`ValueError` when the line itself is bad; :class:`LookupError` with
    ``(audio_filepath, reason)`` when its audio path or length is unusable; ``text`` is
    ``None`` when missing or not a string.
    """
    entry = parse_json(raw, "manifest line")
    if not isinstance(entry, dict) or not isinstance(entry.get("audio_filepath"), str):
        raise ValueError("manifest line has no audio_filepath string")
    listed = entry["audio_filepath"]
    if _PLAIN_PATH.match(listed):  # already relative and normal: most rows of a large manifest
        source = listed
    else:  # lexically, not resolved: a symlink inside is the corpus's own business
        audio = os.path.normpath(os.path.join(root, listed))
        if not audio.startswith(root + os.sep):
            raise LookupError(listed, "audio path is outside the manifest's folder")
        source = audio[len(root) + 1 :]
    samples = listed_samples(entry, sample_rate)
    if isinstance(samples, str):
        raise LookupError(listed, samples)
    try:
        speaker = listed_speaker(entry)
    except ValueError as exc:
        raise LookupError(listed, str(exc)) from None
    text = entry.get("text")
    return source, text if isinstance(text, str) else None, speaker, samples, entry


def read_transcript(
    corpus: Corpus, source: str, locator: int
) -> tuple[str | None, str | None, dict[str, Any]]:
    """``(text, speaker, the row's metadata)`` of an utterance, read again from the corpus
    when it is written (check text and speaker with :func:`utterance_hash`); the metadata is
    ``{}`` for folders and LJSpeech, which have none; :class:`ValueError` when unreadable."""
    row: dict[str, Any] = {}
    if corpus.kind == "folder":
        text = read_transcript_file(transcript_path(corpus, source, locator))
        speaker = os.path.dirname(source) or None
    elif corpus.kind in ("tars", "parquet"):  # a Parquet row's text is in its spool
        data, is_json = read_member(corpus, source, locator)
        row, text, speaker = parse_text_member(data, is_json)
    else:
        assert corpus.listing is not None
        try:
            with open_regular(corpus.listing) as file:
                file.seek(locator)
                raw = file.readline(SMALL_FILE_LIMIT)
        except OSError as exc:
            raise ValueError(f"listing unreadable: {exc.strerror or exc}") from None
        if corpus.kind == "ljspeech":
            text, speaker = parse_metadata_row(raw, 1 if locator == 0 else 2)[1], None
        else:
            try:
                _, listed, speaker, _, row = parse_manifest_line(raw, corpus.root, 1)
            except LookupError as exc:
                raise ValueError(exc.args[1]) from None
            text = listed
    return text, speaker, row
