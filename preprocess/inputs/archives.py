"""Corpora shipped as WebDataset audio tars (the Emilia layout), read in place, never unpacked.

A sample is the members of a tar sharing a key (the path up to the first dot of the file
name): one audio member (``.flac .wav .mp3 .opus .ogg``) and a ``.json`` (``text``, and
optionally ``speaker``, ``duration`` or ``num_samples`` + ``sampling_rate``, and any fields
``--where`` selects on) or, without a json, a ``.txt`` transcript. Tars are plain
(uncompressed) so that scanning reads member headers and the json only, seeking past the
audio, and the writer later reads one member at its offset. Parts take whole tars. Its
source is ``TAR:KEY.EXT``; a sample lacking audio or text, and the rest of a damaged tar,
are rejections with reasons.
"""

from __future__ import annotations

import glob
import io
import os
import tarfile
from collections.abc import Iterator
from typing import IO, Any

from braceexpand import braceexpand

from melcache.bounded import open_regular
from melcache.errors import UserError
from preprocess.inputs.audio import AudioError
from preprocess.inputs.records import (
    FILTERED,
    Corpus,
    Found,
    Rejection,
    found,
    listed_samples,
    listed_speaker,
    parse_json,
    short,
)
from preprocess.inputs.where import Where

TAR_AUDIO = ("flac", "wav", "mp3", "opus", "ogg")
# A transcript member, or a pax / GNU long-name header, is far below this; a header that
# claims more (2**62 in a crafted tar) is refused before anything is allocated for it.
TEXT_MEMBER_LIMIT = 16 * 2**20


ARCHIVE_KINDS = {".tar": "tars", ".parquet": "parquet"}


def find_archives(src: str) -> tuple[str, str, tuple[str, ...]] | None:
    """``(kind, root, paths relative to root)`` when ``src`` names WebDataset tars or Parquet
    files: one file, a brace or glob pattern (``'EN/EN-B{000000..000999}.tar'``), or a folder
    with such files at its top level; else ``None``. One kind at a time."""
    if any(c in src for c in "{*?["):
        paths = sorted({p for pattern in braceexpand(src) for p in glob.glob(pattern)})
        if not paths:
            raise UserError(f"--src {src!r} matches no file")
    elif os.path.splitext(src)[1] in ARCHIVE_KINDS and os.path.isfile(src):
        paths = [src]
    elif os.path.isdir(src):
        paths = sorted(e.path for e in os.scandir(src) if _archive_kind(e.name) and e.is_file())
        if not paths:
            return None
    else:
        return None
    kinds = {_archive_kind(p) for p in paths}
    if len(kinds) != 1 or None in kinds:
        names = ", ".join(sorted({os.path.splitext(p)[1] or os.path.basename(p) for p in paths}))
        raise UserError(f"--src {src} must name .tar or .parquet files, one kind; it has {names}")
    paths = [os.path.abspath(p) for p in paths]
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    return kinds.pop(), root, tuple(os.path.relpath(p, root) for p in paths)


def _archive_kind(name: str) -> str | None:
    return ARCHIVE_KINDS.get(os.path.splitext(name)[1])


def tar_samples(
    corpus: Corpus, number: int, rel: str, sample_rate: int, where: Where | None
) -> Iterator[Found | Rejection]:
    """The samples of tar ``number`` (``rel``), in tar order, read in place."""
    count, key, members, repeated = 0, "", {}, False
    try:
        with open_regular(os.path.join(corpus.root, rel)) as file, _open_tar(file) as tar:
            size = os.fstat(file.fileno()).st_size
            for info in tar:  # headers only: tarfile seeks past each member's data
                if not info.isfile():
                    _within(info, size)
                    continue
                folder, name = os.path.split(info.name)  # the pax / GNU long name if any
                stem, extension = name.partition(".")[0], member_extension(name)
                same = os.path.join(folder, stem) == key
                if members and (not same or extension in members):
                    ordinal = number << 32 | count
                    yield _sample(tar, rel, ordinal, key, members, repeated, sample_rate, where)
                    count, members, repeated = count + 1, {}, same
                _within(info, size)  # after the sample before it is out
                key = os.path.join(folder, stem)
                members[extension] = info
            if members:
                ordinal = number << 32 | count
                yield _sample(tar, rel, ordinal, key, members, repeated, sample_rate, where)
    except (tarfile.TarError, OSError, EOFError, UnicodeDecodeError) as exc:
        yield Rejection(rel, f"damaged tar after {count} samples: {short(exc)}")


def member_extension(name: str) -> str:
    """What a member's name says it holds: all after the first dot of its file name, in lower
    case (``KEY.JSON`` → ``json``, ``KEY.wav.json`` → ``wav.json``), as webdataset groups."""
    return os.path.basename(name).partition(".")[2].lower()


def _within(info: tarfile.TarInfo, size: int) -> None:
    """:class:`tarfile.ReadError` when a member's header claims bytes the tar does not have."""
    if info.offset_data + info.size > size:
        raise tarfile.ReadError(_past_the_end(info, size))


def _past_the_end(info: tarfile.TarInfo, size: int) -> str:
    return f"{info.name!r} claims {info.size} bytes, past the end of the {size}-byte tar"


def _open_tar(file: IO[bytes]) -> tarfile.TarFile:
    """``file`` as an uncompressed tar from where it stands, every read tarfile makes capped."""
    return tarfile.open(fileobj=_CappedReads(file), mode="r:")  # type: ignore[arg-type]


class _CappedReads:
    """A file whose reads are at most :data:`TEXT_MEMBER_LIMIT` bytes each. Hand-written
    because tarfile reads a pax or GNU long-name header whole at the size its own header
    claims, before any caller could look at it."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes; :class:`OSError` when ``size`` is beyond the cap."""
        if not 0 <= size <= TEXT_MEMBER_LIMIT:
            raise OSError(f"a tar header claims {size} bytes, more than a header may have")
        return self.file.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move, as the file's own ``seek``."""
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        """Where the file stands."""
        return self.file.tell()


def _sample(
    tar: tarfile.TarFile,
    rel: str,
    ordinal: int,
    key: str,
    members: dict[str, tarfile.TarInfo],
    repeated: bool,
    sample_rate: int,
    where: Where | None,
) -> Found | Rejection:
    audio = next((e for e in TAR_AUDIO if e in members), None)
    source = f"{rel}:{key}" + (f".{audio}" if audio else "")
    if repeated:  # webdataset would merge it into the sample before it, or refuse it
        return Rejection(source, "duplicate key: the sample before it in the tar has this key")
    if audio is None:
        return Rejection(source, "sample has no audio member (.flac .wav .mp3 .opus .ogg)")
    text_member = members.get("json") or members.get("txt")
    if text_member is None:
        return Rejection(source, "sample has no text: no .json, no .txt")
    if text_member.size > TEXT_MEMBER_LIMIT:
        return Rejection(source, f"sample text member is {text_member.size} bytes, over 16 MiB")
    data = tar.extractfile(text_member).read()  # type: ignore[union-attr]
    try:
        meta, text, speaker = parse_text_member(data, json_member="json" in members)
    except ValueError as exc:
        return Rejection(source, str(exc))
    if where is not None and not where(meta):
        return Rejection(source, where.text, stage=FILTERED)
    samples = listed_samples(meta, sample_rate)
    if isinstance(samples, str):
        return Rejection(source, samples.replace("manifest", "sample json"))
    audio_at = members[audio].offset  # its first header: a pax or GNU name header, if any
    return found(ordinal, source, text_member.offset, text, speaker, samples, audio_at)


def parse_text_member(data: bytes, json_member: bool) -> tuple[dict[str, Any], str, str | None]:
    """``(metadata, text, speaker)`` of a sample's ``.json`` (or ``.txt``); :class:`ValueError`
    with the reason when it has no text or a bad speaker."""
    if not json_member:
        try:
            return {}, data.decode("utf-8-sig"), None
        except UnicodeDecodeError:
            raise ValueError("sample txt is not UTF-8") from None
    meta = parse_json(data, "sample json")
    if not isinstance(meta, dict) or not isinstance(meta.get("text"), str):
        raise ValueError("sample json has no text string")
    return meta, meta["text"], listed_speaker(meta, "sample json speaker")


def read_member(corpus: Corpus, source: str, offset: int) -> tuple[bytes, bool]:
    """The bytes of the tar member whose first header is at ``offset``, and whether it is a
    json (by its real name, pax or GNU long names included); :class:`ValueError` when the tar
    no longer holds it, or its header claims more bytes than the tar has."""
    path = corpus.archive_path(source.rsplit(":", 1)[0])
    try:
        with open_regular(path) as file:
            size = os.fstat(file.fileno()).st_size
            file.seek(offset)
            with _open_tar(file) as tar:
                info = tar.firstmember
                if info is None or not info.isfile():
                    raise ValueError("tar member unreadable: no file member there")
                if info.offset_data + info.size > size:
                    raise ValueError(f"tar member unreadable: {_past_the_end(info, size)}")
                file.seek(info.offset_data)
                data = file.read(info.size)
    except (OSError, tarfile.TarError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"tar member unreadable: {short(exc)}") from None
    if len(data) != info.size:
        raise ValueError("tar member cut short")
    return data, member_extension(info.name) == "json"


def audio_input(corpus: Corpus, source: str, audio_at: int) -> str | io.BytesIO:
    """What soundfile opens for an utterance: its file, or its tar member's bytes;
    :class:`AudioError` when the member cannot be read."""
    if audio_at < 0:
        return corpus.audio_path(source)
    try:
        data, _ = read_member(corpus, source, audio_at)
    except ValueError as exc:
        raise AudioError(f"unreadable audio: {exc}") from None
    return io.BytesIO(data)
