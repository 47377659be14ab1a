"""The streaming loader's faults and safety over copies of the sample cache: damaged,
missing and hostile shards, dropped loaders and dead parents, refused layouts."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from melcache.batch_plans import round_up
from melcache.errors import ShardError, UserError
from melcache.features import FeatureConfig
from melcache.format import INDEX_NAME, decode_mel_npy, encode_sample, fast_decode_mel
from melcache.tar.reader import group_samples, iter_members, tar_members
from melcache.tar.writer import open_tar_writer
from tests.support.helpers import REPO, group_gone, recorded
from tests.support.loaders import all_keys, epoch_keys, index_of, loader, run_script, take


def biggest_shard(cache: Path) -> str:
    return max(index_of(cache)["shards"], key=lambda s: s["samples"])["name"]


def keys_of_shard(cache: Path, name: str) -> set[str]:
    with open(cache / name, "rb") as stream:
        return {s["__key__"] for s in group_samples(iter_members(stream, name), name)}


@pytest.mark.parametrize("sync", [False, True])
def test_truncated_shard_is_skipped_or_raises(cache_copy: Path, sync: bool) -> None:
    name = biggest_shard(cache_copy)
    lost = keys_of_shard(cache_copy, name)
    shard = cache_copy / name
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    skipping = loader(cache_copy, on_error="skip", num_workers=2, sync_buckets=sync)
    seen = Counter(epoch_keys(skipping, 0))
    assert set(seen) == set(all_keys_except(cache_copy, name)) and set(seen.values()) == {1}
    assert not lost & set(seen)
    assert list(skipping.skipped_shards) == [name]

    with pytest.raises(ShardError, match=name):
        take(loader(cache_copy, on_error="raise", num_workers=2, sync_buckets=sync), 30)


def all_keys_except(cache: Path, broken: str) -> list[str]:
    keys = []
    for entry in index_of(cache)["shards"]:
        if entry["name"] != broken:
            keys.extend(keys_of_shard(cache, entry["name"]))
    return keys


def test_missing_shards_are_counted_and_never_hang(cache_copy: Path) -> None:
    names = [s["name"] for s in index_of(cache_copy)["shards"]]
    (cache_copy / names[0]).unlink()
    stream = loader(cache_copy, on_error="skip")
    take(stream, 30)
    assert list(stream.skipped_shards) == [names[0]]
    for name in names[1:]:
        (cache_copy / name).unlink()
    with pytest.raises(ShardError, match="failed"):  # every shard gone: an error, not a hang
        take(loader(cache_copy, on_error="skip"), 1)


def test_digest_is_checked_unless_switched_off(cache_copy: Path) -> None:
    name = biggest_shard(cache_copy)
    shard = cache_copy / name
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF  # inside the first mel's data: still a readable tar
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"{name}: xxh3_128 differs"):
        take(loader(cache_copy), 30)
    with pytest.raises(ShardError, match=f"{name}: sha256 differs"):
        take(loader(cache_copy, shard_check="sha256"), 30)
    checked = loader(cache_copy, on_error="skip")
    take(checked, 30)
    assert list(checked.skipped_shards) == [name]
    take(loader(cache_copy, shard_check="off"), 30)  # the opt-out reads it as it is


def test_reader_checks_stand_without_the_index_size_and_digests(cache_copy: Path) -> None:
    """An index without ``bytes`` or digests (hand-made): the tar reader still catches a cut."""
    name = biggest_shard(cache_copy)
    index = index_of(cache_copy)
    for entry in index["shards"]:
        del entry["bytes"], entry["sha256"], entry["xxh3_128"]
    (cache_copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ShardError, match="gives no sha256"):
        take(loader(cache_copy), 30)
    shard = cache_copy / name
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ShardError, match=f"{name}: (not a readable tar|holds)"):
        take(loader(cache_copy, shard_check="off"), 30)


class _Planted:
    """Creates ``path`` if it is ever unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_pickle_members_are_never_unpickled(cache_copy: Path) -> None:
    marker = cache_copy.parent / "unpickled"
    name = biggest_shard(cache_copy)
    with open(cache_copy / name, "rb") as stream:
        samples = list(group_samples(iter_members(stream, name), name))
    buffer = io.BytesIO()
    writer = open_tar_writer(buffer)
    for i, sample in enumerate(samples):
        sample["pickle"] = pickle.dumps(_Planted(marker))
        if i == 0:  # and one mel.npy that is an object array holding a pickle
            npy = io.BytesIO()
            np.save(npy, np.array([_Planted(marker)], dtype=object), allow_pickle=True)
            sample["mel.npy"] = npy.getvalue()
        writer.write(sample)
    writer.close()
    (cache_copy / name).write_bytes(buffer.getvalue())
    # The planter also rewrites the index, so size and digests agree and the parser must refuse.
    index = index_of(cache_copy)
    next(s for s in index["shards"] if s["name"] == name).update(recorded(buffer.getvalue()))
    (cache_copy / INDEX_NAME).write_text(json.dumps(index))

    with pytest.raises(ShardError, match=r"mel\.npy"):
        take(loader(cache_copy, num_workers=2), 30)
    skipping = loader(cache_copy, on_error="skip")
    take(skipping, 30)
    assert list(skipping.skipped_shards) == [name]
    assert not marker.exists()


def test_fast_paths_match_the_format_module(sample_cache: Path) -> None:
    name = biggest_shard(sample_cache)
    data = (sample_cache / name).read_bytes()
    fast = [(k, m, bytes(d)) for k, m, d in tar_members(data, name)]
    assert fast == list(iter_members(io.BytesIO(data), name))
    for key, member, payload in fast:
        if member == "mel.npy":
            assert np.array_equal(
                fast_decode_mel(payload, 100, key), decode_mel_npy(payload, 100, key)
            )
    # A key that needs a pax header takes iter_members' path, with the same result.
    buffer = io.BytesIO()
    writer = open_tar_writer(buffer)
    writer.write(encode_sample("ü" * 120, np.zeros((3, 100)), {"frames": 3}))
    writer.close()
    members = list(tar_members(buffer.getvalue(), "pax"))
    assert [(k, m) for k, m, _ in members] == [("ü" * 120, "json"), ("ü" * 120, "mel.npy")]


def test_cache_with_other_features_is_refused(sample_cache: Path) -> None:
    with pytest.raises(UserError, match=r"features\.n_mels = 100.*80"):
        loader(sample_cache, expect_features={"n_mels": 80})
    with pytest.raises(UserError, match="sample_rate"):
        loader(sample_cache, expect_features=FeatureConfig(sample_rate=22050, f_max=8000.0))
    with pytest.raises(UserError, match="nmels"):
        loader(sample_cache, expect_features={"nmels": 100})
    loader(sample_cache, expect_features=FeatureConfig())  # the same config is fine


def test_bad_layouts_and_arguments_are_refused(sample_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="fewer than world_size × workers"):
        loader(sample_cache, world_size=4, num_workers=4)
    with pytest.raises(UserError, match="batch_frames"):
        loader(sample_cache, batch_frames=100)
    with pytest.raises(UserError, match="on_error"):
        loader(sample_cache, on_error="ignore")
    with pytest.raises(UserError, match="rank"):
        loader(sample_cache, rank=2, world_size=2)
    with pytest.raises(UserError, match="index"):
        loader(tmp_path)


def test_a_dropped_loader_stops_its_workers(sample_cache: Path) -> None:
    """Evaluation code makes a loader, takes a batch and returns without close()."""
    before = {p.pid for p in multiprocessing.active_children()}

    def peek() -> int:
        stream = loader(sample_cache, num_workers=2)
        return len(next(iter(stream)))

    assert peek() > 0
    assert {p.pid for p in multiprocessing.active_children()} == before


DROPPED_LOADERS = """
import sys
from melcache.loader import DataConfig, make_loader

def peek(cache):
    loader = make_loader(cache, DataConfig(num_workers=2, batch_frames=3000))
    batches = iter(loader)
    for _ in range(20):
        next(batches)

for _ in range(4):
    peek(sys.argv[1])
print("done")
"""


@pytest.mark.slow  # a subprocess: what its forked workers print must be seen
def test_dropped_loaders_never_shut_down_inside_a_child(sample_cache: Path) -> None:
    done = run_script(DROPPED_LOADERS, str(sample_cache), timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_too_little_shared_memory_is_one_clear_error(
    sample_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Docker's default /dev/shm is 64 MB: refuse at start, naming the fix."""
    usage = shutil.disk_usage("/tmp")._replace(free=32 * 2**20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    with pytest.raises(UserError, match=r"needs 92 MiB .* 32 MiB free.*--shm-size"):
        loader(sample_cache, num_workers=2, batch_frames=40_000, max_batch_size=64)
    loader(sample_cache, num_workers=2).close()  # 3000 frames: 7 MiB fit
    # 40,000 frames, but 3 utterances per batch at most: the rings hold 3 of the longest.
    loader(sample_cache, num_workers=2, batch_frames=40_000).close()


def test_a_budget_table_gives_each_bucket_its_own_budget(sample_cache: Path) -> None:
    longest = {
        b: max(s["max_frames"] for s in index_of(sample_cache)["shards"] if s["bucket"] == b)
        for b in {s["bucket"] for s in index_of(sample_cache)["shards"]}
    }
    table = {str(b): 6 * round_up(frames, 8) for b, frames in longest.items()}
    table[str(max(longest))] = round_up(longest[max(longest)], 8)  # the longest: one at a time
    meta = all_keys(sample_cache)
    stream = loader(sample_cache, batch_frames=table, max_batch_size=64, num_workers=2)
    seen: dict[int, int] = {}
    for batch in take(stream, 40):
        (bucket,) = {meta[k]["bucket"] for k in batch.keys}
        assert batch.bucket == bucket
        assert batch.mel.shape[0] * batch.mel.shape[1] <= table[str(bucket)]
        seen[bucket] = max(seen.get(bucket, 0), len(batch))
    stream.close()
    assert seen[max(longest)] == 1 and max(seen.values()) > 1, seen
    state = loader(sample_cache, batch_frames=table, max_batch_size=64).state_dict()
    assert state["batch_frames"] == table
    # A changed table, or one number instead of it, is refused by name on restore.
    for changed in ({**table, "0": table["0"] + 8}, max(table.values())):
        with pytest.raises(UserError, match="batch_frames"):
            loader(sample_cache, batch_frames=changed, max_batch_size=64).load_state_dict(state)
    # Every bucket of the cache needs an entry, and no other; each must hold its longest.
    with pytest.raises(UserError, match=r"names buckets \[0, 1, 2\] but cache"):
        loader(sample_cache, batch_frames={k: v for k, v in table.items() if k != "3"})
    with pytest.raises(UserError, match=r"batch_frames\.0 = 8 is below .* bucket 0"):
        loader(sample_cache, batch_frames={**table, "0": 8})


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)
    # Should a read ever block on it again, open its other end in 20 s: the test then fails
    # on the message and the time, instead of hanging the suite.
    release = threading.Timer(20, lambda: os.close(os.open(path, os.O_RDWR)))
    release.daemon = True
    release.start()


NOT_A_FILE = {
    "FIFO": (_fifo, "is a FIFO"),
    "directory": (lambda p: (p.unlink(), p.mkdir()), "is a directory"),
    "/dev/zero": (lambda p: (p.unlink(), p.symlink_to("/dev/zero")), "is a character device"),
    "symlink loop": (lambda p: (p.unlink(), p.symlink_to(p)), "symbolic links"),
}


@pytest.mark.parametrize("case", NOT_A_FILE)
def test_a_shard_that_is_no_regular_file_is_refused_at_once(cache_copy: Path, case: str) -> None:
    """A FIFO in a shard's place once blocked a worker in open() forever."""
    make, reason = NOT_A_FILE[case]
    name = biggest_shard(cache_copy)
    make(cache_copy / name)
    for workers in (0, 2):  # met in this process, then in a DataLoader worker
        start = time.monotonic()
        with pytest.raises(ShardError) as failure:
            take(loader(cache_copy, on_error="raise", num_workers=workers), 100)
        assert time.monotonic() - start < 10
        # DataLoader puts the worker's traceback in the message; the CLI prints its last line.
        message = str(failure.value).splitlines()[-1]
        assert name in message and reason in message


ORPHAN_PROBE = """
import multiprocessing, pathlib, sys, time
import melcache.reader
from melcache.loader import DataConfig, make_loader

cache, fifo, blocked = sys.argv[1:]
real_read, reads = melcache.reader.read_bytes, []

def read_then_hang(location):
    # the worker's second shard hangs in open(), as a read from a dead mount would
    reads.append(location)
    if len(reads) > 1:
        pathlib.Path(blocked).touch()
        open(fifo).close()
    return real_read(location)

melcache.reader.read_bytes = read_then_hang  # inherited by the forked worker
# The whole-cache stream reads one shard per visit (a bucket's unit may be several, and its
# second read would then hang before the first batch).
loader = make_loader(cache, DataConfig(num_workers=1, batch_frames=3000, sync_buckets=False))
batches = iter(loader)  # held: a dropped iterator stops its workers
next(batches)
print(*(p.pid for p in multiprocessing.active_children()), flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a subprocess to kill
def test_a_loader_worker_dies_with_its_parent_wherever_it_is_blocked(
    sample_cache: Path, tmp_path: Path
) -> None:
    """A worker blocked where DataLoader's parent check never runs (in open() of a FIFO)
    once stayed behind, orphaned, after its rank was killed."""
    fifo, blocked = tmp_path / "fifo", tmp_path / "blocked"
    os.mkfifo(fifo)
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_PROBE, str(sample_cache), str(fifo), str(blocked)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = None
    try:
        (worker,) = map(int, parent.stdout.readline().split())
        deadline = time.monotonic() + 30
        while not blocked.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert blocked.exists(), "the worker never reached its second shard"
        parent.kill()
        parent.wait()
        assert group_gone(worker, timeout=10), f"loader worker {worker} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_import_melcache_stays_free_of_torch() -> None:
    """``import melcache`` alone stays free of torch (a build host or a notebook needs no
    trainer)."""
    code = "import sys, melcache; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr
