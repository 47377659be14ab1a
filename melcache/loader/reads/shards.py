"""One loader worker's reads of whole shards: each checked against its index entry (a mel
shard, or a field shard for a model of fields alone), read through the node's local copies
when the cache is in a store (``data.cache_dir``), and a bad one skipped or raised as
``data.on_error`` says, never hanging when every shard fails."""

from __future__ import annotations

from melcache.errors import ShardError
from melcache.fields.store import read_field_shard
from melcache.loader.spec import StreamSpec
from melcache.location import is_url, member_location
from melcache.reader import RawSample, ShardCheck, read_shard
from melcache.remote.disk_cache import DiskCache, for_process


class SkipLog:
    """The ``on_error`` policy of one worker: re-raise, or note the shard and go on.

    Skipping must not hang: when every shard of the mix has failed (or three times as many
    shards as the mix holds) with no batch in between, it raises after all.
    """

    def __init__(self, on_error: str, num_shards: int) -> None:
        self.on_error = on_error
        self.num_shards = num_shards
        self.pending: list[tuple[str, str]] = []
        self.failed: set[tuple[int, str]] = set()  # distinct (source, shard) failed lately
        self.streak = 0  # shards failed since the last batch

    def record(self, shard: tuple[int, str], name: str, exc: ShardError) -> None:
        if self.on_error == "raise":
            raise exc
        self.pending.append((name, str(exc)))
        self.failed.add(shard)
        self.streak += 1
        if len(self.failed) == self.num_shards or self.streak >= 3 * self.num_shards:
            raise ShardError(
                f"{self.streak} shards in a row failed, {len(self.failed)} of the cache's "
                f"{self.num_shards} distinct; the last: {exc}"
            )

    def take(self) -> tuple[tuple[str, str], ...]:
        """Skips to report with the batch about to be yielded; progress resets the watchdog."""
        pending, self.pending = tuple(self.pending), []
        self.failed, self.streak = set(), 0
        return pending


def read_checked(
    spec: StreamSpec, source: int, shard_id: int, *, check: ShardCheck, skips: SkipLog
) -> list[RawSample] | None:
    """One shard's samples, or ``None`` when it is bad and the policy is to skip it."""
    where, entry = spec.sources[source], spec.sources[source].shards[shard_id]
    location = member_location(where.location, entry["name"])
    try:
        if not spec.data.read_mel:  # the sources are the first field's shards (mix.with_fields)
            name = spec.data.fields[0]
            return read_field_shard(location, entry, check, name, where.fields[name])
        return read_shard(location, entry, check, _disk_cache(spec, where.location))
    except ShardError as exc:
        skips.record((source, entry["name"]), entry["name"], exc)
        return None


def _disk_cache(spec: StreamSpec, location: str) -> DiskCache | None:
    """This process's copies of remote shards (``data.cache_dir``), for a cache in a store."""
    if not spec.data.cache_dir or not is_url(location):
        return None
    return for_process(spec.data.cache_dir, spec.data.cache_bytes)


def disk_counts(spec: StreamSpec) -> tuple[int, int]:
    """This process's disk cache hits and misses since its previous batch."""
    if not spec.data.cache_dir:
        return (0, 0)
    return for_process(spec.data.cache_dir, spec.data.cache_bytes).take_counts()
