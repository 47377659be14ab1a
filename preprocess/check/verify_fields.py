"""``verify`` of a cache's derived fields (:mod:`melcache.fields.format`): every field shard's size and
digests against the index, its binding to its mel shard, its keys, dtype, shapes and frames
against the mel's, and ``rows.npy`` (its sha256, and each row's offset, size and digest
against the bytes), so a flipped byte is named down to the utterance whose bytes hold it."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np

from melcache.errors import ShardError, UserError
from melcache.fields.format import (
    ROWS_NAME,
    VALUES_NAME,
    binding_problem,
    cache_fields,
    entry_frames,
    field_samples,
    read_bound,
)
from melcache.format import INDEX_NAME
from melcache.reader import integrity_problems, load_shard
from melcache.table import Table, sample_digest
from melcache.tar.reader import plain_tar_entries


def field_problems(cache: Path, index: dict[str, Any]) -> list[str]:
    """Every problem in the cache's fields (empty: sound, or no fields)."""
    try:
        fields = cache_fields(index, str(cache / INDEX_NAME))
    except UserError as exc:
        return [str(exc)]
    if not fields:
        return []
    table = Table(cache, index)
    keys, frames = table.strings("keys"), table.column("frames")
    starts = table.column("shard_rows")
    problems: list[str] = []
    for name, entry in fields.items():
        rows = _array(cache / entry["folder"] / ROWS_NAME, entry["rows"], problems)
        values = None
        if "values" in entry:
            values = _array(cache / entry["folder"] / VALUES_NAME, entry["values"], problems)
            if values is not None and values.shape != frames.shape:
                problems.append(f"{entry['folder']}/{VALUES_NAME}: {values.shape[0]} values, "
                                f"the table has {len(frames)} rows")  # fmt: skip
                values = None
        recorded = (rows, values)
        for number, mel in enumerate(index["shards"]):
            span = range(int(starts[number]), int(starts[number + 1]))
            problems += _shard_problems(
                cache, name, entry, number, mel, span, keys, frames, recorded
            )
    return problems


def _array(location: Path, recorded: dict[str, Any], problems: list[str]) -> np.ndarray | None:
    """The ``.npy`` at ``location`` if its sha256 is the index's (``recorded``), else a problem."""
    try:
        data = location.read_bytes()
    except OSError as exc:
        problems.append(f"{location}: cannot read ({exc.strerror})")
        return None
    if hashlib.sha256(data).hexdigest() != recorded["sha256"]:
        problems.append(f"{location}: sha256 differs from the index")
        return None
    return np.load(io.BytesIO(data), allow_pickle=False)


def _shard_problems(
    cache: Path,
    name: str,
    entry: dict[str, Any],
    number: int,
    mel: dict[str, Any],
    span: range,
    keys: list[str],
    frames: np.ndarray,
    recorded: tuple[np.ndarray | None, np.ndarray | None],
) -> list[str]:
    """Problems of field ``name``'s shard aligned with mel shard ``number`` (rows ``span``),
    against what ``recorded`` holds where it could be read: ``rows.npy`` and ``values.npy``."""
    rows, scalars = recorded
    where = f"{entry['folder']}/{mel['name']}"
    try:
        data = load_shard(str(cache / where))
    except ShardError as exc:
        return [str(exc)]
    problems = integrity_problems(data, entry["shards"][number], where)
    if rows is not None:
        problems += _damaged_rows(data, where, span, keys, rows)
    try:
        bound = binding_problem(read_bound(data, where), mel, where)
        samples = field_samples(data, name, entry, where)
    except ShardError as exc:
        return [*problems, str(exc)]
    if bound:
        return [*problems, bound]
    if [key for key, _ in samples] != [keys[row] for row in span]:
        problems.append(f"{where}: keys are not those of {mel['name']}, in its order")
    for (key, values), row in zip(samples, span, strict=False):
        expected = entry_frames(entry, int(frames[row]))
        if len(values) != expected:
            problems.append(f"{where}:{key}: {len(values)} frames, the mel's give {expected}")
        if scalars is not None and not np.array_equal(
            values.reshape(-1)[:1], scalars[row : row + 1]
        ):
            problems.append(
                f"{entry['folder']}/{VALUES_NAME}: row {row} ({key}) holds {scalars[row]!r}, its "
                f"field shard {float(values.reshape(-1)[0])!r}"
            )
    return problems


def _damaged_rows(
    data: bytes | Any, where: str, span: range, keys: list[str], rows: np.ndarray
) -> list[str]:
    """Each utterance whose bytes are not what ``rows.npy`` records: where a flipped byte is."""
    entries = plain_tar_entries(data) or [("", 0, 0)]
    members = {start: size for _, start, size in entries[1:]}
    out = []
    for row in span:
        offset, size, _, digest = (int(v) for v in rows[row])
        if members.get(offset) != size or sample_digest(data[offset : offset + size]) != digest:
            out.append(
                f"{where}:{keys[row]}: bytes {offset}..{offset + size} differ from {ROWS_NAME} "
                "(a changed byte in this utterance's field)"
            )
    return out
