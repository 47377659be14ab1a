"""Reading a melcache cache for training: its index, and one shard at a time as raw samples.

A cache is a local folder or a URL prefix that webdataset's ``gopen`` can open
(``http://host/cache``, ``pipe:aws s3 cp s3://bucket/cache``, …); a member's location is the
prefix, a slash and its name. Only ``mel.npy`` and ``json`` members are read (via
``preprocess.format``); the mel stays undecoded bytes here, so skipping a sample never
parses an array.

Speed: ``format.iter_members`` (tarfile in stream mode) and ``format.decode_mel``
(``np.load``, which parses its header with ``ast``) cost about 200 µs and 130 µs per sample,
more than the rest of the loader together. A shard is read whole into memory anyway, so
:func:`tar_members` walks its plain ustar headers by slicing (members become zero-copy
views) and :func:`fast_decode_mel` reads the one header ``np.save`` writes for
``MEL_DTYPE``; both follow the format module's rules and hand anything unusual (pax or GNU
headers, links, other array headers) to the format module's own functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import mmap
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from webdataset import gopen

from preprocess.errors import ShardError, UserError
from preprocess.format import (
    FORMAT_VERSION,
    INDEX_NAME,
    KNOWN_MEMBERS,
    MEL_DTYPE,
    MEL_MEMBER,
    META_MEMBER,
    decode_mel,
    decode_meta,
    group_samples,
    iter_members,
)

_BLOCK = 512
_END_BLOCK = bytes(_BLOCK)
_REGULAR_FILE = (b"0", b"\0")
# The exact header np.save writes for a C-ordered 2-D MEL_DTYPE array (format 1.0).
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER = re.compile(
    rb"\{'descr': '%s', 'fortran_order': False, 'shape': \((\d+), (\d+)\), \} *\n"
    % MEL_DTYPE.str.encode()
)


@dataclasses.dataclass(frozen=True)
class RawSample:
    """One utterance as read from a shard: metadata parsed, mel still ``np.save`` bytes."""

    key: str
    mel: bytes | memoryview
    text: str
    speaker: str | None
    frames: int


def is_url(cache: str | Path) -> bool:
    """True when ``cache`` names a URL prefix rather than a local folder."""
    return isinstance(cache, str) and ("://" in cache or cache.startswith("pipe:"))


def member_location(cache: str | Path, name: str) -> str:
    """Where file ``name`` of the cache lives: a path, or the URL prefix plus ``/name``."""
    if is_url(cache):
        return f"{str(cache).rstrip('/')}/{name}"
    return str(Path(cache) / name)


def read_bytes(location: str) -> bytes | mmap.mmap:
    """The whole content of a local file (memory-mapped: no copy, no fresh pages to fault
    in) or URL; ``OSError`` when it cannot be read. Shards are immutable once indexed."""
    if "://" not in location and not location.startswith("pipe:"):
        with open(location, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                return b""  # mmap refuses empty files
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_WILLNEED"):  # start reading a cold shard ahead of the parser
            mapped.madvise(mmap.MADV_WILLNEED)
        return mapped
    stream = gopen(location, "rb")
    try:
        return stream.read()
    finally:
        stream.close()  # a pipe reports its command's exit status only here


def read_index(cache: str | Path) -> dict[str, Any]:
    """Parse and sanity-check ``index.json``; its absence means the build never finished."""
    location = member_location(cache, INDEX_NAME)
    try:
        index = json.loads(bytes(read_bytes(location)).decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{location}: cannot read the cache index ({exc}); is {cache} a finished "
            "`python -m preprocess build` output?"
        ) from None
    version = index.get("format_version") if isinstance(index, dict) else None
    if version != FORMAT_VERSION:
        raise UserError(
            f"{location}: format_version {version!r}, this melcache reads {FORMAT_VERSION}"
        )
    for key in ("features", "shards"):
        if key not in index:
            raise UserError(f"{location}: the index has no {key!r} entry")
    if not index["shards"]:
        raise UserError(f"{location}: the cache holds no shards")
    return index


def read_shard(location: str, entry: dict[str, Any], *, check_sha256: bool) -> list[RawSample]:
    """Every sample of one shard, in tar order, checked against its index entry.

    Raises :class:`ShardError` naming the shard when it is missing, unreadable, not the size
    the index gives, fails its sha256 (unless ``check_sha256`` is off), holds fewer samples
    than the index says, or a sample lacks a member or has bad metadata.
    """
    try:
        data = read_bytes(location)
    except OSError as exc:
        raise ShardError(f"{location}: cannot read shard ({exc})") from None
    if len(data) != entry.get("bytes", len(data)):  # free, and names the likely cause
        raise ShardError(
            f"{location}: {len(data)} bytes, the index says {entry['bytes']} (truncated or replaced?)"
        )
    if check_sha256:
        if not entry.get("sha256"):
            raise ShardError(f"{location}: the index gives no sha256; set check_sha256=False")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ShardError(f"{location}: sha256 differs from the index (corrupt or replaced)")
    samples = [
        _raw_sample(sample, location)
        for sample in group_samples(tar_members(data, location), location)
    ]
    if len(samples) != entry.get("samples"):
        raise ShardError(
            f"{location}: holds {len(samples)} samples, the index says {entry.get('samples')} "
            "(truncated?)"
        )
    return samples


def _raw_sample(sample: dict[str, Any], location: str) -> RawSample:
    key = sample["__key__"]
    where = f"{location}:{key}"
    for member in (MEL_MEMBER, META_MEMBER):
        if member not in sample:
            raise ShardError(f"{where}: sample has no {member} member")
    meta = decode_meta(bytes(sample[META_MEMBER]), where)
    frames, text, speaker = meta.get("frames"), meta.get("text"), meta.get("speaker")
    if not isinstance(frames, int) or frames <= 0:
        raise ShardError(f"{where}: metadata 'frames' = {frames!r} is not a positive integer")
    if not isinstance(text, str):
        raise ShardError(f"{where}: metadata 'text' = {text!r} is not a string")
    if speaker is not None and not isinstance(speaker, str):
        speaker = str(speaker)
    return RawSample(key=key, mel=sample[MEL_MEMBER], text=text, speaker=speaker, frames=frames)


class _NotPlainTar(Exception):
    """Something the fast path does not handle; the format module's reader takes over."""


def tar_members(
    data: bytes | mmap.mmap, where: str
) -> Iterator[tuple[str, str, bytes | memoryview]]:
    """``(key, member, data)`` for each known member of an in-memory shard, in tar order.

    Same contract as ``format.iter_members``, which handles every case this fast path
    declines (extension headers, links, bad checksums, a cut-off archive): unknown members
    are skipped unread, a key with a path separator raises, damage raises ShardError.
    """
    try:
        members = _plain_tar_members(data, where)
    except _NotPlainTar:
        return iter_members(io.BytesIO(data), where)
    return iter(members)


def _plain_tar_members(data: bytes | mmap.mmap, where: str) -> list[tuple[str, str, memoryview]]:
    view, pos, members = memoryview(data), 0, []
    while pos + _BLOCK <= len(data):
        header = data[pos : pos + _BLOCK]
        if header == _END_BLOCK:
            return members
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
        key, _, member = name.partition(".")
        if member not in KNOWN_MEMBERS:
            continue
        if "/" in key or "\\" in key:  # melcache keys are flat; anything else was planted
            raise ShardError(f"{where}: unsafe member name {name!r}")
        members.append((key, member, view[start : start + size]))
    raise _NotPlainTar  # no end-of-archive block: cut off


def _octal(field: bytes) -> int:
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:  # also GNU base-256 numbers
        raise _NotPlainTar from None


def fast_decode_mel(data: bytes | memoryview, n_mels: int, where: str) -> np.ndarray:
    """``format.decode_mel`` without its ~130 µs ``np.load`` for the header the build
    writes: a read-only array viewing ``data``. Never unpickles; anything else goes to
    ``decode_mel`` (which checks it and raises :class:`ShardError`)."""
    if data[:8] == _NPY_MAGIC:
        end = 10 + int.from_bytes(data[8:10], "little")
        match = _NPY_HEADER.fullmatch(data[10:end])
        if match and int(match[2]) == n_mels:
            count = int(match[1]) * n_mels
            if len(data) == end + count * MEL_DTYPE.itemsize:
                return np.frombuffer(data, MEL_DTYPE, count, end).reshape(-1, n_mels)
    return decode_mel(data, n_mels, where)
