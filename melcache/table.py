"""The per-utterance table, ``utterances.table``: where every utterance of a cache lives.

One row per utterance, in on-disk order (shard by shard, then by offset), so row ``i`` is the
``i``-th sample a full stream of the index's shards yields. Columns (unsigned integers, each
stored in the smallest width that holds its values, all memory-mapped):

- ``offset``: where the sample's first tar header starts in its shard;
- ``json_at``/``json_size``, ``mel_at``/``mel_size`` (and ``flac_at``/``flac_size`` in a
  ``--keep-audio`` cache): each member's data, from ``offset``, and its length;
- ``frames``, ``text_length`` (characters), ``speaker`` (a number into ``speakers``);
- ``extras`` (a cache built with ``[build] extras``): each row's extras object, so the loader
  can select and weigh utterances by them before it reads a shard (``data.where``);
- ``digest``: the low 32 bits of the xxh3_64 of the sample's bytes, ``offset`` to the end of
  its last member, so one read of a sample is checked without hashing its whole shard;
- per shard, ``shard_rows``: the first row of each shard, then the row count.

Lookup by key: ``key_hash`` (xxh3_64 of the key's UTF-8, sorted) and ``row``, the row of each
hash; two keys with one hash are told apart by the key in the sample's own tar header. The
keys, sources and speakers are zstd-compressed JSON arrays in row order, decoded only when
asked for.

The file: ``MELTABLE`` + u32 header length + a JSON header (format version, row and shard
counts, the digest of the shards it describes, every column's dtype, offset and size), then
the columns at 64-byte boundaries. Hand-written because one file is covered by one digest in
``index.json`` and memory-maps whole; an ``.npz`` cannot be memory-mapped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import struct
from pathlib import Path
from typing import IO, Any

import numpy as np
import xxhash
from numcodecs import Zstd

from melcache.bounded import loads_json, open_regular
from melcache.errors import UserError
from melcache.format import write_atomic
from melcache.location import is_url, member_location, read_bytes

TABLE_NAME = "utterances.table"
TABLE_VERSION = 1
_MAGIC = b"MELTABLE"
_LENGTH = struct.Struct("<I")
_ALIGN = 64
_ZSTD_LEVEL = 9  # keys and sources: level 19 is 3x slower for ~5 % less
MEMBERS = ("json", "mel", "flac")  # each has ``<member>_at`` and ``<member>_size`` columns
ROW_COLUMNS = ("offset", "frames", "text_length", "speaker", "digest")
_UNSIGNED = ("|u1", "<u2", "<u4", "<u8")  # numpy spells a byte "|u1"


def key_hash(keys: list[str]) -> np.ndarray:
    """The 64-bit hash of each key (xxh3_64 of its UTF-8), as the table sorts them."""
    return np.fromiter(
        (xxhash.xxh3_64_intdigest(k.encode("utf-8", "surrogatepass")) for k in keys),
        np.uint64,
        len(keys),
    )


def sample_digest(data: bytes | bytearray | memoryview) -> int:
    """The table's ``digest`` of one sample's bytes."""
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


def shards_digest(index: dict[str, Any]) -> str:
    """What a table is bound to: the names and sha256 of the index's shards, in order."""
    listing = [[s["name"], s.get("sha256")] for s in index["shards"]]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:32]


@dataclasses.dataclass
class TableRows:
    """A table's content before encoding: per-row columns in on-disk order, the rows per
    shard, and each row's key, source and speaker."""

    columns: dict[str, np.ndarray]
    shard_counts: list[int]
    keys: list[str]
    sources: list[str]
    speakers: list[str | None]
    extras: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # per row, or none


def encode_table(rows: TableRows, index: dict[str, Any], extras: bool = True) -> bytes:
    """The bytes of ``utterances.table`` for ``rows`` of the cache ``index`` describes; its
    ``extras`` column where a row has any and ``extras`` (false: as tables before it were)."""
    hashes = key_hash(rows.keys)
    order = np.argsort(hashes, kind="stable")
    names = sorted({s for s in rows.speakers if s is not None})
    number = {name: i + 1 for i, name in enumerate(names)}  # 0: no speaker
    arrays = {name: _narrow(values) for name, values in rows.columns.items()}
    arrays["speaker"] = _narrow(np.array([number.get(s, 0) for s in rows.speakers], np.int64))
    arrays["shard_rows"] = _narrow(np.concatenate([[0], np.cumsum(rows.shard_counts)]))
    arrays["key_hash"] = hashes[order].astype("<u8")
    arrays["row"] = _narrow(order)
    strings = {"keys": rows.keys, "sources": rows.sources, "speakers": names}
    if extras and any(rows.extras):  # a cache without extras keeps the table it had
        strings["extras"] = rows.extras
    for name, values in strings.items():
        text = json.dumps(values, ensure_ascii=False).encode("utf-8", "surrogatepass")
        arrays[name] = np.frombuffer(Zstd(_ZSTD_LEVEL).encode(text), np.uint8)
    layout, position = [], 0
    for name in sorted(arrays):
        array = arrays[name]
        layout.append([name, array.dtype.str, position, array.nbytes])
        position += -(-array.nbytes // _ALIGN) * _ALIGN
    header = json.dumps(
        {
            "version": TABLE_VERSION,
            "rows": len(rows.keys),
            "shards": len(rows.shard_counts),
            "bound_to": shards_digest(index),
            "columns": layout,
        }
    ).encode()
    start = -(-(len(_MAGIC) + _LENGTH.size + len(header)) // _ALIGN) * _ALIGN
    out = bytearray(start + position)
    out[: len(_MAGIC)] = _MAGIC
    _LENGTH.pack_into(out, len(_MAGIC), len(header))
    out[len(_MAGIC) + _LENGTH.size : len(_MAGIC) + _LENGTH.size + len(header)] = header
    for name, _, at, size in layout:
        out[start + at : start + at + size] = arrays[name].tobytes()
    return bytes(out)


def _narrow(values: np.ndarray) -> np.ndarray:
    """``values`` (integers ≥ 0) in the narrowest unsigned little-endian dtype that holds them."""
    largest = int(values.max(initial=0))
    for dtype in _UNSIGNED:
        if largest <= np.iinfo(dtype).max:
            return np.asarray(values).astype(dtype)
    raise ValueError(f"table value {largest} does not fit 64 bits")  # not from a real shard


def write_table(out: Path, data: bytes) -> dict[str, Any]:
    """Write ``utterances.table`` atomically; return its ``index.json`` entry."""
    write_atomic(out / TABLE_NAME, data)
    return table_entry(data)


def table_entry(data: bytes | mmap.mmap) -> dict[str, Any]:
    """The ``index.json`` entry that covers a table's bytes."""
    return {
        "name": TABLE_NAME,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "xxh3_128": xxhash.xxh3_128_hexdigest(data),
    }


class TableChanged(UserError):
    """A table file changed on disk while a cache had it open (it is not a shard's fault)."""


class Table:
    """A cache's ``utterances.table``, read and checked against its ``index.json``.

    Raises :class:`UserError` naming the file when the cache has no table (built before
    tables existed: ``python -m preprocess index-table CACHE`` writes one), or when the table
    is damaged or stale (its size or xxh3_128 is not the index's, it describes other shards,
    or a column is malformed). ``sha256=True`` checks the sha256 too (``verify``). Every
    read first checks that the file is still the one read (:meth:`check`).
    """

    def __init__(self, cache: str | Path, index: dict[str, Any], sha256: bool = False) -> None:
        self.location = member_location(cache, TABLE_NAME)
        entry = index.get("table")
        if not isinstance(entry, dict) or entry.get("name") != TABLE_NAME:
            raise UserError(
                f"{cache}: index.json lists no {TABLE_NAME} (built before tables existed?); "
                f"`python -m preprocess index-table {cache}` writes it"
            )
        try:
            self._data, self._file = _mapped(self.location)
        except OSError as exc:
            raise UserError(f"{self.location}: cannot read the table ({exc})") from None
        self._cache, self._stamp = cache, self._file_stamp()
        fix = f"damaged or stale; `python -m preprocess index-table {cache}` rewrites it"
        if len(self._data) != entry.get("bytes"):
            raise UserError(
                f"{self.location}: {len(self._data)} bytes, index.json says "
                f"{entry.get('bytes')} ({fix})"
            )
        actual = {"xxh3_128": xxhash.xxh3_128_hexdigest(self._data)}
        if sha256:
            actual["sha256"] = hashlib.sha256(self._data).hexdigest()
        for field, value in actual.items():
            if value != entry.get(field):
                raise UserError(f"{self.location}: {field} differs from index.json ({fix})")
        self._digest = actual["xxh3_128"]
        self.header, self._columns = self._parse(fix)
        self._check(index, fix)
        self._strings: dict[str, list[Any]] = {}

    def _file_stamp(self) -> tuple[int, int] | None:
        if self._file is None:  # a URL's bytes are a copy: nothing can change under them
            return None
        stat = os.fstat(self._file.fileno())
        return stat.st_size, stat.st_mtime_ns

    def check(self) -> None:
        """Raise :class:`TableChanged` naming the file when it changed since it was read:
        the columns are views of its mapped pages, so a page cut off would be SIGBUS and a
        page rewritten a wrong row. One ``fstat`` (size and mtime) per read; only a changed
        mtime with the same size hashes the file, to let a ``touch`` pass."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        assert stamp is not None  # internal invariant: only a local file has a stamp
        if stamp[0] == len(self._data) and xxhash.xxh3_128_hexdigest(self._data) == self._digest:
            self._stamp = stamp
            return
        raise TableChanged(
            f"{self.location}: changed on disk while the cache was open ({len(self._data)} "
            f"bytes then, {stamp[0]} now): open the cache again once it is rebuilt, or "
            f"`python -m preprocess index-table {self._cache}` rewrites a damaged table"
        )

    def _parse(self, fix: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        data, where = self._data, self.location
        head = len(_MAGIC) + _LENGTH.size
        if len(data) < head or data[: len(_MAGIC)] != _MAGIC:
            raise UserError(f"{where}: not a melcache utterance table ({fix})")
        (length,) = _LENGTH.unpack_from(data, len(_MAGIC))
        try:
            header = loads_json(bytes(data[head : head + length]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"{where}: unreadable header ({exc}; {fix})") from None
        if not isinstance(header, dict) or header.get("version") != TABLE_VERSION:
            raise UserError(f"{where}: not a version {TABLE_VERSION} table ({fix})")
        start = -(-(head + length) // _ALIGN) * _ALIGN
        columns = {}
        for item in header.get("columns", []):
            name, dtype, at, size = item if isinstance(item, list) and len(item) == 4 else [""] * 4
            if dtype not in _UNSIGNED or not _fits(
                at, size, np.dtype(dtype).itemsize, len(data) - start
            ):
                raise UserError(f"{where}: column {name!r} is malformed ({fix})")
            columns[name] = np.frombuffer(data, dtype, size // np.dtype(dtype).itemsize, start + at)
        return header, columns

    def _check(self, index: dict[str, Any], fix: str) -> None:
        where, header = self.location, self.header
        if header.get("bound_to") != shards_digest(index):
            raise UserError(f"{where}: describes other shards than index.json's ({fix})")
        rows, counts = header.get("rows"), [s["samples"] for s in index["shards"]]
        expected = {name: rows for name in (*ROW_COLUMNS, "key_hash", "row")}
        expected["shard_rows"] = len(counts) + 1
        for member in MEMBERS if index.get("keep_audio") else MEMBERS[:2]:
            expected[f"{member}_at"] = expected[f"{member}_size"] = rows
        for name, length in expected.items():
            column = self._columns.get(name)
            if column is None or len(column) != length:
                raise UserError(f"{where}: column {name!r} is missing or not {length} long ({fix})")
        starts = self._columns["shard_rows"].astype(np.int64)
        if starts[0] != 0 or np.diff(starts).tolist() != counts or rows != sum(counts):
            raise UserError(f"{where}: rows per shard differ from index.json's ({fix})")
        hashes = self._columns["key_hash"]
        if rows and (np.any(hashes[1:] < hashes[:-1]) or int(self._columns["row"].max()) >= rows):
            raise UserError(f"{where}: key column is not sorted or points past the rows ({fix})")

    def __len__(self) -> int:
        return int(self.header["rows"])

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` (read-only, memory-mapped where local: read it at once, as the file
        is checked only here)."""
        self.check()
        return self._columns[name]

    def has(self, name: str) -> bool:
        """Whether the table has column ``name`` (``flac_*`` only in a --keep-audio cache)."""
        return name in self._columns

    def rows_of(self, key: str) -> list[int]:
        """The rows whose key hashes as ``key`` does: usually one, or none."""
        self.check()
        target = np.uint64(xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass")))
        hashes = self._columns["key_hash"]
        low, high = (
            np.searchsorted(hashes, target, "left"),
            np.searchsorted(hashes, target, "right"),
        )
        return [int(r) for r in self._columns["row"][low:high]]

    def shard_of(self, row: int) -> int:
        """The index's shard number of row ``row``."""
        self.check()
        return int(np.searchsorted(self._columns["shard_rows"], row, "right")) - 1

    def span(self, row: int) -> tuple[int, int]:
        """``(offset, length)`` of row ``row``'s sample: its headers and members, one read."""
        (offset,), (length,) = self.spans(row, row + 1)
        return offset, length

    def spans(self, start: int, stop: int) -> tuple[list[int], list[int]]:
        """:meth:`span` of rows ``start`` to ``stop - 1``: a batch's run of a few dozen rows,
        where Python lists beat numpy's per-call cost."""
        self.check()
        lengths = [0] * (stop - start)
        for member in MEMBERS:
            if f"{member}_at" in self._columns:
                ats = self._columns[f"{member}_at"][start:stop].tolist()
                sizes = self._columns[f"{member}_size"][start:stop].tolist()
                lengths = [
                    max(n, at + size) for n, at, size in zip(lengths, ats, sizes, strict=True)
                ]
        return self._columns["offset"][start:stop].tolist(), lengths

    def strings(self, name: str) -> list[Any]:
        """``keys``, ``sources``, ``extras`` (per row) or ``speakers`` (by number, from 1),
        decoded once."""
        if name not in self._strings:
            self.check()
            try:
                raw = Zstd().decode(self._columns[name].tobytes())
                values = loads_json(bytes(raw).decode("utf-8", "surrogatepass"))
            except (RuntimeError, ValueError) as exc:
                raise UserError(f"{self.location}: column {name!r} unreadable ({exc})") from None
            expected = len(self) if name != "speakers" else None
            if not isinstance(values, list) or expected not in (None, len(values)):
                raise UserError(f"{self.location}: column {name!r} is not {expected} strings")
            self._strings[name] = values
        return self._strings[name]

    def speaker(self, row: int) -> str | None:
        """Row ``row``'s speaker, or ``None``."""
        self.check()
        number = int(self._columns["speaker"][row])
        return self.strings("speakers")[number - 1] if number else None


def _mapped(location: str) -> tuple[bytes | mmap.mmap, IO[bytes] | None]:
    """A local table mapped, with its file kept open to check it before each read; a URL's
    bytes, with no file."""
    if is_url(location):
        return read_bytes(location), None
    file = open_regular(location)
    try:
        if os.fstat(file.fileno()).st_size == 0:
            return b"", file  # mmap refuses empty files; the size check refuses it
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), file
    except BaseException:
        file.close()
        raise


def _fits(at: Any, size: Any, itemsize: int, room: int) -> bool:
    """Whether a column of ``size`` bytes at ``at`` is whole items inside the file."""
    counts = type(at) is int and type(size) is int
    return counts and at >= 0 and size >= 0 and at + size <= room and size % itemsize == 0
