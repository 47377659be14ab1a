"""Reading a cache's derived fields (:mod:`melcache.fields.format`): a whole field shard for the
loader and ``verify``, one utterance for random access. Every read is checked first: a field
shard against its index entry (size, xxh3_128 or sha256) and its binding to the mel shard, an
utterance's bytes against ``rows.npy``'s digest, so a replaced or foreign field shard is one
line naming it, never wrong values."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from melcache.errors import ShardError, UserError
from melcache.fields.format import (
    HEAD_BYTES,
    ROW_COLUMNS,
    ROWS_NAME,
    VALUES_NAME,
    binding_problem,
    cache_fields,
    decode_field,
    field_samples,
    missing_field,
    provenance_problem,
    read_bound,
)
from melcache.format import MEL_MEMBER
from melcache.location import member_location, read_bytes
from melcache.reader import RawSample, ShardCheck, load_shard, raw_sample, shard_samples
from melcache.table import sample_digest


class FieldStore:
    """The fields ``names`` of one cache (folder or URL prefix), checked at creation: each
    present, and, where ``wanted`` gives provenance keys, equal to them."""

    def __init__(
        self,
        cache: str | Path,
        index: Mapping[str, Any],
        names: Sequence[str],
        wanted: Mapping[str, Mapping[str, Any]] | None = None,
        by: str = "data.fields",
    ) -> None:
        self.cache, self.index, self.names = str(cache), index, tuple(names)
        fields = cache_fields(index, member_location(cache, "index.json"))
        for name in self.names:
            if name not in fields:
                raise missing_field(self.cache, fields, name, by)
            problem = provenance_problem(
                self.cache, name, fields[name], (wanted or {}).get(name, {}), by
            )
            if problem:
                raise UserError(problem)
        self.entries = {name: fields[name] for name in self.names}
        self._rows: dict[str, np.ndarray] = {}
        self._check = ShardCheck("fast")
        self._bound: set[tuple[str, str]] = set()
        self._numbers = {entry["name"]: i for i, entry in enumerate(index["shards"])}

    def location(self, name: str, shard: str) -> str:
        """Where field ``name``'s shard aligned with mel shard ``shard`` lives."""
        return member_location(self.cache, f"{self.entries[name]['folder']}/{shard}")

    def shard(self, number: int) -> dict[str, dict[str, np.ndarray]]:
        """Every field of mel shard ``number`` (in the index): ``{key: {name: values}}``."""
        mel_entry = self.index["shards"][number]
        out: dict[str, dict[str, np.ndarray]] = {}
        for name in self.names:
            entry = self.entries[name]
            location = self.location(name, mel_entry["name"])
            data = load_shard(location)
            problems = self._check.problems(data, entry["shards"][number], location)
            bound = binding_problem(read_bound(data, location), mel_entry, location)
            if bound or problems:
                raise ShardError(bound or problems[0])
            for key, values in field_samples(data, name, entry, location):
                out.setdefault(key, {})[name] = values
        return out

    def rows(self, name: str) -> np.ndarray:
        """``rows.npy`` of field ``name`` (uint64 ``[rows, 4]``), checked by its sha256."""
        if name not in self._rows:
            entry = self.entries[name]
            location = member_location(self.cache, f"{entry['folder']}/{ROWS_NAME}")
            rows = _checked_npy(location, entry["rows"]["sha256"])
            count = sum(s["samples"] for s in self.index["shards"])
            if rows.dtype != np.dtype("<u8") or rows.shape != (count, len(ROW_COLUMNS)):
                raise ShardError(
                    f"{location}: {rows.dtype} {rows.shape}, expected uint64 [{count}, 4]"
                )
            self._rows[name] = rows
        return self._rows[name]

    def values(self, name: str) -> np.ndarray:
        """``values.npy`` of scalar field ``name``: one number per table row, checked by its
        sha256, dtype and length; one line for a field that is not one number per utterance."""
        entry = self.entries[name]
        if "values" not in entry:
            shape = ", ".join(map(str, entry["shape"]))
            held = f"[1, {shape}] per utterance" if entry.get("per_utterance") else f"[T, {shape}]"
            raise UserError(
                f"cache {self.cache}: field {name!r} holds {held}, not one number per utterance; "
                "data.where and data.balance.weight read a field derived with "
                "FieldEncoder(per_utterance=True, shape=())"
            )
        location = member_location(self.cache, f"{entry['folder']}/{VALUES_NAME}")
        values = _checked_npy(location, entry["values"]["sha256"])
        count = sum(s["samples"] for s in self.index["shards"])
        if values.dtype != np.dtype(entry["dtype"]).newbyteorder("<") or values.shape != (count,):
            raise ShardError(
                f"{location}: {values.dtype} {values.shape}, expected {entry['dtype']} [{count}]"
            )
        return values

    def row(
        self, row: int, shard: str, read: Callable[[str, str, int, int], Any]
    ) -> dict[str, np.ndarray]:
        """Every field of cache row ``row`` (in mel shard ``shard``), one ranged read each:
        ``read(field, shard, offset, length)`` gives the bytes."""
        out = {}
        for name in self.names:
            offset, size, frames, digest = (int(v) for v in self.rows(name)[row])
            location = self.location(name, shard)
            if (name, shard) not in self._bound:  # once per field shard: is it this cache's?
                number = self._numbers[shard]
                head = read(
                    name, shard, 0, min(HEAD_BYTES, self.entries[name]["shards"][number]["bytes"])
                )
                problem = binding_problem(
                    read_bound(head, location), self.index["shards"][number], location
                )
                if problem:
                    raise ShardError(problem)
                self._bound.add((name, shard))
            data = read(name, shard, offset, size)
            if sample_digest(data) != digest:
                raise ShardError(
                    f"{location}: the {size} bytes at {offset} are not the field {ROWS_NAME} "
                    "records (field shard replaced or damaged)"
                )
            values = decode_field(data, self.entries[name], f"{location}:row {row}")
            if len(values) != frames:
                raise ShardError(
                    f"{location}:row {row}: {len(values)} frames, {ROWS_NAME} says {frames}"
                )
            out[name] = values
        return out


def _checked_npy(location: str, sha256: str) -> np.ndarray:
    """The array in the ``.npy`` at ``location``, whose bytes the index gives ``sha256`` of."""
    try:
        data = bytes(read_bytes(location))
    except OSError as exc:
        raise ShardError(f"{location}: cannot read ({exc})") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ShardError(f"{location}: sha256 differs from the index (corrupt or replaced)")
    return np.load(io.BytesIO(data), allow_pickle=False)


NO_MEL = "none"  # a RawSample's storage when it was read from a field shard: no mel at all


def read_field_shard(
    location: str, entry: Mapping[str, Any], check: ShardCheck, name: str, field: Mapping[str, Any]
) -> list[RawSample]:
    """Every sample of field ``name``'s shard at ``location`` (index entry ``entry``, which
    names its mel shard's sha256) as the loader reads a mel shard, but with no mel: text and
    metadata from the copy of the mel sample's json, ``frames`` the field's, and the values
    in ``fields``. Checked like a mel shard: size, digest, binding, frames, count."""
    data = load_shard(location)
    problems = check.problems(data, entry, location)
    mel = {"name": f"the mel shard of {entry['name']}", "sha256": entry.get("mel_sha256")}
    bound = binding_problem(read_bound(data, location), mel, location)
    if bound or problems:
        raise ShardError(bound or problems[0])
    values = dict(field_samples(data, name, field, location))
    samples = []
    for sample in shard_samples(data, location):
        key = sample["__key__"]
        if key not in values:
            raise ShardError(f"{location}:{key}: no {name}.npy member")
        raw = raw_sample({**sample, MEL_MEMBER: b""}, location)  # its checks, on the metadata
        samples.append(
            dataclasses.replace(
                raw, mel=b"", storage=NO_MEL, frames=len(values[key]), fields={name: values[key]}
            )
        )
    low, high = entry["min_frames"], entry["max_frames"]
    if len(samples) != entry["samples"] or not all(low <= s.frames <= high for s in samples):
        raise ShardError(f"{location}: samples or frames differ from the index's entry")
    return samples
