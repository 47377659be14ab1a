"""Slots that share a unit of shards read only their own batches (#25), by the cache's table.

At 16 ranks the sample cache's 8 shards are shared by every slot: each takes one batch of a
unit at a time. These run the loader's own readers and real loaders in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import melcache.access
import melcache.loader.reads.shards
import melcache.loader.spec
import melcache.loader.units
from melcache.access import Cache
from melcache.batch_plans import _GreedyRuns
from melcache.errors import ShardError, UserError
from melcache.loader import DataConfig, StreamLoader, make_loader
from melcache.loader.stream import planned_stream
from melcache.table import TABLE_NAME

DATA = {"batch_frames": 3000, "max_batch_size": 3, "num_workers": 0}
RANKS = 16


def make(cache: Path, rank: int, **data: object) -> StreamLoader:
    options = DataConfig(**{**DATA, **data})  # type: ignore[arg-type]
    return make_loader(cache, options, rank=rank, world_size=RANKS, seed=1)


def planned_keys(spec: melcache.loader.spec.StreamSpec, steps: int) -> list[list[str]]:
    stream = planned_stream(spec, 0)
    keys = [[s.key for s in planned[2]] for _, planned in zip(range(steps), stream, strict=False)]
    stream.close()
    return keys


def test_slots_sharing_a_unit_read_only_their_batches_and_get_the_same_stream(
    sample_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Samples read, over samples handed out: near 1 by the table, several reading whole."""
    read = [0]
    read_shard, raw_rows = melcache.loader.reads.shards.read_shard, Cache.raw_rows

    def whole(location: str, entry: dict, check: object, disk: object = None) -> list:
        read[0] += entry["samples"]
        return read_shard(location, entry, check, disk)

    def ranged(self: Cache, rows: list[int]) -> list:
        read[0] += len(rows)
        return raw_rows(self, rows)

    monkeypatch.setattr(melcache.loader.reads.shards, "read_shard", whole)
    monkeypatch.setattr(Cache, "raw_rows", ranged)
    for rank in (0, RANKS - 1):
        spec = make(sample_cache, rank).spec
        assert all(source.ranged for source in spec.sources)  # local, with a table
        read[0] = 0
        keys = planned_keys(spec, 12)
        used = sum(map(len, keys))
        # A slot that takes a whole small unit reads it whole: at most 1 / RANGED_BELOW over.
        assert used <= read[0] <= used / melcache.loader.units.RANGED_BELOW
        by_shard = dataclasses.replace(
            spec, sources=tuple(dataclasses.replace(s, ranged=False) for s in spec.sources)
        )
        read[0] = 0
        assert planned_keys(by_shard, 12) == keys  # batch for batch, the stream reading whole
        assert read[0] >= 2 * used  # ...which reads a unit's shards for each of its batches


def damaged_copy(cache: Path, out: Path, key: str) -> str:
    """A copy of ``cache`` with one byte of ``key``'s mel flipped; the shard's name."""
    shutil.copytree(cache, out)
    with Cache(out) as opened:
        (row,) = opened.table.rows_of(key)
        name = opened.index["shards"][opened.table.shard_of(row)]["name"]
        at = int(opened.table.column("offset")[row] + opened.table.column("mel_at")[row])
    path = out / name
    data = bytearray(path.read_bytes())
    data[at + 200] ^= 0xFF  # past the .npy header: only a digest can tell
    path.write_bytes(bytes(data))
    return name


def test_a_damaged_sample_read_by_range_is_one_line_naming_its_shard(
    sample_cache: Path, tmp_path: Path
) -> None:
    first = planned_keys(make(sample_cache, 0).spec, 1)[0]
    name = damaged_copy(sample_cache, tmp_path / "cache", first[0])
    with pytest.raises(ShardError, match=rf"{name}: the \d+ bytes at \d+ are not the sample"):
        next(iter(make(tmp_path / "cache", 0)))
    loader = make(tmp_path / "cache", 0, on_error="skip")
    stream = iter(loader)
    batches = [next(stream) for _ in range(6)]
    stream.close()
    assert first[0] not in {key for batch in batches for key in batch.keys}
    ((skipped, reason),) = loader.skipped_shards.items()
    assert name in skipped and "\n" not in reason and TABLE_NAME in reason


def test_a_damaged_table_is_refused_before_any_worker_starts(
    sample_cache: Path, tmp_path: Path
) -> None:
    shutil.copytree(sample_cache, tmp_path / "cache")
    table = tmp_path / "cache" / TABLE_NAME
    data = bytearray(table.read_bytes())
    data[-1] ^= 0xFF
    table.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"{TABLE_NAME}: xxh3_128 differs.*index-table"):
        make(tmp_path / "cache", 0)
    whole_cache = DataConfig(**{**DATA, "sync_buckets": False})  # type: ignore[arg-type]
    assert not make_loader(tmp_path / "cache", whole_cache).spec.sources[0].ranged  # unread


def test_slots_sharing_a_cache_without_a_table_are_told_how_to_write_one(
    sample_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = tmp_path / "cache"  # as a build before the table wrote it
    shutil.copytree(sample_cache, old)
    index = json.loads((old / "index.json").read_text())
    del index["table"]
    (old / "index.json").write_text(json.dumps(index))
    (old / TABLE_NAME).unlink()

    def warned(cache: Path, rank: int = 0, world_size: int = RANKS) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="melcache.loader.stream_loader"):
            make_loader(cache, DataConfig(**DATA), rank=rank, world_size=world_size)  # type: ignore[arg-type]
        return [record.getMessage() for record in caplog.records]

    (line,) = warned(old)
    assert f"{old} has no {TABLE_NAME}" in line and f"index-table {old}" in line
    assert warned(old, rank=1) == []  # one line per job
    assert warned(old, world_size=1) == []  # one slot: nothing shared
    assert warned(sample_cache) == []  # read by range


def test_a_cache_keeps_at_most_open_shards_files_open(
    sample_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(melcache.access, "OPEN_SHARDS", 2)

    def open_shards() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # listdir's own descriptor, gone
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sum(str(sample_cache) in link and link.endswith(".tar") for link in links)

    with Cache(sample_cache) as opened:
        starts = opened.table.column("shard_rows")[:-1].tolist()
        assert len(starts) > 2
        for row in starts:  # one utterance of every shard
            assert opened.raw_rows([row])[0].frames == int(opened.lengths[row])
            assert open_shards() <= 2
    assert open_shards() == 0


def test_a_shard_cut_off_while_mapped_is_an_error_not_a_crash(
    sample_cache: Path, tmp_path: Path
) -> None:
    shutil.copytree(sample_cache, tmp_path / "cache")
    with Cache(tmp_path / "cache") as opened:
        first, last = 0, int(opened.table.column("shard_rows")[1]) - 1  # both of shard 0
        assert opened.raw_rows([last])[0].frames == int(opened.lengths[last])  # mapped now
        name = opened.index["shards"][0]["name"]
        os.truncate(tmp_path / "cache" / name, int(opened.table.column("offset")[last]))
        with pytest.raises(ShardError, match=rf"{name}: \d+ bytes now, cut off before"):
            opened.raw_rows([last])
        assert opened.raw_rows([first])[0].frames == int(opened.lengths[first])  # before the cut


def test_even_cut_runs_match_the_greedy_rule_sample_by_sample() -> None:
    """The cut's runs are those of the plain rule: each run takes samples while (size + 1) ×
    longest padded length stays within the cap."""

    def greedy(padded: list[int], cap: int, max_batch_size: int) -> list[list[int]]:
        runs: list[list[int]] = []
        longest = 0
        for place, length in enumerate(padded):
            top = max(longest, length)
            if runs and len(runs[-1]) < max_batch_size and (len(runs[-1]) + 1) * top <= cap:
                runs[-1].append(place)
                longest = top
            else:
                runs.append([place])
                longest = length
        return runs

    rng = np.random.default_rng(0)
    for trial in range(400):
        padded = rng.integers(1, 60, size=int(rng.integers(1, 120))) * 8
        if trial % 2:  # as the cut sees them: sorted longest first, a few out of place
            padded = np.sort(padded)[::-1] + rng.integers(0, 2, size=len(padded)) * 8
        cap, size = int(rng.integers(0, 4000)), int(rng.integers(1, 70))
        ends = [run[-1] + 1 for run in greedy(padded.tolist(), cap, size)]
        assert _GreedyRuns(padded, size).ends(cap) == ends
