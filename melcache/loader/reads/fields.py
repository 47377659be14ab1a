"""The derived fields of the loader's batches (``data.fields``): each batch's rows looked up in
the field shards aligned with the mel shards it came from, read whole and checked like a mel
shard (size, xxh3_128, binding), the last few kept per worker since a shard gives many batches."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from melcache.errors import ShardError
from melcache.fields.format import pad_fields
from melcache.fields.store import FieldStore
from melcache.reader import RawSample

# Field shards a worker keeps parsed: a unit spans two shards, and a worker alternates
# between a few sub-streams; field shards are small (codes: ~7 MB per audio hour).
KEPT_SHARDS = 8


class BatchFields:
    """One worker's reader of the fields ``names`` of every cache of a mix."""

    def __init__(self, sources: Sequence[Any], names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._stores = [
            FieldStore(s.location, {"shards": list(s.shards), "fields": dict(s.fields)}, names)
            if names
            else None
            for s in sources
        ]
        self._numbers = [{e["name"]: i for i, e in enumerate(s.shards)} for s in sources]
        self._kept: collections.OrderedDict[tuple[int, str], dict[str, Any]] = (
            collections.OrderedDict()
        )

    def batch(
        self, source: int, samples: Sequence[RawSample], entries: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The fields of ``samples`` (from the shards ``entries``), padded, and lengths: those
        read with the samples as they are, the rest from the field shards."""
        if not self.names:
            return {}, {}
        found: dict[str, dict[str, np.ndarray]] = {}
        if any(name not in s.fields for s in samples for name in self.names):
            for entry in entries:
                found.update(self._shard(source, entry["name"]))
        fields, lengths = {}, {}
        for name in self.names:
            values = []
            for s in samples:
                value = s.fields.get(name, found.get(s.key, {}).get(name))
                if value is None:
                    raise ShardError(f"{entries[0]['name']}: no field {name!r} for {s.key!r}")
                values.append(value)
            dtype = self._stores[source].entries[name]["dtype"]  # type: ignore[union-attr]
            fields[name], lengths[name] = pad_fields(values, dtype)
        return fields, lengths

    def _shard(self, source: int, name: str) -> dict[str, dict[str, np.ndarray]]:
        kept = self._kept.get((source, name))
        if kept is None:
            store = self._stores[source]
            assert store is not None  # internal invariant: names asked for
            kept = store.shard(self._numbers[source][name])
            self._kept[(source, name)] = kept
            if len(self._kept) > KEPT_SHARDS:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end((source, name))
        return kept
