"""Find the utterances of a corpus in one of three layouts.

1. a folder searched recursively, audio with a transcript beside it
   (``<stem>.normalized.txt``, ``<stem>.txt`` or ``<stem>.lab``, in that order of preference);
2. an LJSpeech folder: ``metadata.csv`` rows ``id|text`` or ``id|text|normalized``, audio
   under ``wavs/``;
3. a JSONL manifest (NeMo / Lhotse convention): ``audio_filepath``, ``text``, optional
   ``speaker``; relative paths are relative to the manifest's folder.

Everything found is either an :class:`Utterance` or a :class:`Rejection` with a plain
reason, so "written + rejected = discovered" can be checked at the end. Transcripts must
be UTF-8 (a BOM is allowed); anything else is rejected rather than guessed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from preprocess.audio import AUDIO_EXTENSIONS
from preprocess.errors import UserError

TRANSCRIPT_SUFFIXES = (".normalized.txt", ".txt", ".lab")


@dataclasses.dataclass(frozen=True)
class Utterance:
    """One audio file and its transcript; ``source`` is the path relative to the corpus."""

    key: str
    audio: str
    text: str
    speaker: str | None
    source: str


@dataclasses.dataclass(frozen=True)
class Rejection:
    """An input that will not be written, and why."""

    source: str
    reason: str
    stage: str = "discover"


Found = Utterance | Rejection


def discover(src: Path) -> tuple[list[Utterance], list[Rejection], Path]:
    """Find every utterance under ``src``; return utterances, rejections and the corpus root.

    Raises :class:`UserError` when ``src`` is missing or holds no audio at all.
    """
    if not src.exists():
        raise UserError(f"--src {src} does not exist")
    if src.is_file():
        if src.suffix != ".jsonl":
            raise UserError(f"--src {src} is a file but not a .jsonl manifest")
        root, found = src.parent, _from_manifest(src)
    elif (src / "metadata.csv").is_file():
        root, found = src, _from_ljspeech(src)
    else:
        root, found = src, _from_folder(src)
    utterances, rejections = _unique_keys(found)
    if not utterances and not rejections:
        raise UserError(f"--src {src} holds no audio files ({', '.join(AUDIO_EXTENSIONS)})")
    return utterances, rejections, root


def _from_folder(root: Path) -> Iterator[Found]:
    for path, problem in _walk_files(root):
        source = path.relative_to(root).as_posix()
        if problem is not None:
            yield Rejection(source, problem)
            continue
        if path.suffix.lower() not in AUDIO_EXTENSIONS:
            continue
        if not path.is_file():  # a FIFO would block the decoder forever
            yield Rejection(source, "not a regular file: pipe, socket, device or dangling symlink")
            continue
        stem = path.name[: -len(path.suffix)]
        transcript = next(
            (
                path.with_name(stem + s)
                for s in TRANSCRIPT_SUFFIXES
                if path.with_name(stem + s).is_file()
            ),
            None,
        )
        if transcript is None:
            yield Rejection(
                source, "no transcript beside the audio (.normalized.txt, .txt or .lab)"
            )
            continue
        parent = path.parent.relative_to(root).as_posix()
        yield _checked(root, path, _read_text(transcript), None if parent == "." else parent)


def _walk_files(root: Path) -> Iterator[tuple[Path, str | None]]:
    """Sorted recursive walk following symlinks: ``(path, None)`` per file, or the problem
    that stops a folder or link from being searched (a loop, no permission)."""
    seen: set[str] = set()

    def visit(folder: Path) -> Iterator[tuple[Path, str | None]]:
        real = os.path.realpath(folder)
        if real in seen:
            yield folder, "symlink loop: folder already visited, not searched again"
            return
        seen.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            if folder == root:
                raise UserError(f"cannot list --src {folder}: {exc.strerror}") from None
            yield folder, f"unreadable folder: {exc.strerror}"
            return
        for entry in entries:
            path = Path(entry.path)
            try:
                is_dir = entry.is_dir(follow_symlinks=True)
            except OSError as exc:  # a link to itself: ELOOP
                yield path, f"symlink loop: {exc.strerror}"
                continue
            if is_dir:
                yield from visit(path)
            else:
                yield path, None

    yield from visit(root)


def _from_ljspeech(root: Path) -> Iterator[Found]:
    metadata = root / "metadata.csv"
    try:
        rows = metadata.read_bytes().splitlines()
    except OSError as exc:
        raise UserError(f"cannot read {metadata}: {exc.strerror}") from None
    for number, raw in enumerate(rows, start=1):
        where = f"metadata.csv:{number}"
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
        except UnicodeDecodeError:
            yield Rejection(where, "metadata.csv row is not valid UTF-8")
            continue
        if not line:
            continue
        fields = line.split("|")
        if len(fields) not in (2, 3) or not fields[0].strip():
            yield Rejection(
                where, "malformed metadata.csv row: expected id|text or id|text|normalized"
            )
            continue
        uid = fields[0].strip()
        if uid in (".", "..") or "/" in uid or "\\" in uid:  # ids name files inside wavs/ only
            yield Rejection(where, "malformed metadata.csv row: id is a path")
            continue
        text = fields[2] if len(fields) == 3 and fields[2].strip() else fields[1]
        audio = next(
            (
                root / "wavs" / (uid + e)
                for e in AUDIO_EXTENSIONS
                if (root / "wavs" / (uid + e)).is_file()
            ),
            None,
        )
        if audio is None:
            yield Rejection(f"wavs/{uid}.wav", "audio file not found (listed in metadata.csv)")
            continue
        yield _checked(root, audio, text, None)


def _from_manifest(manifest: Path) -> Iterator[Found]:
    root = manifest.parent.resolve()
    try:
        lines = manifest.read_bytes().splitlines()
    except OSError as exc:
        raise UserError(f"cannot read manifest {manifest}: {exc.strerror}") from None
    for number, raw in enumerate(lines, start=1):
        where = f"{manifest.name}:{number}"
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            yield Rejection(where, "manifest line is not UTF-8 JSON")
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("audio_filepath"), str):
            yield Rejection(where, "manifest line has no audio_filepath string")
            continue
        audio = (root / entry["audio_filepath"]).resolve()
        if not audio.is_relative_to(root):
            yield Rejection(entry["audio_filepath"], "audio path is outside the manifest's folder")
            continue
        if not audio.is_file():
            yield Rejection(
                entry["audio_filepath"], "audio file not found (listed in the manifest)"
            )
            continue
        text = entry.get("text")
        speaker = entry.get("speaker")
        yield _checked(
            root,
            audio,
            text
            if isinstance(text, str)
            else Rejection("", "manifest text is missing or not a string"),
            None if speaker is None else str(speaker),
        )


def _read_text(path: Path) -> str | Rejection:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        return Rejection("", f"transcript not UTF-8: {path.name}")
    except OSError as exc:
        return Rejection("", f"transcript unreadable: {path.name}: {exc.strerror}")


def _checked(root: Path, audio: Path, text: str | Rejection, speaker: str | None) -> Found:
    """An Utterance, or the Rejection its transcript earned; the key is filled in later."""
    source = audio.relative_to(root).as_posix()
    if isinstance(text, Rejection):
        return Rejection(source, text.reason)
    text = " ".join(text.split())
    if not text:
        return Rejection(source, "empty transcript")
    return Utterance(key="", audio=str(audio), text=text, speaker=speaker, source=source)


def _unique_keys(found: Iterator[Found]) -> tuple[list[Utterance], list[Rejection]]:
    """Give each utterance a dot-free key unique in the cache (``_2``, ``_3`` on collisions)."""
    utterances: list[Utterance] = []
    rejections: list[Rejection] = []
    taken: set[str] = set()
    for item in found:
        if isinstance(item, Rejection):
            rejections.append(item)
            continue
        base = re.sub(r"[^\w\-]+", "_", item.source.rsplit(".", 1)[0]).strip("_") or "utt"
        key, n = base, 1
        while key in taken:
            n += 1
            key = f"{base}_{n}"
        taken.add(key)
        utterances.append(dataclasses.replace(item, key=key))
    return utterances, rejections
