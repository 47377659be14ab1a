"""The caches one loader reads: their indexes, one feature config, the mix weights, the layout.

``make_loader`` takes one location (one cache), a list of locations (a mix weighted by
``data.mix``, else by hours) or a mapping of locations to weights. Every cache of a mix must
have been built with the same feature config: a batch has one mel definition.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from melcache.batch_plans import round_up
from melcache.errors import UserError
from melcache.extras import REFERENCE, cache_extras
from melcache.features import FeatureConfig, check_features, features_from_dict
from melcache.fields.format import cache_fields
from melcache.fields.store import FieldStore
from melcache.format import INDEX_NAME
from melcache.index import read_index
from melcache.loader.balance import Chosen, choose, named_fields
from melcache.loader.data_config import DataConfig
from melcache.loader.schedule import SubStream, mix_weights
from melcache.loader.spec import MixCache
from melcache.location import is_url, member_location, reads_ranges
from melcache.remote import objectstore
from melcache.remote.disk_cache import check_bound, check_folder
from melcache.sections import as_float
from melcache.table import TABLE_NAME, Table

CacheArg = str | Path | Sequence[str | Path] | Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class OpenedMix:
    """The caches, their parsed indexes, their one feature config and frame shares."""

    sources: tuple[MixCache, ...]
    indexes: tuple[dict[str, Any], ...]
    features: FeatureConfig
    weights: tuple[float, ...]
    # data.mix_schedule: (first batch, frame shares) of each later phase
    phases: tuple[tuple[int, tuple[float, ...]], ...] = ()
    chosen: tuple[Chosen, ...] = ()  # data.where / data.balance: each cache's selection


def with_choice(mix: OpenedMix, data: DataConfig) -> OpenedMix:
    """The mix with each cache's selection by ``data.where`` and ``[data.balance]``, made
    from its table (one line for a cache without one), and the table's first row of each
    shard in its source, so its readers know each sample's row."""
    if not (data.where or data.balance):
        return mix
    chosen, sources = [], []
    for source, index in zip(mix.sources, mix.indexes, strict=True):
        if not index.get("table"):
            raise UserError(
                f"cache {source.location} has no {TABLE_NAME}, which data.where and "
                f"data.balance read: python -m preprocess index-table {source.location} "
                "writes one"
            )
        table = Table(source.location, index)
        if len(table.column("shard_rows")) != len(source.shards) + 1:
            raise UserError(
                f"cache {source.location}: its {TABLE_NAME} lists "
                f"{len(table.column('shard_rows')) - 1} shards and the loader reads "
                f"{len(source.shards)}; data.where and data.balance need them one for one"
            )
        extras = cache_extras(index)
        scalars, versions = _scalar_fields(source.location, index, extras, data)
        chosen.append(choose(table, extras, data.where, data.balance, source.location, scalars))
        first = tuple(table.column("shard_rows").tolist())
        sources.append(dataclasses.replace(source, first_rows=first, selected_by=versions))
    return dataclasses.replace(mix, sources=tuple(sources), chosen=tuple(chosen))


def _scalar_fields(
    location: str, index: Mapping[str, Any], extras: Sequence[str], data: DataConfig
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """The derived fields ``data.where`` / ``data.balance`` name that are no extra (an extra
    of the same name is the one read): each one's value per table row, and its version
    (``name@provenance digest``); one line for a field that is not one number each."""
    named = {name for names in named_fields(data.where, data.balance).values() for name in names}
    fields = cache_fields(index, member_location(location, INDEX_NAME))
    wanted = sorted(named & set(fields) - set(extras))
    if not wanted:
        return {}, ()
    store = FieldStore(location, index, wanted, by="data.where / data.balance")
    versions = tuple(f"{name}@{fields[name]['provenance_digest']}" for name in wanted)
    return {name: store.values(name) for name in wanted}, versions


def open_mix(
    cache: CacheArg, data: DataConfig, expect_features: Mapping[str, Any] | FeatureConfig | None
) -> OpenedMix:
    """Read every cache's index, check their features against ``expect_features`` and each
    other, and resolve the weights: given, else ``data.mix``, else hours; then ``^α``."""
    locations, given = _locations(cache)
    if given is None and data.mix:
        given = _configured_weights(locations, data.mix)
    _check_temperature(data.mix_temperature)
    indexes = tuple(read_index(where) for where in locations)
    features = features_from_dict(indexes[0]["features"], source=f"{locations[0]} index")
    check_features(features, expect_features, locations[0])
    for where, index in zip(locations[1:], indexes[1:], strict=True):
        other = features_from_dict(index["features"], source=f"{where} index")
        for key, value in features.to_dict().items():
            if other.to_dict()[key] != value:
                raise UserError(
                    f"cache {where} was built with features.{key} = {other.to_dict()[key]!r} "
                    f"but cache {locations[0]} with {value!r}: the caches of a mix need one "
                    "feature config; rebuild one of them"
                )
    hours = [sum(s["frames"] for s in index["shards"]) for index in indexes]
    sources = tuple(
        MixCache(where, tuple(index["shards"]), ranged=_reads_by_table(where, index, data))
        for where, index in zip(locations, indexes, strict=True)
    )
    weights = tuple(mix_weights(hours, given, data.mix_temperature))
    phases = tuple(
        (int(start), tuple(mix_weights(hours, _configured_weights(locations, table, key), alpha)))
        for start, table in data.mix_schedule.items()
        for alpha, key in [(data.mix_temperature, f"data.mix_schedule.{start}")]
    )
    # The indexes are all the parent reads of a store; its workers are forked after this and
    # make their own clients, so the one made here goes (it would only hold sockets open).
    objectstore.forget_clients()
    return OpenedMix(sources, indexes, features, weights, phases)


def _locations(cache: CacheArg) -> tuple[list[str], list[float] | None]:
    """The caches ``make_loader`` was given, each once, and their weights when given."""
    if isinstance(cache, (str, Path)):
        locations, given = [_location(cache)], None
    elif isinstance(cache, Mapping):
        locations = [_location(k) for k in cache]
        given = [
            _weight(f"loader mix weight of cache {w}", v)
            for w, v in zip(locations, cache.values(), strict=True)
        ]
    elif isinstance(cache, Sequence) and cache:
        locations, given = [_location(c) for c in cache], None
    else:
        raise UserError(
            f"loader cache {cache!r}: expected a location (str or Path), a list of them or a "
            "mapping of locations to weights"
        )
    seen: dict[str, str] = {}
    for where in locations:
        if same_cache(where) in seen:
            raise UserError(
                f"loader caches {locations}: {seen[same_cache(where)]} and {where} are one "
                "cache; give each once"
            )
        seen[same_cache(where)] = where
    return locations, given


def _location(where: object) -> str:
    if not isinstance(where, (str, Path)) or not str(where):
        raise UserError(f"loader cache {where!r}: expected a location, a str or Path")
    return str(where)


def same_cache(where: str) -> str:
    """What two locations of one cache share: the resolved folder (symlinks, ``./``, a final
    slash), or an http(s) or s3 URL without its final slashes."""
    if is_url(where):
        return where.rstrip("/") if reads_ranges(where) else where
    return str(Path(where).resolve())


def _weight(name: str, value: object) -> float:
    """``value`` as a finite weight > 0, else a UserError naming it (``name``)."""
    weight = as_float(value)
    if not (math.isfinite(weight) and weight > 0):
        raise UserError(f"{name} = {value!r} is invalid: expected a finite number > 0")
    return weight


def _configured_weights(
    locations: list[str], mix: Mapping[str, Any], key: str = "data.mix"
) -> list[float]:
    """``data.mix``'s weight of each cache, matched by :func:`same_cache`: it must name exactly
    the caches the run reads (a weight of a cache not read would be ignored without a word)."""
    named = {same_cache(str(where)): where for where in mix}
    mine = [same_cache(where) for where in locations]
    differs = sorted(
        [str(named[n]) for n in named if n not in mine]
        + [w for w, n in zip(locations, mine, strict=True) if n not in named]
    )
    if differs or len(named) != len(mix):
        raise UserError(
            f"{key} names {sorted(map(str, mix))} but the caches are {locations}: give one "
            f"weight per cache, keyed by its location (differs: {differs or 'a cache named twice'})"
        )
    return [_weight(f"{key}.{named[n]}", mix[named[n]]) for n in mine]


def _check_temperature(value: object) -> None:
    alpha = as_float(value)
    if not (math.isfinite(alpha) and alpha >= 0):
        raise UserError(
            f"data.mix_temperature = {value!r} is invalid: expected a finite number, 0 or more"
        )


def check_extras(mix: OpenedMix, asked: Sequence[str]) -> None:
    """Refuse, naming the field, an extra asked for that a cache of the mix does not carry."""
    for source, index in zip(mix.sources, mix.indexes, strict=True):
        carried = cache_extras(index)
        missing = next((name for name in asked if name not in (*carried, REFERENCE)), None)
        if missing is not None:
            raise UserError(
                f"cache {source.location} has no per-utterance field {missing!r}, asked for by "
                f"data.extras or the model's melcache_contract (it carries "
                f"{', '.join(carried) or 'none'}): rebuild it from a manifest with "
                f'[build] extras = ["{missing}"]'
            )


def with_fields(mix: OpenedMix, data: DataConfig, by: str = "data.fields") -> OpenedMix:
    """The mix with each cache's entries of the fields ``data.fields`` (in its sources, for
    the workers); one line naming both for a field a cache lacks or whose provenance is not
    ``data.field_provenance``'s."""
    if not data.fields:
        return mix
    sources = []
    for source, index in zip(mix.sources, mix.indexes, strict=True):
        store = FieldStore(source.location, index, data.fields, data.field_provenance, by)
        source = dataclasses.replace(source, fields=store.entries)
        if not data.read_mel:  # fields alone: the first field's shards stand for the mel's
            first = store.entries[data.fields[0]]
            folder = member_location(source.location, first["folder"])
            source = dataclasses.replace(
                source, location=folder, shards=tuple(first["shards"]), ranged=False
            )
        sources.append(source)
    return dataclasses.replace(mix, sources=tuple(sources))


def _reads_by_table(where: str, index: dict[str, Any], data: DataConfig) -> bool:
    """Whether bucket readers read only their batches' samples (see ``MixCache.ranged``): a
    local cache whose index lists a table, unless every read must be checked by sha256; the
    table is checked here, so a damaged one is one error before any worker starts."""
    if not (data.sync_buckets and data.shard_check != "sha256" and index.get("table")):
        return False
    if is_url(where):  # a range request per utterance would cost more than whole shards
        return False
    Table(where, index)
    return True


def whole_shared_reads(
    sources: Sequence[MixCache], subs: Sequence[SubStream], data: DataConfig, num_slots: int
) -> list[str]:
    """One line per local cache whose shards the job's slots share but must read whole, as it
    has no table: each slot then reads all of a unit for its few batches of it. (``shard_check
    = "sha256"`` reads whole shards by choice.)"""
    if not data.sync_buckets or data.shard_check == "sha256" or not data.read_mel:
        return []  # (field shards are small, and have no table of their own: read whole)
    return [
        f"cache {source.location} has no {TABLE_NAME}: the job's {num_slots} workers share its "
        "shards and each reads them whole for its own batches; python -m preprocess "
        f"index-table {source.location} writes one"
        for number, source in enumerate(sources)
        if not source.ranged
        and not is_url(source.location)
        and any(sub.source == number and len(sub.units) < num_slots for sub in subs)
    ]


def check_layout(sources: Sequence[MixCache], data: DataConfig, num_slots: int) -> None:
    """Refuse a budget table that does not name exactly the mix's buckets, a budget below a
    bucket's longest utterance, and (whole-cache streams only) a cache with fewer shards
    than the job has workers."""
    for source in sources:
        if not data.sync_buckets and len(source.shards) < num_slots:
            raise UserError(
                f"cache {source.location} has {len(source.shards)} shards, fewer than "
                f"world_size × workers = {num_slots}, so a worker would get none with "
                "data.sync_buckets = false; use data.sync_buckets = true (workers then share "
                f"shards), fewer workers, or rebuild with [build] min_shards >= {num_slots}"
            )
    longest = bucket_lengths(tuple(s for source in sources for s in source.shards))
    where = " + ".join(source.location for source in sources)
    if isinstance(data.batch_frames, dict):
        named, present = {int(b) for b in data.batch_frames}, set(longest)
        if named != present:
            raise UserError(
                f"data.batch_frames names buckets {sorted(named)} but cache {where} has buckets "
                f"{sorted(present)}: give one budget per bucket of this cache (python -m train "
                "tune writes such a table), or one number for all"
            )
    for bucket, frames in longest.items():
        budget, padded = data.budget(bucket), round_up(frames, data.pad_multiple)
        if padded > budget:
            key = "batch_frames" if isinstance(data.batch_frames, int) else f"batch_frames.{bucket}"
            raise UserError(
                f"loader {key} = {budget} is below the longest utterance of bucket {bucket} of "
                f"cache {where} ({frames} frames, {padded} padded); raise {key}"
            )


def bucket_lengths(shards: tuple[dict[str, Any], ...]) -> dict[int, int]:
    """The longest utterance (frames) of each length bucket, from the index's shard entries."""
    longest: dict[int, int] = {}
    for shard in shards:
        longest[shard["bucket"]] = max(longest.get(shard["bucket"], 0), shard["max_frames"])
    return dict(sorted(longest.items()))


def largest_batch(sources: Sequence[MixCache], data: DataConfig) -> int:
    """Padded frames of the largest batch the loader can make: per bucket its budget, or
    ``max_batch_size`` of its longest utterances when fewer frames than that."""
    shards = tuple(s for source in sources for s in source.shards)
    return max(
        min(data.budget(bucket), data.max_batch_size * round_up(frames, data.pad_multiple))
        for bucket, frames in bucket_lengths(shards).items()
    )


def content_digest(shards: tuple[dict[str, Any], ...]) -> str:
    """A short digest of a cache's content as its index lists it."""
    blob = json.dumps([[s["name"], s["samples"], s.get("sha256")] for s in shards]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_disk_cache(
    sources: Sequence[MixCache], subs: Sequence[SubStream], data: DataConfig
) -> None:
    """``data.cache_dir`` usable and ``data.cache_bytes`` able to hold the shards a rank's
    workers read at once (every worker up to two shards of each sub-stream); one line if not."""
    if not data.cache_dir:
        return
    remote = [s for s in sources if is_url(s.location)]
    if not remote:
        raise UserError(
            f"data.cache_dir = {data.cache_dir!r} keeps copies of caches in a store (s3://, "
            "http(s)://); every cache of this job is a local folder"
        )
    check_folder(data.cache_dir)
    largest = max(int(shard["bytes"]) for s in remote for shard in s.shards)
    check_bound(data.cache_bytes, largest, 2 * len(subs) * max(1, data.num_workers))
