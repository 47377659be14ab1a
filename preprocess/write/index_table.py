"""The per-utterance table of a cache (:mod:`melcache.table`), made from its shards.

The build writes it at the end, from the rows each shard's writer made as it wrote the
shard (:class:`RowsBuilder`: where each member went, its metadata, its bytes' digest), so
every input layout (folder, manifest, tars, Parquet, parts) gets the same table;
``python -m preprocess index-table`` writes one for a cache built before tables existed,
and ``verify`` remakes it from the shards and compares. Read back, each shard is
memory-mapped, its tar headers walked (the build's plain ones in place, anything else by
:mod:`tarfile`) and its samples' bytes hashed; only ``json`` members are parsed.
"""

from __future__ import annotations

import json
import mmap
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from melcache.bounded import loads_json, open_regular, read_limited
from melcache.errors import ShardError, UserError
from melcache.extras import sample_extras
from melcache.format import META_MEMBER, decode_meta, write_atomic
from melcache.index import index_storage, read_index, write_index
from melcache.storage import MEL_MEMBERS
from melcache.table import (
    TABLE_NAME,
    Table,
    TableRows,
    encode_table,
    sample_digest,
    write_table,
)
from melcache.tar.reader import plain_tar_entries
from preprocess.inputs.records import RECEIPTS
from preprocess.job.pool import ordered_map

# Per-sample columns, filled by the shard walk; ``speaker`` is numbered by encode_table.
_COLUMNS = ("offset", "frames", "text_length", "digest")
ROWS_FOLDER = "table-rows"  # in OUT/.build: each shard's rows, saved by its writer


class RowsBuilder:
    """The table rows of one shard, a sample at a time: from a shard read back
    (:func:`shard_rows`), or from its writer as each sample is written, with no second read."""

    def __init__(self, mel_member: str, keep_audio: bool) -> None:
        members = {"json": META_MEMBER, "mel": mel_member}
        if keep_audio:
            members["flac"] = "flac"
        self.kinds = {member: kind for kind, member in members.items()}
        self.columns: dict[str, list[int]] = {name: [] for name in _column_names(keep_audio)}
        self.rows = TableRows({}, [], [], [], [])

    def add(
        self,
        key: str,
        meta: dict[str, Any],
        spans: dict[str, tuple[int, int, int]],
        data: bytes | mmap.mmap | memoryview,
        where: str,
        base: int = 0,
    ) -> None:
        """One sample's row: ``spans`` its table members' ``(header offset, data offset,
        size)`` in the shard, ``meta`` its parsed json, ``data`` the shard's bytes from
        offset ``base`` on (its digest covers its first header to its last member's data)."""
        missing = sorted(set(self.kinds) - set(spans))
        if missing:
            raise ShardError(f"{where}: sample has no {missing[0]} member")
        start = min(header for header, _, _ in spans.values())
        end = max(at + size for _, at, size in spans.values())
        speaker = meta.get("speaker")
        rows, columns = self.rows, self.columns
        rows.keys.append(key)
        rows.sources.append(str(meta.get("source", "")))
        rows.speakers.append(None if speaker is None else str(speaker))
        rows.extras.append(sample_extras(meta, where))
        columns["offset"].append(start)
        columns["frames"].append(_count(meta.get("frames"), where, "frames"))
        columns["text_length"].append(len(str(meta.get("text", ""))))
        columns["digest"].append(sample_digest(data[start - base : end - base]))
        for member, (_, at, size) in spans.items():
            columns[f"{self.kinds[member]}_at"].append(at - start)
            columns[f"{self.kinds[member]}_size"].append(size)

    def finish(self) -> TableRows:
        """The rows added so far, as one shard's."""
        rows = self.rows
        rows.columns = {name: np.array(values, np.int64) for name, values in self.columns.items()}
        rows.shard_counts = [len(rows.keys)]
        return rows


def shard_rows(path: Path, mel_member: str, keep_audio: bool) -> TableRows:
    """The table rows of one shard, in tar order; :class:`ShardError` naming the shard when a
    sample lacks a member the cache needs or its metadata is unreadable."""
    builder = RowsBuilder(mel_member, keep_audio)
    try:
        with (
            open_regular(path) as file,
            mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data,
        ):
            for key, spans in _samples(_entries(data, file), builder.kinds):
                where = f"{path.name}:{key}"
                meta = {}  # none: add() names the missing member
                if META_MEMBER in spans:
                    _, at, size = spans[META_MEMBER]
                    meta = decode_meta(data[at : at + size], where)
                builder.add(key, meta, spans, data, where)
    except (OSError, tarfile.TarError, ValueError) as exc:
        raise ShardError(f"{path}: cannot read as a tar ({exc})") from None
    return builder.finish()


def _entries(data: mmap.mmap, file: IO[bytes]) -> list[tuple[str, int, int, int]]:
    """``(name, header offset, data offset, size)`` of each regular member: the build's plain
    headers read in place (~10x faster than tarfile), anything else through tarfile."""
    plain = plain_tar_entries(data)
    if plain is not None:
        return [(name, at - 512, at, size) for name, at, size in plain]
    with tarfile.open(fileobj=file, mode="r:") as tar:
        return [(i.name, i.offset, i.offset_data, i.size) for i in tar if i.isfile()]


def _column_names(keep_audio: bool) -> list[str]:
    members = ("json", "mel", "flac") if keep_audio else ("json", "mel")
    return [*_COLUMNS, *(f"{m}_{part}" for m in members for part in ("at", "size"))]


def _samples(
    entries: list[tuple[str, int, int, int]], kinds: dict[str, str]
) -> Iterator[tuple[str, dict[str, tuple[int, int, int]]]]:
    """``(key, {member: (header, data offset, size)})`` per sample, the table's members only."""
    key, spans = "", {}
    for name, header, at, size in entries:
        name_key, _, member = name.partition(".")
        if member not in kinds:
            continue
        if name_key != key and spans:
            yield key, spans
            spans = {}
        key = name_key
        spans[member] = (header, at, size)
    if spans:
        yield key, spans


def _count(value: Any, where: str, field: str) -> int:
    if type(value) is not int or value < 0:
        raise ShardError(f"{where}: metadata {field!r} = {value!r} is not a count")
    return value


def save_shard_rows(shard: Path, rows: TableRows, sha256: str) -> None:
    """Keep the table rows of a shard just written (its writer made them as it wrote) in
    ``.build/table-rows/``, so the end of the build reads them instead of every shard, and
    an end killed midway resumes from them."""
    record = {
        "sha256": sha256,
        "columns": {name: values.tolist() for name, values in rows.columns.items()},
        "keys": rows.keys,
        "sources": rows.sources,
        "speakers": rows.speakers,
        "extras": rows.extras,
    }
    folder = shard.parent / RECEIPTS / ROWS_FOLDER
    folder.mkdir(exist_ok=True)
    write_atomic(folder / f"{shard.name}.json", json.dumps(record).encode())


def _saved_rows(cache: Path, entry: dict[str, Any], keep_audio: bool) -> TableRows | None:
    """A shard's rows as its writer saved them, if they are of these very bytes (sha256)."""
    path = cache / RECEIPTS / ROWS_FOLDER / f"{entry['name']}.json"
    try:
        record = loads_json(read_limited(path))
        count = len(record["keys"])
        names = _column_names(keep_audio)
        columns = {name: np.array(record["columns"][name], np.int64) for name in names}
        if record["sha256"] != entry.get("sha256") or any(
            len(c) != count for c in columns.values()
        ):
            return None
        extras = record["extras"]
        if not isinstance(extras, list) or len(extras) != count:
            return None
        return TableRows(
            columns, [count], record["keys"], record["sources"], record["speakers"], extras
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none saved (an older build, index-table), or not of these bytes: scan


def _shard_rows_job(job: tuple[Path, dict[str, Any], str, bool, bool]) -> TableRows:
    cache, entry, member, keep_audio, reuse = job
    saved = _saved_rows(cache, entry, keep_audio) if reuse else None
    return saved or shard_rows(cache / entry["name"], member, keep_audio)


def cache_rows(
    cache: Path, index: dict[str, Any], workers: int = 1, reuse: bool = False
) -> TableRows:
    """The rows of every shard the index lists, in index order: read from the shards, or
    with ``reuse`` from what their writers saved where it is of the same bytes."""
    member, keep_audio = MEL_MEMBERS[index_storage(index)], bool(index["keep_audio"])
    jobs = [(cache, s, member, keep_audio, reuse) for s in index["shards"]]
    merged = TableRows({}, [], [], [], [])
    parts: dict[str, list[np.ndarray]] = {}
    with ordered_map(workers) as run:
        for rows in run(_shard_rows_job, jobs, chunksize=8):
            for name, values in rows.columns.items():
                parts.setdefault(name, []).append(values)
            merged.shard_counts += rows.shard_counts
            merged.keys += rows.keys
            merged.sources += rows.sources
            merged.speakers += rows.speakers
            merged.extras += rows.extras
    merged.columns = {  # also for a cache of no shards (every utterance rejected)
        name: np.concatenate([np.zeros(0, np.int64), *parts.get(name, [])])
        for name in _column_names(bool(index["keep_audio"]))
    }
    return merged


def make_table(
    cache: Path, index: dict[str, Any], workers: int = 1, reuse: bool = False, extras: bool = True
) -> bytes:
    """The table bytes of the cache ``index`` describes (see :func:`cache_rows`); without its
    ``extras`` column where not ``extras``."""
    return encode_table(cache_rows(cache, index, workers, reuse), index, extras)


def write_cache_table(cache: Path, index: dict[str, Any], workers: int = 1) -> dict[str, Any]:
    """Write ``utterances.table`` from the shards (or the rows their writers saved); return
    the index entry that covers it."""
    try:
        return write_table(cache, make_table(cache, index, workers, reuse=True))
    except ShardError as exc:
        raise UserError(f"cannot write {cache / TABLE_NAME}: {exc}") from None


def index_table(cache: Path, workers: int = 1) -> dict[str, Any]:
    """``preprocess index-table``: write the table of a finished cache and list it in its
    index (rewritten atomically); return the new index."""
    index = read_index(cache)
    index["table"] = write_cache_table(cache, index, workers)
    write_index(cache, index)
    return index


def table_problems(
    cache: Path, index: dict[str, Any], workers: int = 1, *, shards_sound: bool = True
) -> list[str]:
    """What ``verify`` finds wrong with the table: unreadable, damaged or stale against the
    index, or not what the shards make (empty: sound, or no table in an older cache). With
    shards found damaged (``shards_sound`` false), the table is not compared with what they
    make: the difference would blame the table for the shards' damage."""
    if "table" not in index:
        if (cache / TABLE_NAME).exists():
            return [f"{TABLE_NAME}: not listed in index.json (stale?)"]
        return []  # a cache from before tables: still sound
    try:
        table = Table(cache, index, sha256=True)  # size, digests and columns against the index
        if not shards_sound:
            return []
        # A table made before tables held extras is still sound: it lacks only their column
        # (index-table adds it, for data.where over extras).
        expected = make_table(cache, index, workers, extras=table.has("extras"))
    except (UserError, ShardError) as exc:
        return [str(exc)]
    if (cache / TABLE_NAME).read_bytes() == expected:
        return []
    return [
        f"{TABLE_NAME}: differs from what the shards make (stale or damaged); "
        f"`python -m preprocess index-table {cache}` rewrites it"
    ]
