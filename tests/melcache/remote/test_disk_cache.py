"""A node's local copies of a store's shards (``data.cache_dir``, ``data.cache_bytes``,
``melcache/remote/disk_cache.py``), on the sample cache pushed to a real S3 server (moto): the same
batches as the store, hits on a second pass, the folder bounded by bytes, a damaged copy read
again from the store, folders and bounds that cannot work refused in one line, and the counts
in the trainer's metrics.jsonl."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from melcache.index import read_index
from melcache.loader import DataConfig, make_loader
from melcache.remote.disk_cache import MARKER
from tests.support.helpers import S3_BUCKET, metrics, run_ok, run_preprocess, train_cmd

DATA = DataConfig(batch_frames=1500, max_batch_size=2, num_workers=0, sync_buckets=True)


def stream(cache: str, data: DataConfig, count: int) -> tuple[list, dict | None]:
    """``count`` batches of one in-process rank, and its loader's disk cache counts."""
    loader = make_loader(cache, data, seed=3)
    try:
        return [b for _, b in zip(range(count), loader, strict=False)], loader.disk_cache
    finally:
        loader.close()


def same(a: list, b: list) -> bool:
    return all(x.keys == y.keys and torch.equal(x.mel, y.mel) for x, y in zip(a, b, strict=True))


def copies(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.glob("*.tar")}


def test_copies_serve_the_second_pass_and_stay_within_their_bound(
    pushed: str, tmp_path: Path
) -> None:
    shards = read_index(pushed)["shards"]
    want, _ = stream(pushed, DATA, 40)
    folder = tmp_path / "disk"
    roomy = dataclasses.replace(
        DATA, cache_dir=str(folder), cache_bytes=10 * sum(s["bytes"] for s in shards)
    )
    first, counts = stream(pushed, roomy, 40)
    # each shard read from the store once (the pass reads some twice: those are hits)
    assert same(first, want) and counts["misses"] == len(copies(folder)) > 0
    assert set(copies(folder)) <= {f"{s['sha256']}.tar" for s in shards}
    again, counts = stream(pushed, roomy, 40)
    assert same(again, want) and counts["misses"] == 0 and counts["hits"] > 0
    # Room for the shards a job keeps open, and little more: the oldest copies make way.
    largest = max(s["bytes"] for s in shards)
    tight = dataclasses.replace(
        roomy, cache_dir=str(tmp_path / "tight"), cache_bytes=2 * len(shards) * largest
    )
    bounded, counts = stream(pushed, tight, 40)
    assert same(bounded, want) and sum(copies(tmp_path / "tight").values()) <= tight.cache_bytes


def test_a_damaged_copy_is_read_again_from_the_store(pushed: str, tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    data = dataclasses.replace(DATA, cache_dir=str(folder), cache_bytes=1 << 30)
    want, _ = stream(pushed, data, 20)
    for copy in folder.glob("*.tar"):  # flip a byte in the middle of every copy
        raw = bytearray(copy.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        copy.write_bytes(bytes(raw))
    got, counts = stream(pushed, data, 20)
    assert same(got, want) and counts["misses"] == len(copies(folder)) > 0


def test_folders_and_bounds_that_cannot_work_are_one_line(
    pushed: str, sample_cache: Path, tmp_path: Path
) -> None:
    others = tmp_path / "others"
    others.mkdir()
    (others / "notes.txt").write_text("someone's files")
    for cache, options, message in (
        (pushed, {"cache_dir": str(others), "cache_bytes": 1 << 30}, "holds files melcache did not write"),
        (pushed, {"cache_dir": str(sample_cache), "cache_bytes": 1 << 30}, "is a cache folder"),
        (pushed, {"cache_dir": str(tmp_path / "small"), "cache_bytes": 1000}, "cannot hold the"),
        (str(sample_cache), {"cache_dir": str(tmp_path / "local"), "cache_bytes": 1 << 30}, "every cache of this job is a local folder"),
    ):  # fmt: skip
        with pytest.raises(UserError, match=message):
            make_loader(cache, dataclasses.replace(DATA, **options))
    assert (others / "notes.txt").exists() and not (others / MARKER).exists()
    with pytest.raises(UserError, match=r"data\.cache_bytes"):
        DataConfig(cache_dir=str(tmp_path / "x"))  # a folder with no bound


@pytest.mark.slow  # a 2-rank torchrun job
def test_the_trainer_writes_the_hits_and_misses_into_metrics(
    endpoint: str, train_cache: Path, tmp_path: Path
) -> None:
    location = f"s3://{S3_BUCKET}/disk-train"
    run_preprocess("push", str(train_cache), location)
    disk = [f"data.cache_dir={tmp_path / 'disk'}", f"data.cache_bytes={1 << 30}"]
    run_ok(train_cmd(location, tmp_path / "run", *disk, "train.log_every=2", max_steps=8))
    logged = [r for r in metrics(tmp_path / "run") if "disk_cache_misses" in r]
    assert len(logged) == 4 and logged[-1]["disk_cache_misses"] > 0
    assert logged[-1]["disk_cache_hits"] > 0  # the train cache's shards are read again
    reads = [r["disk_cache_hits"] + r["disk_cache_misses"] for r in logged]
    assert reads == sorted(reads)  # counted from the start of the run
