"""The shard readers: ``(key, member, data)`` of the known members of a shard, in tar order.

The general reader (:func:`iter_members`, tarfile in stream mode through webdataset) accepts
any valid tar; it costs ~200 µs a sample, more than the rest of the loader together, so
:func:`tar_members` walks the plain ustar headers :mod:`melcache.tar.writer` makes by slicing
an in-memory shard (members become zero-copy views), and hands anything unusual (pax or GNU
headers, links, bad checksums, a cut) to the general reader, so their rules are one set.
Unknown members (a planted ``.pickle``) are skipped unread; nothing is ever extracted.
"""

from __future__ import annotations

import functools
import io
import mmap
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO

import webdataset as wds

from melcache.errors import ShardError
from melcache.format import KNOWN_MEMBERS

_BLOCK = tarfile.BLOCKSIZE  # 512
_END_BLOCK = bytes(_BLOCK)
_REGULAR_FILE = (b"0", b"\0")


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
