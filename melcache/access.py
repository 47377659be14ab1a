"""Random access to a cache: ``melcache.open(cache)``, then ``cache[key]`` or ``cache[i]``.

Every lookup is one ranged read of one shard (a view of the memory-mapped shard locally, a
ranged read for an ``http(s)://`` or ``s3://`` cache), located by the per-utterance table
(:mod:`melcache.table`). The bytes read are checked against the table's digest of that
sample before they are parsed, with the loader's own parser and metadata checks; so a
shard replaced or damaged under a sound table is an error naming the shard, never a wrong
utterance. Row ``i`` is the ``i``-th sample of the index's shards in order, as a full stream
yields them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import mmap
import operator
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from melcache.bounded import open_regular
from melcache.codec import decode_mel
from melcache.errors import ShardError, UserError
from melcache.fields.format import cache_fields
from melcache.fields.store import FieldStore
from melcache.format import META_MEMBER, decode_meta, finite_mel
from melcache.index import read_index
from melcache.location import is_url, member_location, read_range, reads_ranges
from melcache.reader import RawSample, raw_sample, shard_samples
from melcache.table import TABLE_NAME, Table, sample_digest

# Shard files a cache keeps mapped (the least recently used closed first): a loader worker
# meets every shard of a cache in time, and 100k of them would exhaust its descriptors.
OPEN_SHARDS = 64


@dataclasses.dataclass(frozen=True)
class Utterance:
    """One utterance of a cache: its mel (float16 ``[frames, n_mels]``), text and metadata."""

    key: str
    mel: np.ndarray
    text: str
    speaker: str | None
    frames: int
    meta: dict[str, Any]  # the whole ``json`` member: seconds, source, bucket, …
    shard: str
    row: int
    audio: bytes | None  # the FLAC of a --keep-audio cache
    fields: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # derived fields


class UnknownKey(KeyError, UserError):
    """A key the cache does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError would print the message quoted


class BadKey(TypeError, UserError):
    """A lookup by something that is neither a key (``str``) nor a row (an integer)."""


def _key(where: object, key: object) -> str:
    if not isinstance(key, str):
        raise BadKey(f"{where}: a key is a str, not {type(key).__name__} {key!r}")
    return key


def row_or_key(where: object, item: object, keys: bool = True) -> int | str:
    """``item`` checked as a lookup of cache ``where``: a key (a ``str``, when ``keys``) or a
    row (an ``int`` or NumPy integer, never a float or a bool), else :class:`BadKey`."""
    if keys and isinstance(item, str):
        return item
    if not isinstance(item, bool):
        with contextlib.suppress(TypeError):
            return operator.index(item)  # type: ignore[arg-type]
    wanted = "a key (str) or a row (int)" if keys else "a row (int)"
    raise BadKey(f"{where}: look up {wanted}, not {type(item).__name__} {item!r}")


class Cache:
    """A finished cache opened for random access (see :func:`open_cache`)."""

    def __init__(self, cache: str | Path) -> None:
        if not isinstance(cache, (str, Path)) or not str(cache):
            raise BadKey(f"cache {cache!r}: expected a folder or URL prefix (a str or Path)")
        self.location = cache if is_url(cache) else Path(cache)
        self.index = read_index(cache)
        self.table = Table(cache, self.index)
        self._n_mels = int(self.index["features"]["n_mels"])
        self._shards = _Shards(cache, self.index["shards"])
        # Every derived field of the cache (melcache/fields/format.py), one ranged read each per row.
        fields = cache_fields(self.index, str(cache))
        self.fields = FieldStore(cache, self.index, list(fields))
        self._field_shards = {
            name: _Shards(member_location(cache, e["folder"]), e["shards"])
            for name, e in fields.items()
        }
        # A copy, not a view of the mapped table: samplers keep ``lengths`` for a whole run,
        # and a view would be SIGBUS once the file is cut (the table checks only its reads).
        self._frames = np.array(self.table.column("frames"))
        self._frames.flags.writeable = False

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, item: int | str) -> Utterance:
        row = row_or_key(self.location, item)
        if isinstance(row, str):
            return self.get(row)
        found = self._read(self.row(row), None)
        assert found is not None  # internal invariant: no key to compare, so never a mismatch
        return found

    def row(self, row: int) -> int:
        """Row number ``row`` (negative counts from the end, as lists do) in ``0 .. len - 1``;
        :class:`IndexError` naming the cache past either end."""
        if not -len(self) <= row < len(self):
            raise IndexError(f"{self.location}: row {row} of {len(self)}")
        return row % len(self)

    def get(self, key: str) -> Utterance:
        """The utterance ``key``; :class:`UnknownKey` when the cache has none, :class:`BadKey`
        (a ``TypeError``) when ``key`` is not a ``str``."""
        for row in self.table.rows_of(_key(self.location, key)):
            found = self._read(row, key)
            if found is not None:
                return found
        raise UnknownKey(
            f"{self.location}: no utterance with key {key!r} ({len(self)} in the cache)"
        )

    def get_many(self, keys: Iterable[str]) -> list[Utterance]:
        """The utterances ``keys`` (an iterable of ``str``), in that order, read in shard and
        offset order."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise BadKey(  # a bare str would be looked up character by character
                f"{self.location}: get_many takes a list of keys, not {type(keys).__name__} "
                f"{keys!r} (one key: get)"
            )
        keys = [_key(self.location, key) for key in keys]
        first = {key: (self.table.rows_of(key) or [-1])[0] for key in keys}
        found = {key: self.get(key) for key in sorted(set(keys), key=first.__getitem__)}
        return [found[key] for key in keys]

    def keys(self) -> list[str]:
        """Every key, in row order (decoded from the table once)."""
        return self.table.strings("keys")

    @property
    def lengths(self) -> np.ndarray:
        """Frames of every row, in row order: what length samplers need, read from the table."""
        return self._frames

    def close(self) -> None:
        """Close the shard files this cache has opened."""
        self._shards.close()
        for shards in self._field_shards.values():
            shards.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers under spawn reopen it
        return {"location": self.location}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"])  # type: ignore[misc]

    def raw_rows(self, rows: Sequence[int]) -> list[RawSample]:
        """The samples of ``rows``, in that order, mel undecoded: each run of consecutive rows
        of one shard one ranged read, each sample checked against the table's digest and
        frames (what a loader that reads only its own batches of a shard takes)."""
        found: dict[int, RawSample] = {}
        for shard, start, stop in _row_runs(sorted(set(rows)), self.table.column("shard_rows")):
            samples, where, _ = self._verified(shard, start, stop)
            for row, sample in zip(range(start, stop), samples, strict=True):
                found[row] = self._raw(sample, where, row)
        return [found[row] for row in rows]

    def texts(self, shard: int) -> list[str]:
        """The texts of shard number ``shard``'s rows, in row order, from their ``json``
        members alone (one read of the shard's span, no mel parsed): what text lengths under
        a tokenizer are counted from (``melcache/loader/sequence.py``)."""
        rows = self.table.column("shard_rows")
        start, stop = int(rows[shard]), int(rows[shard + 1])
        if start == stop:
            return []
        name = self.index["shards"][shard]["name"]
        offsets, lengths = self.table.spans(start, stop)
        data = memoryview(
            self._shards.read(name, offsets[0], offsets[-1] + lengths[-1] - offsets[0])
        )
        where = self._shards.location(name)
        at, size = self.table.column("json_at"), self.table.column("json_size")
        out = []
        for row, offset in zip(range(start, stop), offsets, strict=True):
            begin = offset - offsets[0] + int(at[row])
            text = decode_meta(bytes(data[begin : begin + int(size[row])]), where).get("text")
            if not isinstance(text, str):
                raise ShardError(f"{where}: row {row}'s metadata 'text' = {text!r} is not a string")
            out.append(text)
        return out

    def _verified(self, shard: int, start: int, stop: int) -> tuple[list[dict[str, Any]], str, str]:
        """The samples of rows ``start`` to ``stop - 1`` (of shard number ``shard``) from one
        ranged read, each one's bytes checked against the table's digest before any is
        parsed; with the shard's location and name."""
        name = self.index["shards"][shard]["name"]
        offsets, lengths = self.table.spans(start, stop)
        first = offsets[0]
        where = self._shards.location(name)
        data = self._shards.read(name, first, offsets[-1] + lengths[-1] - first)
        view, digests = memoryview(data), self.table.column("digest")[start:stop].tolist()
        for offset, length, digest in zip(offsets, lengths, digests, strict=True):
            if sample_digest(view[offset - first : offset - first + length]) != digest:
                raise ShardError(
                    f"{where}: the {length} bytes at {offset} are not the sample {TABLE_NAME} "
                    "records (shard replaced or damaged)"
                )
        samples = list(shard_samples(data, where, complete=False))
        if len(samples) != stop - start:
            raise ShardError(
                f"{where}: {len(samples)} samples at byte {first}, expected {stop - start}"
            )
        return samples, where, name

    def _raw(self, sample: dict[str, Any], where: str, row: int) -> RawSample:
        raw = raw_sample(sample, where)
        if raw.frames != int(self._frames[row]):
            raise ShardError(
                f"{where}:{raw.key}: {raw.frames} frames, {TABLE_NAME} says {self._frames[row]}"
            )
        return raw

    def _read(self, row: int, key: str | None) -> Utterance | None:
        """Row ``row``'s utterance, or ``None`` when its key is not ``key`` (a hash collision)."""
        (sample,), where, name = self._verified(self.table.shard_of(row), row, row + 1)
        if key is not None and sample["__key__"] != key:
            return None
        raw = self._raw(sample, where, row)
        sample_where = f"{where}:{raw.key}"
        mel = decode_mel(raw.mel, raw.storage, self._n_mels, sample_where)
        if len(mel) != raw.frames or not finite_mel(mel):
            raise ShardError(f"{sample_where}: mel is not {raw.frames} finite frames")
        return Utterance(
            key=raw.key,
            mel=mel,
            text=raw.text,
            speaker=raw.speaker,
            frames=raw.frames,
            meta=decode_meta(bytes(sample[META_MEMBER]), sample_where),
            shard=name,
            row=row,
            audio=None if raw.audio is None else bytes(raw.audio),
            fields=self.fields.row(row, name, self._read_field),
        )

    def _read_field(self, field: str, shard: str, offset: int, length: int) -> bytes:
        """A copy: the field's values outlive this read, the mapping may not."""
        return bytes(self._field_shards[field].read(shard, offset, length))

    def __iter__(self) -> Iterator[Utterance]:
        return (self[row] for row in range(len(self)))


class _Shards:
    """One ranged read of a shard: a view of a file kept mapped, or a remote ranged read."""

    def __init__(self, cache: str | Path, entries: list[dict[str, Any]]) -> None:
        self._cache = cache
        self._entries = {entry["name"]: entry for entry in entries}
        self._locations = {name: member_location(cache, name) for name in self._entries}
        self._maps: collections.OrderedDict[str, mmap.mmap] = collections.OrderedDict()
        if not reads_ranges(cache):
            raise UserError(
                f"{cache}: random access reads a local folder, an http(s):// or s3:// cache; "
                "stream this one with the loader, or copy it"
            )

    def read(self, name: str, offset: int, length: int) -> bytes | memoryview:
        """``length`` bytes of shard ``name`` from ``offset`` (read-only)."""
        location = self._locations[name]
        size = self._entries[name].get("bytes")
        if length <= 0 or (size is not None and offset + length > size):
            raise ShardError(  # a forged table must not make us allocate or seek past the shard
                f"{location}: {TABLE_NAME} places a sample at bytes {offset}+{length}, "
                f"outside the shard's {size}"
            )
        if is_url(self._cache):
            got: bytes | memoryview = read_range(location, offset, length)
        else:
            mapped = self._mapped(name, location)
            if mapped.size() < offset + length:  # the file now: a page cut off would be SIGBUS
                raise ShardError(
                    f"{location}: {mapped.size()} bytes now, cut off before the sample at "
                    f"{offset}+{length} (truncated while open?)"
                )
            got = memoryview(mapped)[offset : offset + length]
        if len(got) != length:
            raise ShardError(
                f"{location}: {len(got)} bytes at {offset}, {TABLE_NAME} says {length} (truncated?)"
            )
        return got

    def location(self, name: str) -> str:
        """Where shard ``name`` lives."""
        return self._locations[name]

    def _mapped(self, name: str, location: str) -> mmap.mmap:
        """Shard ``name`` memory-mapped (kept for the next read, as the last OPEN_SHARDS are):
        a read is then a view, not a copy (a copy cost the loader ~9 µs of its ~90 per
        sample)."""
        mapped = self._maps.get(name)
        if mapped is not None:
            self._maps.move_to_end(name)
            return mapped
        expected = self._entries[name].get("bytes")
        try:
            with open_regular(location) as file:
                size = os.fstat(file.fileno()).st_size
                if size == 0 or (expected is not None and size != expected):
                    raise ShardError(f"{location}: {size} bytes, the index says {expected} "
                                     "(truncated or replaced?)")  # fmt: skip
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ShardError(f"{location}: cannot read shard ({exc})") from None
        self._maps[name] = mapped
        if len(self._maps) > OPEN_SHARDS:
            _unmap(self._maps.popitem(last=False)[1])
        return mapped

    def close(self) -> None:
        for mapped in self._maps.values():
            _unmap(mapped)
        self._maps.clear()


def _unmap(mapped: mmap.mmap) -> None:
    """Close a mapping now, or, while samples still view it, when the last of them goes."""
    with contextlib.suppress(BufferError):
        mapped.close()


def _row_runs(rows: list[int], shard_rows: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """``(shard, start, stop)`` of each run of consecutive ``rows`` (sorted, distinct) in one
    shard (``shard_rows``: each shard's first row): plain Python, as a batch holds a few dozen
    rows and numpy's per-call cost would outweigh the work."""
    begin = 0
    while begin < len(rows):
        shard = int(np.searchsorted(shard_rows, rows[begin], "right")) - 1
        shard_end = int(shard_rows[shard + 1])
        end = begin + 1
        while end < len(rows) and rows[end] == rows[end - 1] + 1 and rows[end] < shard_end:
            end += 1
        yield shard, rows[begin], rows[end - 1] + 1
        begin = end


def open_cache(cache: str | Path) -> Cache:
    """Open a finished cache (folder, ``http(s)://`` or ``s3://`` prefix) for random access: ``len()``,
    ``cache[key]``, ``cache[i]``, ``get_many(keys)``, ``keys()`` and ``lengths``.

    Raises :class:`UserError` (one line, naming the file) when the index is bad or the table
    is missing, damaged or stale; each read raises :class:`ShardError` naming the shard when
    its bytes are not what the table records.
    """
    return Cache(cache)
