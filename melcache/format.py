"""The on-disk format of a melcache cache: the one module that knows member names and dtypes.

A cache folder holds ``index.json`` (written last: its presence means the cache is
complete), ``rejected.jsonl``, ``stats.zarr`` and tar shards named ``bNN-NNNNNN.tar``.
Each shard holds utterances of one length bucket, one WebDataset sample per utterance:

- ``<key>.mel.npy``: float16 ``[frames, n_mels]`` natural-log mel, ``np.save`` format, or
  ``<key>.mel.q5`` in a cache built with the compact storage (:mod:`melcache.storage`);
- ``<key>.json``: UTF-8 metadata (text, speaker, seconds, frames, sample_rate, source, bucket,
  and ``extras`` in a cache built with ``[build] extras``: :mod:`melcache.extras`);
- ``<key>.flac``: the resampled mono audio, only when built with ``--keep-audio``.

Readers decode only these members, ``np.load(..., allow_pickle=False)`` for the mel, and
ignore anything else, so a planted ``.pickle`` member is never deserialised.

The writer and the readers live side by side here. The general readers
(:func:`iter_members`, tarfile in stream mode; :func:`decode_mel_npy`, ``np.load``) accept any
valid tar and ``.npy``; they cost ~200 µs and ~130 µs per sample, more than the rest of the
loader together, so :func:`tar_members` walks the plain ustar headers the writer makes by
slicing an in-memory shard (members become zero-copy views) and :func:`fast_decode_mel`
reads the one header ``np.save`` writes for ``MEL_DTYPE``. Both hand anything unusual (pax
or GNU headers, links, other array headers) to the general readers, so their rules are
one set.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import mmap
import os
import re
import socket
import tarfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import webdataset as wds
import xxhash

from melcache.bounded import loads_json
from melcache.errors import ShardError
from melcache.storage import FP16, MEL_MEMBERS

FORMAT_VERSION = 1
INDEX_NAME = "index.json"
REJECTED_NAME = "rejected.jsonl"
STATS_NAME = "stats.zarr"
MEL_MEMBER = MEL_MEMBERS[FP16]
META_MEMBER = "json"
AUDIO_MEMBER = "flac"
KNOWN_MEMBERS = (*MEL_MEMBERS.values(), META_MEMBER, AUDIO_MEMBER)
MEL_DTYPE = np.dtype("<f2")
SHARD_PATTERN = re.compile(r"^b(\d{2})-(\d{6})\.tar$")
# Fixed tar metadata: same input and config give byte-identical shards.
TAR_MTIME = 0
TAR_OWNER = "melcache"

# This machine as temporary file names and build markers name it.
HOST_TAG = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"
_TEMP_NAME = re.compile(r"\.(?:(?P<host>[A-Za-z0-9_]+)-)?(?P<pid>\d+)\.tmp$")
_FP16_EXPONENT = 0x7C00
_BLOCK = 512
_END_BLOCK = bytes(_BLOCK)
_REGULAR_FILE = (b"0", b"\0")
# The exact header np.save writes for a C-ordered 2-D MEL_DTYPE array (format 1.0).
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER = re.compile(
    rb"\{'descr': '%s', 'fortran_order': False, 'shape': \((\d+), (\d+)\), \} *\n"
    % MEL_DTYPE.str.encode()
)


def shard_name(bucket: int, number: int) -> str:
    """File name of shard ``number`` (global in the build plan) of length bucket ``bucket``."""
    return f"b{bucket:02d}-{number:06d}.tar"


def encode_sample(
    key: str,
    mel: np.ndarray | bytes,
    meta: dict[str, Any],
    flac: bytes | None = None,
    mel_member: str = MEL_MEMBER,
) -> dict[str, Any]:
    """Serialise one utterance into the tar members of a WebDataset sample: ``mel`` is a
    float16 array (stored as ``mel.npy``) or the bytes of ``mel_member`` already encoded."""
    sample: dict[str, Any] = {
        "__key__": key,
        mel_member: mel if isinstance(mel, bytes) else encode_npy(mel),
        META_MEMBER: json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8"),
    }
    if flac is not None:
        sample[AUDIO_MEMBER] = flac
    return sample


def encode_npy(mel: np.ndarray) -> bytes:
    """A mel as ``mel.npy`` bytes: ``MEL_DTYPE`` in ``np.save`` format (its 1.0 header, then
    the array's bytes; ``np.save`` copied them three times through its buffered iterator)."""
    mel = np.ascontiguousarray(mel, dtype=MEL_DTYPE)
    return _npy_header(mel.shape) + mel.tobytes()


@functools.lru_cache(maxsize=4096)  # one per frame count
def _npy_header(shape: tuple[int, ...]) -> bytes:
    header = {"descr": MEL_DTYPE.str, "fortran_order": False, "shape": shape}
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def decode_mel_npy(data: bytes, n_mels: int, where: str) -> np.ndarray:
    """Parse a ``mel.npy`` member without unpickling; check dtype and shape."""
    try:
        mel = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # a garbled header reaches ast/tokenize: any of their errors
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever raised
        raise ShardError(f"{where}: mel.npy is not a plain numpy array ({detail})") from None
    if mel.dtype != MEL_DTYPE or mel.ndim != 2 or mel.shape[1] != n_mels:
        raise ShardError(
            f"{where}: mel.npy has dtype {mel.dtype} shape {mel.shape}, "
            f"expected float16 [frames, {n_mels}]"
        )
    return mel


def finite_mel(mel: np.ndarray) -> bool:
    """True when a ``MEL_DTYPE`` array holds no NaN or infinity: a float16 whose exponent bits
    are all ones is one of them (6× faster than ``np.isfinite`` on float16)."""
    if mel.size == 0:
        return True
    exponents = np.bitwise_and(mel.view(np.uint16), _FP16_EXPONENT)
    return int(exponents.max()) != _FP16_EXPONENT


def is_unicode(text: str) -> bool:
    """Whether ``text`` can be stored as UTF-8: no lone surrogate, such as the ones Python
    gives a file name's undecodable bytes or JSON's ``"\\ud800"``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode_meta(data: bytes, where: str) -> dict[str, Any]:
    """Parse a ``json`` member."""
    try:
        meta = loads_json(data.decode("utf-8"))
    except ValueError as exc:  # also UnicodeDecodeError, and nesting too deep
        raise ShardError(f"{where}: json member is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ShardError(f"{where}: json member is not an object")
    return meta


class WrittenSample(NamedTuple):
    """Where :meth:`SampleTarWriter.write` put a sample: its offset in the archive, each
    member's ``(header offset, data offset, size)`` there (the header's, a pax header's where
    one leads), and its bytes from its first header to its last member's data."""

    offset: int
    spans: dict[str, tuple[int, int, int]]
    data: memoryview


class SampleTarWriter:
    """Writes WebDataset samples as ``wds.TarWriter(encoder=False)`` does, byte for byte (its
    members sorted by name, tarfile's pax headers, the fixed owner, mode and mtime that make
    shards reproducible), but each sample whole in one write: tarfile's stream mode cut
    every member into 10 KiB writes, each through the hashing stream and a system call."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.offset = 0

    def write(self, sample: dict[str, Any]) -> WrittenSample:
        """Append one sample (``__key__`` and its members' bytes); return where it went."""
        key, parts, spans, at, padding = sample["__key__"], [], {}, self.offset, 0
        for member in sorted(sample):
            if member.startswith("_"):  # __key__, and metadata wds.TarWriter leaves out too
                continue
            data = sample[member]
            header = tar_header(f"{key}.{member}", len(data))
            spans[member] = (at, at + len(header), len(data))
            padding = -len(data) % _BLOCK
            parts += [header, data, _zeros(padding)]
            at += len(header) + len(data) + padding
        record = b"".join(parts)
        self.stream.write(record)
        written = WrittenSample(self.offset, spans, memoryview(record)[: len(record) - padding])
        self.offset += len(record)
        return written

    def close(self) -> None:
        """End the archive as tarfile does: two zero blocks, then zeros to a whole record."""
        end = 2 * _BLOCK + -(self.offset + 2 * _BLOCK) % tarfile.RECORDSIZE
        self.stream.write(_zeros(end))
        self.offset += end

    def __enter__(self) -> SampleTarWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tar_header(name: str, size: int) -> bytes:
    """The header tarfile writes for a member of the writer's fixed metadata (``TarInfo``'s
    ``tobuf`` in pax format: a pax header first where the name or size needs one)."""
    if len(name) > _NAME_FIELD or size >= _LARGEST_SIZE or not name.isascii():
        return _tarfile_header(name, size)
    # A plain ustar header differs from member to member only in its name, size and checksum
    # fields, so it is patched into tarfile's own: 3 µs, against tobuf's 20 µs (2-3 a sample).
    name_field = name.encode("ascii").ljust(_NAME_FIELD, b"\0")
    size_field = b"%011o\0" % size
    checksum = _TEMPLATE_SUM + sum(name_field) + sum(size_field)
    return b"".join(
        (
            name_field,
            _TEMPLATE[100:124],
            size_field,
            _TEMPLATE[136:148],
            b"%06o\0 " % checksum,
            _TEMPLATE[156:],
        )
    )


def _tarfile_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, TAR_MTIME, 0o444
    info.uname = info.gname = TAR_OWNER
    return info.tobuf(tarfile.PAX_FORMAT)


_NAME_FIELD = 100
_LARGEST_SIZE = 8**11  # the size field's 11 octal digits; tarfile adds a pax header beyond
_TEMPLATE = _tarfile_header("", 0)
# The checksum counts its own 8-byte field as spaces (8 × 32); name and size are added per member.
_TEMPLATE_SUM = sum(_TEMPLATE[100:124]) + sum(_TEMPLATE[136:148]) + 8 * 32 + sum(_TEMPLATE[156:])


@functools.cache
def _zeros(count: int) -> bytes:
    return bytes(count)


def open_tar_writer(stream: IO[bytes]) -> SampleTarWriter:
    """A tar writer of WebDataset samples with the fixed metadata that makes shards
    reproducible."""
    return SampleTarWriter(stream)


def iter_members(
    stream: IO[bytes], where: str, on_unknown: Callable[[str], None] | None = None
) -> Iterator[tuple[str, str, bytes]]:
    """Yield ``(key, member, data)`` for each known member of a shard stream, in tar order.

    Unknown members (``.pickle``, ``.pyd``, …) are skipped unread (reported to
    ``on_unknown``); a key with a path
    separator (``../x``, ``/etc/x``) is rejected. Nothing is ever extracted to the filesystem.
    """
    select = functools.partial(_is_known_member, on_unknown=on_unknown)
    entries = wds.tariterators.tar_file_iterator(stream, select_files=select)
    try:
        for entry in entries:
            name = entry["fname"]
            key, member = name.split(".", 1)
            if "/" in key or "\\" in key:  # melcache keys are flat; anything else was planted
                raise ShardError(f"{where}: unsafe member name {name!r}")
            yield key, member, entry["data"]
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        detail = str(exc).split(" @ ", 1)[0]  # webdataset appends " @ <file object>"
        raise ShardError(f"{where}: not a readable tar ({detail})") from None


def _is_known_member(name: str, on_unknown: Callable[[str], None] | None) -> bool:
    known = name.partition(".")[2] in KNOWN_MEMBERS
    if not known and on_unknown is not None:
        on_unknown(name)
    return known


def group_samples(
    members: Iterator[tuple[str, str, bytes]], where: str
) -> Iterator[dict[str, bytes | str]]:
    """Group consecutive members of one key into a sample dict keyed by member name."""
    sample: dict[str, bytes | str] = {}
    for key, member, data in members:
        if sample and sample["__key__"] != key:
            yield sample
            sample = {}
        if member in sample:
            raise ShardError(f"{where}: duplicate member {key}.{member}")
        sample["__key__"] = key
        sample[member] = data
    if sample:
        yield sample


class HashingStream:
    """Wraps a binary file and hashes every byte written, so a shard is hashed in the same pass
    that writes it, not in a second read: ``digests`` by index field name (sha256, xxh3_128)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digests = {"sha256": hashlib.sha256(), "xxh3_128": xxhash.xxh3_128()}

    def write(self, data: bytes) -> int:
        for digest in self.digests.values():
            digest.update(data)
        return self.raw.write(data)

    def hexdigests(self) -> dict[str, str]:
        """The digest of everything written so far, by index field name."""
        return {field: digest.hexdigest() for field, digest in self.digests.items()}


def temp_path(path: Path) -> Path:
    """A temporary name beside ``path`` that says who writes it, ``NAME.HOST-PID.tmp``: builds
    on several machines (or twice on one) share a folder, and a sweep may only remove the
    temporary files of writers that are gone (:func:`temp_owner`)."""
    return path.with_name(f"{path.name}.{HOST_TAG}-{os.getpid()}.tmp")


def temp_owner(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the writer of a temporary file named by :func:`temp_path` (host ""
    for the older ``NAME.PID.tmp``); ``None`` when ``name`` is no such file."""
    match = _TEMP_NAME.search(name)
    if match is None:
        return None
    return match["host"] or "", int(match["pid"])


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, then rename: never half a file."""
    temp = temp_path(path)
    try:
        temp.write_bytes(data)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)  # gone after the rename; a failed write leaves nothing


class _NotPlainTar(Exception):
    """Something the fast path does not handle; :func:`iter_members` takes over."""


def tar_members(
    data: bytes | mmap.mmap | memoryview,
    where: str,
    on_unknown: Callable[[str], None] | None = None,
    *,
    complete: bool = True,
) -> Iterator[tuple[str, str, bytes | memoryview]]:
    """``(key, member, data)`` for each known member of an in-memory shard, in tar order.

    Same contract as :func:`iter_members`, which handles every case this fast path
    declines (extension headers, links, bad checksums, a cut-off archive): unknown members
    are skipped unread (reported to ``on_unknown``), a key with a path separator raises,
    damage raises ShardError. ``complete=False`` accepts data that ends after a member
    (samples cut from a shard) instead of at an end-of-archive block.
    """
    try:
        members = _plain_tar_members(data, where, on_unknown, complete)
    except _NotPlainTar:
        if not complete:  # tarfile wants the last member padded and an end-of-archive block
            data = bytes(data) + bytes(-len(data) % _BLOCK + 2 * _BLOCK)
        return iter_members(io.BytesIO(data), where, on_unknown)
    return iter(members)


def _plain_tar_members(
    data: bytes | mmap.mmap | memoryview,
    where: str,
    on_unknown: Callable[[str], None] | None,
    complete: bool,
) -> list[tuple[str, str, memoryview]]:
    view, members, unknown = memoryview(data), [], []
    for name, start, size in _plain_tar_entries(data, complete):
        key, _, member = name.partition(".")
        if member not in KNOWN_MEMBERS:
            unknown.append(name)
            continue
        if "/" in key or "\\" in key:  # melcache keys are flat; anything else was planted
            raise ShardError(f"{where}: unsafe member name {name!r}")
        members.append((key, member, view[start : start + size]))
    if on_unknown is not None:  # reported only once the fast path has accepted the tar
        for name in unknown:
            on_unknown(name)
    return members


def plain_tar_entries(data: bytes | mmap.mmap) -> list[tuple[str, int, int]] | None:
    """``(name, data offset, size)`` of every member of a plain ustar archive as the writer
    makes them (each header the 512 bytes before its data); ``None`` for anything else
    (extension headers, links, bad checksums, a cut), which :mod:`tarfile` reads."""
    try:
        return _plain_tar_entries(data)
    except _NotPlainTar:
        return None


def _plain_tar_entries(
    data: bytes | mmap.mmap | memoryview, complete: bool = True
) -> list[tuple[str, int, int]]:
    pos, entries = 0, []
    while pos + _BLOCK <= len(data):
        header = bytes(data[pos : pos + _BLOCK])  # a memoryview's slice is not bytes
        if header == _END_BLOCK:
            return entries
        if header[156:157] not in _REGULAR_FILE or header[345:346] != b"\0":
            raise _NotPlainTar  # pax/GNU extension, link, or a ustar name prefix
        # The checksum field counts as eight spaces (8 × 32 = 256) in its own sum.
        if _octal(header[148:156]) != sum(header) - sum(header[148:156]) + 256:
            raise _NotPlainTar
        size = _octal(header[124:136])
        start, pos = pos + _BLOCK, pos + _BLOCK + -(-size // _BLOCK) * _BLOCK
        if start + size > len(data):
            raise _NotPlainTar
        name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        entries.append((name, start, size))
    if not complete and entries and entries[-1][1] + entries[-1][2] == len(data):
        return entries  # a run of samples ends at its last member's data
    raise _NotPlainTar  # no end-of-archive block: cut off


def _octal(field: bytes) -> int:
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:  # also GNU base-256 numbers
        raise _NotPlainTar from None


def fast_decode_mel(data: bytes | memoryview, n_mels: int, where: str) -> np.ndarray:
    """:func:`decode_mel_npy` without its ~130 µs ``np.load`` for the header the build
    writes: a read-only array viewing ``data``. Never unpickles; anything else goes to
    ``decode_mel_npy`` (which checks it and raises :class:`ShardError`)."""
    if data[:8] == _NPY_MAGIC:
        end = 10 + int.from_bytes(data[8:10], "little")
        match = _NPY_HEADER.fullmatch(data[10:end])
        if match and int(match[2]) == n_mels:
            count = int(match[1]) * n_mels
            if len(data) == end + count * MEL_DTYPE.itemsize:
                return np.frombuffer(data, MEL_DTYPE, count, end).reshape(-1, n_mels)
    return decode_mel_npy(data, n_mels, where)
