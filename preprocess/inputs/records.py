"""What the build knows of a corpus's inputs before it writes them: where the corpus is, which
slice of it a scan takes, and each input as found (an utterance or a rejection), with the
hashes that name an utterance's metadata and key without keeping its text."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import Any

from melcache.bounded import loads_json
from melcache.format import is_unicode

RECEIPTS = ".build"  # the build's own state inside OUT: receipts, scans, the plan, spools
Stamp = tuple[str, int, int]  # a listing's path relative to the corpus, mtime_ns, size


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Where a corpus is: its ``kind`` (folder, ljspeech, manifest, tars, parquet), the folder
    its sources are relative to, the listing file (metadata.csv, the manifest) if it has one,
    the archives (tars, Parquet files) it is packed in, the ``--where`` selection on its
    metadata, and for Parquet the audio, text and speaker columns and the spool folder."""

    kind: str
    root: str
    listing: str | None = None
    exclude: str | None = None  # a folder inside not to search: the build's own OUT
    archives: tuple[str, ...] = ()
    where: str | None = None
    columns: tuple[str, str, str] | None = None
    spool: str | None = None  # where Parquet audio is copied as tars while the build runs

    def audio_path(self, source: str) -> str:
        """The audio file of an utterance."""
        return os.path.join(self.root, source)

    def archive_path(self, archive: str) -> str:
        """The tar holding an archive's audio: the tar itself, or a Parquet file's spool."""
        if self.spool is not None:
            return os.path.join(self.spool, archive + ".tar")
        return os.path.join(self.root, archive)

    def identity(self) -> list[object]:
        """What a scan or a build is of: the corpus (by place) and the selection on it."""
        place = [self.kind, self.root, self.listing, list(self.archives), self.where]
        return [*place, list(self.columns)] if self.columns else place


@dataclasses.dataclass(frozen=True)
class Slice:
    """Which inputs a scan takes: part ``part`` of ``parts`` (the inputs whose ordinal is
    ``part`` modulo ``parts``), and of those, piece ``piece`` of ``pieces`` (one per worker
    process of that part)."""

    part: int
    parts: int
    piece: int = 0
    pieces: int = 1

    def holds(self, ordinal: int) -> bool:
        """Whether the input numbered ``ordinal`` is in this slice."""
        return (
            ordinal % self.parts == self.part
            and (ordinal // self.parts) % self.pieces == self.piece
        )


@dataclasses.dataclass(frozen=True, slots=True)  # one per input while scanning: no __dict__
class Found:
    """An input of this part's share that names an audio file. ``locator`` says where its
    transcript is (a suffix number, or its line's byte offset); ``content`` (the hash of its
    text, :func:`utterance_hash`) is ``None`` when a worker reads a transcript file;
    ``samples`` (at the target rate) is ``None`` when a worker reads the audio header."""

    ordinal: int
    source: str
    locator: int
    content: int | None
    speaker: str | None
    samples: int | None
    audio_at: int = -1  # in a tar: where the audio member's bytes start


def unit_of(kind: str, ordinal: int) -> int:
    """What parts deal out: an input, or for tars and Parquet (ordinal = file << 32 | sample)
    a whole file."""
    return ordinal >> 32 if kind in ("tars", "parquet") else ordinal


FILTERED = "filtered"  # the stage of an input --where left out: counted, never listed


@dataclasses.dataclass(frozen=True, slots=True)
class Rejection:
    """An input that will not be written, and why."""

    source: str
    reason: str
    stage: str = "discover"


# ---- one utterance ---------------------------------------------------------------------------
def found(
    ordinal: int,
    source: str,
    locator: int,
    text: str | None,
    speaker: str | None,
    samples: int | None,
    audio_at: int = -1,
) -> Found | Rejection:
    """An input whose text is known: :class:`Found` with its hash, or why it is rejected."""
    content = utterance_hash(source, text, speaker)
    if isinstance(content, str):
        return Rejection(source, content)
    return Found(ordinal, source, locator, content, speaker, samples, audio_at)


def stamp(root: str, rel: str) -> Stamp:
    """``(rel, mtime_ns, size)`` of a folder or listing file, ``-1``s when it is gone."""
    try:
        info = os.stat(os.path.join(root, rel))
    except OSError:
        return rel, -1, -1
    return rel, info.st_mtime_ns, info.st_size


def clean_text(text: str) -> str:
    """A transcript with its whitespace collapsed: what a shard stores."""
    return " ".join(text.split())


def utterance_hash(source: str, text: str | None, speaker: str | None) -> int | str:
    """A 64-bit digest of what a sample stores besides its audio (source, cleaned text,
    speaker), or the reason they cannot be stored: equal hashes, equal metadata."""
    if text is not None and (text := clean_text(text)):
        try:
            data = "\0".join((source, text, speaker if speaker is not None else "\1")).encode()
            return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        except UnicodeEncodeError:  # JSON can escape a lone surrogate that UTF-8 cannot hold
            pass
    if not is_unicode(source):  # a byte that is not UTF-8 in a name (old Latin-1 archives)
        return "file name is not valid UTF-8"
    if text is None:
        return "manifest text is missing or not a string"
    if not text:
        return "empty transcript"
    return f"{'transcript' if not is_unicode(text) else 'speaker'} is not valid Unicode (a lone surrogate)"


def key_base(source: str) -> str:
    """The sample key a source would get: path separators and dots as ``_``, before the
    ``_2``, ``_3`` that tell apart sources with one base."""
    return re.sub(r"[^\w\-]+", "_", source.rsplit(".", 1)[0]).strip("_") or "utt"


def key_digest(key: str) -> int:
    """A 64-bit digest of a key, the same in every process (``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def printable(text: str) -> str:
    """``text`` with each undecodable file-name byte as ``\\xNN`` and each lone surrogate as
    ``\\udNNN``: what a rejection record can hold."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Longer than any recording (31 years): a length beyond it is a wrong field, not audio, and
# its sample count would not fit the scan's 64-bit columns.
MAX_LISTED_SECONDS = 10**9
_MAX = f"{MAX_LISTED_SECONDS:.0e} s"


def listed_samples(entry: dict, sample_rate: int) -> int | str | None:
    """The length metadata gives, at ``sample_rate``: from ``num_samples`` and
    ``sampling_rate``, else ``duration``; ``None`` when it gives none (a null, which Parquet
    has for a missing value, is none), a reason when invalid or beyond
    :data:`MAX_LISTED_SECONDS`."""
    count, rate = entry.get("num_samples"), entry.get("sampling_rate")
    if count is not None or rate is not None:
        if type(count) is not int or type(rate) is not int or count < 0 or rate <= 0:
            return "manifest num_samples/sampling_rate are not a count and a positive rate"
        if count > MAX_LISTED_SECONDS * rate:  # Python ints: no overflow before this check
            return f"manifest num_samples/sampling_rate give over {_MAX}: no recording is that long"
        return (2 * count * sample_rate + rate) // (2 * rate)  # as soxr rounds
    seconds = entry.get("duration")
    if seconds is not None:
        if type(seconds) not in (int, float) or not 0 <= seconds < math.inf:
            return "manifest duration is not a finite number of seconds ≥ 0"
        if seconds > MAX_LISTED_SECONDS:
            return f"manifest duration is over {_MAX}: no recording is that long"
        # Half up, as soxr rounds; the 1e-7 sample absorbs float error in seconds = frames/rate,
        # so an exact duration plans the length the header would.
        return math.floor(seconds * sample_rate + 0.5 + 1e-7)
    return None


def listed_speaker(entry: dict, what: str = "manifest speaker") -> str | None:
    """The ``speaker`` of metadata as a string (a number is one), ``None`` when absent;
    :class:`ValueError` naming ``what`` for a list, an object or anything else."""
    speaker = entry.get("speaker")
    if speaker is None or isinstance(speaker, str):
        return speaker
    if type(speaker) in (int, float):  # speaker ids are often numbers; bool is not one
        return str(speaker)
    raise ValueError(f"{what} is {type(speaker).__name__}, not a string or a number")


def parse_json(data: bytes, what: str) -> Any:
    """``data`` as UTF-8 JSON; :class:`ValueError` "WHAT is not UTF-8 JSON", with the reason
    when the text is JSON the parser cannot hold (nested too deeply, an integer of 5,000
    digits)."""
    try:
        return loads_json(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{what} is not UTF-8 JSON") from None
    except ValueError as exc:
        raise ValueError(f"{what} is not UTF-8 JSON: {short(exc)}") from None


def short(exc: BaseException) -> str:
    """An exception's message on one line, or its type's name when it has none."""
    return " ".join(str(exc).split()) or type(exc).__name__
