"""Caches in an object store: the sample cache pushed to a real S3 server (moto's standalone
server on loopback, started for this module and stopped after) and read back by the loader,
``melcache.open``, ``CacheDataset``, ``verify`` and ``inspect``; built into the store by two
parts, one killed and rerun; the failures a user meets (a wrong bucket, no credentials, no
server, a cache half pushed) as one line each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import numpy as np
import pytest
from torch.utils.data import DataLoader

import melcache
from benchmarks.common.s3_server import CREDENTIALS, free_port, s3_environment
from benchmarks.store.s3_faults import ISSUE_FAULTS, NO_FAULTS, fault_proxy
from melcache.dataset import CacheDataset
from melcache.errors import ShardError, UserError
from melcache.format import INDEX_NAME
from melcache.index import read_index
from melcache.loader import Batch, DataConfig, make_loader
from melcache.reader import ShardCheck, read_shard
from melcache.remote import objectstore
from preprocess.write.push import cache_files
from preprocess.write.staged import StoreOut, default_staging
from tests.support.helpers import (
    REPO,
    S3_BUCKET,
    SAMPLE_CORPUS,
    checkpoint,
    metrics,
    receipts,
    run_ok,
    run_preprocess,
    same_ddp_run,
    started,
    torchrun,
    train_cmd,
    wait_for,
)
from tests.support.loaders import assert_same


def data(workers: int = 2) -> DataConfig:
    return DataConfig(batch_frames=1500, max_batch_size=2, num_workers=workers, sync_buckets=True)


def batches(cache: str | Path, count: int, state: dict | None = None, **options) -> list[Batch]:
    loader = make_loader(cache, data(), seed=3, **options)
    if state is not None:
        loader.load_state_dict(state)
    try:
        return [batch for _, batch in zip(range(count), loader, strict=False)]
    finally:
        loader.close()


@pytest.mark.slow  # subprocesses or eight loaders of 2 workers
def test_a_pushed_cache_streams_batch_for_batch_as_the_local_copy_and_resumes(
    pushed: str, sample_cache: Path
) -> None:
    for rank in (0, 1):  # two in-process ranks of one job, each with 2 workers
        ranks = {"rank": rank, "world_size": 2}
        local = batches(sample_cache, 24, **ranks)
        assert_same(batches(pushed, 24, **ranks), local)
        loader = make_loader(pushed, data(), seed=3, **ranks)
        stream = iter(loader)
        for _ in range(9):
            next(stream)
        state = loader.state_dict()
        loader.close()
        assert_same(batches(pushed, 15, state, **ranks), local[9:])


def test_open_and_the_dataset_answer_as_the_local_copy(pushed: str, sample_cache: Path) -> None:
    with melcache.open(pushed) as remote, melcache.open(sample_cache) as local:
        assert len(remote) == len(local) and remote.keys() == local.keys()
        key = local.keys()[7]
        assert np.array_equal(remote[key].mel, local[key].mel)
        assert remote[key].text == local[key].text and remote[3].key == local[3].key
        assert [u.key for u in remote.get_many(local.keys()[:5])] == local.keys()[:5]
    # In forked DataLoader workers too: each makes its own client after the fork.
    rows = [3, 11, 4, 20, 0, 17]
    loader = DataLoader(CacheDataset(pushed), sampler=rows, batch_size=None, num_workers=2)
    local = CacheDataset(sample_cache)
    assert all(np.array_equal(i["mel"], local[r]["mel"]) for i, r in zip(loader, rows, strict=True))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_the_loaders_parent_holds_no_client_once_four_workers_run(pushed: str) -> None:
    loader = make_loader(pushed, data(workers=4))
    stream = iter(loader)
    try:
        assert len(next(stream)) > 0  # the workers read the shards, each with its own client
        assert objectstore.held_clients() == 0  # the one that read the index is gone
        assert "obstore" not in sys.modules  # and no client runtime (boto3 has none)
    finally:
        loader.close()


@pytest.mark.slow  # subprocesses or eight loaders of 2 workers
def test_push_resumes_and_refuses_another_cache(endpoint: str, sample_cache: Path) -> None:
    location = f"s3://{S3_BUCKET}/resume"
    first = run_preprocess("push", str(sample_cache), location)
    s3 = boto3.client("s3")
    key = next(k for k in objectstore.list_sizes(location) if k.endswith(".tar"))
    s3.put_object(Bucket=S3_BUCKET, Key=f"resume/{key}", Body=b"damaged")  # then a killed push
    s3.delete_object(Bucket=S3_BUCKET, Key=f"resume/{INDEX_NAME}")
    again = run_preprocess("push", str(sample_cache), location)
    assert "objects uploaded" in first.stdout
    assert again.stdout.strip().endswith("2 objects uploaded, 16 already there"), again.stdout
    with melcache.open(location) as cache:
        assert len(cache) == 30
    other = run_preprocess("push", str(REPO / "docs"), location, check=False)
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # subprocesses or eight loaders of 2 workers
def test_pushed_cache_passes_verify_and_inspect(pushed: str) -> None:
    verified = run_preprocess("verify", pushed)
    assert verified.stdout.strip().endswith(f"{pushed}: OK"), verified.stdout
    inspected = run_preprocess("inspect", pushed)
    assert "utterances" in inspected.stdout


def one_line_error(*args: str, env: dict[str, str]) -> str:
    """``python -m preprocess ARGS`` under ``env``: exit 2, one line on stderr, quickly."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "preprocess", *args], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert time.monotonic() - began < 60
    return lines[0]


@pytest.mark.slow  # subprocesses or eight loaders of 2 workers
def test_a_wrong_bucket_no_credentials_no_server_and_half_a_cache_are_one_line_each(
    pushed: str, endpoint: str
) -> None:
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    assert "no bucket 'nowhere'" in one_line_error("inspect", "s3://nowhere/sample", env=env)
    bare = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    bare |= {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
             "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    assert "no S3 credentials" in one_line_error("verify", pushed, env=bare)
    closed = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    assert "giving up after" in one_line_error("inspect", pushed, env=closed)
    s3 = boto3.client("s3")
    for name in objectstore.list_sizes(pushed):
        if name.endswith(".tar") or name == "utterances.table":
            s3.copy_object(
                Bucket=S3_BUCKET, Key=f"half/{name}", CopySource=f"{S3_BUCKET}/sample/{name}"
            )
    assert "has not finished" in one_line_error("verify", f"s3://{S3_BUCKET}/half", env=env)
    with pytest.raises(UserError, match="has not finished"):
        melcache.open(f"s3://{S3_BUCKET}/half")


def test_a_flaky_store_loses_and_changes_no_sample(pushed: str, endpoint: str) -> None:
    """Through a proxy answering 20 % of requests 503 SlowDown, cutting 5 % of bodies short
    and resetting 1 % of connections: the same batches, every lookup the true utterance."""
    want = batches(pushed, 40)
    with fault_proxy(endpoint, ISSUE_FAULTS, seed=1) as proxy, s3_environment(proxy):
        objectstore.forget_clients()  # this process's next requests go through the proxy
        assert_same(batches(pushed, 40), want)
        with melcache.open(pushed) as remote:
            got = [remote[row].mel for row in range(len(remote))]
        objectstore.forget_clients()
    with melcache.open(pushed) as remote:
        assert all(np.array_equal(g, remote[row].mel) for row, g in enumerate(got))


@pytest.mark.slow  # two 2-rank torchrun jobs
def test_the_trainer_reads_train_and_validation_caches_from_the_store(
    endpoint: str, train_cache: Path, tmp_path: Path
) -> None:
    location = f"s3://{S3_BUCKET}/train"
    run_preprocess("push", str(train_cache), location)
    validation = ("train.validation.every=4",)
    for cache, out in ((train_cache, tmp_path / "local"), (location, tmp_path / "store")):
        run_ok(train_cmd(cache, out, "--val-shards", str(cache), *validation, max_steps=8))
    same_ddp_run(checkpoint(tmp_path / "local", 8), checkpoint(tmp_path / "store", 8))
    assert [r["val_loss"] for r in metrics(tmp_path / "store") if "val_loss" in r] == [
        r["val_loss"] for r in metrics(tmp_path / "local") if "val_loss" in r
    ]


def test_a_read_that_fails_past_its_budget_names_the_object_and_on_error_handles_it(
    pushed: str, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = read_index(pushed)
    first = index["shards"][0]
    location = f"{pushed}/{first['name']}"
    monkeypatch.setattr(objectstore, "ATTEMPTS", 3)
    with fault_proxy(endpoint, {**NO_FAULTS, "slowdown": 1.0}) as proxy, s3_environment(proxy):
        objectstore.forget_clients()
        with pytest.raises(ShardError, match=rf"{location}: giving up after 3 .*503 SlowDown"):
            read_shard(location, first, ShardCheck())
    objectstore.forget_clients()
    copy = f"s3://{S3_BUCKET}/one-shard-gone"  # the index there, a shard missing
    s3 = boto3.client("s3")
    for name in objectstore.list_sizes(pushed):
        if name != first["name"]:
            s3.copy_object(Bucket=S3_BUCKET, Key=f"one-shard-gone/{name}",
                           CopySource=f"{S3_BUCKET}/sample/{name}")  # fmt: skip
    loader = make_loader(copy, DataConfig(batch_frames=3000, num_workers=0, on_error="skip"))
    keys = {key for _, batch in zip(range(30), loader, strict=False) for key in batch.keys}
    assert list(loader.skipped_shards) == [first["name"]]
    assert len(keys) == index["totals"]["utterances"] - first["samples"]
    with pytest.raises(ShardError, match=rf"{copy}/{first['name']}: cannot read shard .*no such"):
        strict = make_loader(copy, DataConfig(batch_frames=3000, num_workers=0, on_error="raise"))
        for _, _batch in zip(range(30), strict, strict=False):
            pass  # until the worker meets the missing shard


def bench_rows(module: str, *args: str) -> dict[str, dict]:
    """``python -m benchmarks.ROOM.MODULE ARGS`` (``module``: ``ROOM.MODULE``): its JSON rows by name."""
    command = [sys.executable, "-m", f"benchmarks.{module}", *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {row["row"]: row for row in map(json.loads, done.stdout.splitlines())}


@pytest.mark.slow  # a moto server, three clients; then a build, a push and four loaders
def test_the_store_benchmarks_print_their_rows_side_by_side() -> None:
    clients = bench_rows("store.s3_clients", "--reads", "40", "--rounds", "1")
    assert all(clients[name]["reads_per_s"] > 0 for name in ("boto3", "obstore", "s3fs"))
    assert clients["ratio"]["boto3_over_boto3"] == 1.0
    faults = bench_rows("store.s3_faults", "--batches", "20", "--rounds", "1", "--workers", "2")
    assert faults["ratio"]["same_batches"] is True
    assert faults["loader through the proxy, faults"]["samples_per_s"] > 0


def store_build(location: str, config: Path, staging: Path, *extra: str) -> list[str]:
    """``build`` of the sample corpus into ``location``, staged in ``staging``, one worker."""
    command = [sys.executable, "-m", "preprocess", "build", "--src", str(SAMPLE_CORPUS)]
    command += ["--out", location, "--config", str(config), "--workers", "1"]
    return [*command, "--staging", str(staging), *extra]


def test_a_parts_scan_goes_up_with_its_meta_last(
    endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another part counts a scan as finished once its meta.json is in the store and then
    reads every piece: so the meta goes last (sorted by name it went first, and a part of
    a two-part build read a piece not yet there)."""
    scan = tmp_path / ".build" / "scan-2" / "part-0"
    for name in ("meta.json", "piece-0/ordinal.npy", "piece-1/paths.npy", "stamps.json"):
        (scan / name).parent.mkdir(parents=True, exist_ok=True)
        (scan / name).write_text(name)
    store = StoreOut(f"s3://{S3_BUCKET}/meta-last", tmp_path)
    sent: list[str] = []
    monkeypatch.setattr(store, "_publish", lambda name, size: sent.append(name))
    store.push_folder(scan)
    assert len(sent) == 4 and sent[-1].endswith("part-0/meta.json"), sent


@pytest.mark.slow  # four build processes against the moto server
def test_two_parts_into_the_store_one_killed_and_rerun_make_the_local_builds_objects(
    endpoint: str, sample_cache: Path, small_shards_config: Path, tmp_path: Path
) -> None:
    location = f"s3://{S3_BUCKET}/built"
    part = {k: store_build(location, small_shards_config, tmp_path / f"staging-{k}",
                           "--part", f"{k}/2") for k in (0, 1)}  # fmt: skip
    with (
        started(part[0], tmp_path / "part0.log") as first,
        started(part[1], tmp_path / "part1.log") as second,
    ):
        assert wait_for(lambda: receipts(tmp_path / "staging-0") >= 1, first, 240)
        assert first.poll() is None  # killed mid-build: a shard written, others to come
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        rerun = run_ok(part[0])
        assert second.wait(timeout=300) == 0
    again = run_ok(part[1])  # a part that finds the cache complete: the index is there
    logs = [(tmp_path / "part1.log").read_text(), rerun.stderr, again.stderr]
    assert sum(log.count("wrote index.json") for log in logs) == 1, logs
    assert "index.json was already written, with these bytes" in again.stderr
    # Every object but the build's shared state is the local build's file, byte for byte.
    same_objects(location, sample_cache)
    listed = boto3.client("s3").list_objects_v2(Bucket=S3_BUCKET, Prefix="built/")["Contents"]
    written = {o["Key"].removeprefix("built/"): o["LastModified"] for o in listed}
    assert written[INDEX_NAME] == max(written.values())  # the index last
    with pytest.raises(FileExistsError):  # and once: a second index is refused
        objectstore.put_object(f"{location}/{INDEX_NAME}", b"{}", if_absent=True)
    assert (
        objectstore.read_object(f"{location}/{INDEX_NAME}")
        == (sample_cache / INDEX_NAME).read_bytes()
    )
    assert run_preprocess("verify", location).stdout.strip().endswith(f"{location}: OK")
    assert_same(batches(location, 24), batches(sample_cache, 24))


def same_objects(location: str, cache: Path) -> None:
    """Every object under ``location`` but the build's shared state is ``cache``'s file."""
    objects = sorted(
        name for name in objectstore.list_sizes(location) if not name.startswith(".build/")
    )
    assert objects == sorted([*cache_files(cache), INDEX_NAME])
    for name in objects:
        assert objectstore.read_object(f"{location}/{name}") == (cache / name).read_bytes()


@pytest.mark.slow  # a two-rank torchrun build
def test_torchrun_ranks_sharing_one_staging_folder_build_the_local_builds_objects(
    endpoint: str, sample_cache: Path, small_shards_config: Path, tmp_path: Path
) -> None:
    location = f"s3://{S3_BUCKET}/ranks"
    command = store_build(location, small_shards_config, tmp_path / "staging")
    done = run_ok(torchrun(*command[1:]))  # [python] -m preprocess build …
    assert "part 1/2 done" in done.stderr and done.stderr.count("wrote index.json") == 1
    assert f"into {location} (staged in {tmp_path / 'staging'})" in done.stderr  # first line
    same_objects(location, sample_cache)


def test_the_default_staging_folder_is_named_after_the_destination(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what $TMPDIR sets
    staging = default_staging("s3://caches/a/b")
    assert staging.parent == tmp_path and "caches-a-b" in staging.name
    assert staging == default_staging("s3://caches/a/b") != default_staging("s3://caches/a-b")


def test_a_conditional_put_writes_once(endpoint: str) -> None:
    location = f"s3://{S3_BUCKET}/once/index.json"
    objectstore.put_object(location, b"first", if_absent=True)
    with pytest.raises(FileExistsError, match="already there"):
        objectstore.put_object(location, b"second", if_absent=True)
    assert objectstore.read_object(location) == b"first"


@pytest.mark.slow  # three build processes
def test_a_build_into_a_wrong_bucket_without_credentials_or_server_is_one_line(
    endpoint: str, small_shards_config: Path, tmp_path: Path
) -> None:
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    build = store_build("s3://nowhere/x", small_shards_config, tmp_path / "staging")[3:]
    assert "no bucket 'nowhere'" in one_line_error(*build, env=env)
    bare = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    bare |= {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
             "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    build = store_build(f"s3://{S3_BUCKET}/x", small_shards_config, tmp_path / "staging")[3:]
    assert "no S3 credentials" in one_line_error(*build, env=bare)
    closed = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    assert "giving up after" in one_line_error(*build, env=closed)


def test_store_urls_with_dot_dot_or_empty_segments_are_refused_in_one_line() -> None:
    """A store keeps ``..`` as part of a key (``s3://b/../x`` was sent as ``../x/index.json``):
    refused before any request, by every command that takes a location (no server here)."""
    from melcache.remote.objectstore import split

    for bad, what in [("s3://b/../x", "'..'"), ("s3://b/a/./x", "'.'"), ("s3://b//x", "empty"),
                      ("s3://../x", "'..'")]:  # fmt: skip
        with pytest.raises(UserError, match=rf"^{bad}: an? {what} path segment"):
            split(bad)
    assert split("s3://b/a/cache/") == ("b", "a/cache/")  # a trailing slash is fine
    line = one_line_error("verify", "s3://b/../x", env=dict(os.environ))
    assert "'..' path segment" in line and "s3://b/../x" in line


@pytest.mark.slow  # subprocesses against a real S3 server, as GCS's interoperability API
def test_gs_caches_go_through_the_store_client_with_its_deadlines(
    pushed: str, endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gs://`` went through webdataset's ``gsutil cat`` pipe: 615 s without network, deaf to
    SIGTERM, then a traceback. Now it is the store client's, at GCS's S3-compatible endpoint
    (here the moto server standing in for it)."""
    gs = pushed.replace("s3://", "gs://")
    env = {**os.environ, **CREDENTIALS, "MELCACHE_GS_ENDPOINT": endpoint}
    env.pop("AWS_ENDPOINT_URL", None)  # gs:// has its own endpoint
    done = subprocess.run([sys.executable, "-m", "preprocess", "verify", gs], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and f"{gs}: OK" in done.stdout, done.stdout + done.stderr
    monkeypatch.setenv("MELCACHE_GS_ENDPOINT", endpoint)
    with melcache.open(gs) as cache, melcache.open(pushed) as same:
        assert np.array_equal(cache[3].mel, same[3].mel)  # random access, one ranged read
    closed = {**env, "MELCACHE_GS_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    for command in ("verify", "inspect"):
        began = time.monotonic()
        assert "giving up after" in one_line_error(command, gs, env=closed)
        assert time.monotonic() - began < 30
    train = [sys.executable, "-m", "train", "--shards", gs, "--config", "tiny", "--out",
             str(tmp_path / "run")]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(train, cwd=REPO, env=closed, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.strip().splitlines() if "Traceback" not in line]
    assert done.returncode == 2 and "giving up after" in lines[-1], done.stderr[-2000:]
    assert time.monotonic() - began < 30
    with subprocess.Popen([sys.executable, "-m", "preprocess", "verify", gs], cwd=REPO, env=closed,
                          stderr=subprocess.PIPE) as proc:  # fmt: skip
        time.sleep(3)  # inside its retries
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - sent < 5, "a process asked to stop stops within seconds"
