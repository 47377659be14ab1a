"""The streaming loader over caches made by the real build: coverage, budget, resume, faults."""

from __future__ import annotations

import contextlib
import dataclasses
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
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, group_gone, recorded

import melcache.loader.batch
import melcache.loader.shard_reads
import melcache.loader.stream
from melcache.access import Cache
from melcache.batch_plans import make_rng, plan_batches, round_up, worker_shards
from melcache.errors import ShardError, UserError
from melcache.features import FeatureConfig
from melcache.format import (
    INDEX_NAME,
    decode_mel_npy,
    decode_meta,
    encode_sample,
    fast_decode_mel,
    group_samples,
    iter_members,
    open_tar_writer,
    tar_members,
)
from melcache.loader import Batch, DataConfig, StreamLoader, make_loader
from melcache.loader.transport import BatchRing

TENSORS = ("mel", "mel_lengths", "text", "text_lengths")


# --- helpers ----------------------------------------------------------------------------------


def take(loader: Iterable[Batch], count: int) -> list[Batch]:
    return [batch for _, batch in zip(range(count), loader, strict=False)]


def assert_same(got: list[Batch], want: list[Batch]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys == b.keys, f"batch {i}"
        assert a.speaker == b.speaker, f"batch {i}"
        for name in TENSORS:
            assert torch.equal(getattr(a, name), getattr(b, name)), f"batch {i} {name}"


def epoch_keys(loader: StreamLoader, epoch: int) -> list[str]:
    """Keys of the batches of ``epoch`` (of their worker's sub-stream) from a fresh loader.

    The position a batch moves (worker, sub-stream) names where it comes from; the epoch is
    the loader's progress before it in a whole-cache stream, and in a bucket sub-stream the
    epoch of the batch number it took (a skipped shard may move a worker past an epoch's end).
    """
    keys: list[str] = []
    stream = iter(loader)
    for _ in range(10_000):  # a bound, so that a bug fails instead of hanging
        if loader.epoch > epoch:
            loader.close()
            return keys
        worker, before = loader.state_dict()["next_worker"], loader.progress()
        positions = loader.state_dict()["positions"][worker]
        batch = next(stream)
        (moved,) = [
            u for u, p in enumerate(loader.state_dict()["positions"][worker]) if p != positions[u]
        ]
        sub, spec = loader.spec.subs[moved], loader.spec
        if sub.bucket < 0:
            batch_epoch = int(before[worker][moved])
        else:
            taken = loader.state_dict()["positions"][worker][moved][0] - 1
            slot = spec.rank * spec.workers_per_rank + worker
            number = spec.deal(moved).number(sub, slot=slot, num_slots=spec.num_slots, taken=taken)
            batch_epoch = number // sub.per_epoch
        if batch_epoch == epoch:
            keys.extend(batch.keys)
    raise AssertionError(f"epoch {epoch} did not end within 10,000 batches")


def index_of(cache: Path) -> dict:
    return json.loads((cache / INDEX_NAME).read_text())


def all_keys(cache: Path) -> dict[str, dict]:
    """Every utterance's metadata by key, read with melcache.format's general reader."""
    out = {}
    for entry in index_of(cache)["shards"]:
        with open(cache / entry["name"], "rb") as stream:
            for sample in group_samples(iter_members(stream, entry["name"]), entry["name"]):
                out[sample["__key__"]] = decode_meta(sample["json"], entry["name"])
    return out


@pytest.fixture
def cache_copy(sample_cache: Path, tmp_path: Path) -> Path:
    """A private copy of the sample cache, to damage."""
    return Path(shutil.copytree(sample_cache, tmp_path / "cache"))


def loader(cache: Path | str, **kwargs) -> StreamLoader:
    """``make_loader`` with small test defaults; ``[data]`` keys go into its DataConfig.

    The whole-cache stream (``sync_buckets = false``) by default: the tests here pin the
    stream of earlier releases, which it must keep giving; those of bucket sub-streams pass
    ``sync_buckets=True`` (and tests/test_schedule.py).
    """
    options = {"batch_frames": 3000, "max_batch_size": 3, "num_workers": 0, "seed": 1,
               "sync_buckets": False, **kwargs}  # fmt: skip
    data_keys = {f.name for f in dataclasses.fields(DataConfig)} - {"tokenizer"}  # a callable
    data = DataConfig(**{k: v for k, v in options.items() if k in data_keys})
    return make_loader(cache, data, **{k: v for k, v in options.items() if k not in data_keys})


# --- pure planning ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch_frames, max_batch_size", [(1000, 64), (4000, 5), (20_000, 64)])
def test_plan_batches_keeps_budget_and_takes_every_sample(batch_frames, max_batch_size) -> None:
    frames = np.random.default_rng(0).integers(30, 900, size=500).tolist()
    batches = plan_batches(
        frames,
        rng=make_rng(0, 1),
        batch_frames=batch_frames,
        max_batch_size=max_batch_size,
        pad_multiple=8,
    )
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        assert len(b) <= max_batch_size
        assert len(b) * round_up(max(frames[i] for i in b), 8) <= batch_frames


def test_plan_batches_pads_little_and_reshuffles_every_epoch() -> None:
    # One shard of one length bucket (4.0-5.5 s), as a large cache has them.
    frames = np.random.default_rng(1).integers(375, 516, size=1500).tolist()
    plans = [
        plan_batches(frames, rng=make_rng(0, 2, epoch, 7), batch_frames=20_000,
                     max_batch_size=64, pad_multiple=8)
        for epoch in range(2)
    ]  # fmt: skip
    for plan in plans:
        real = sum(frames)
        padded = sum(len(b) * round_up(max(frames[i] for i in b), 8) for b in plan)
        assert 1 - real / padded < 0.02
    groups = [{frozenset(b) for b in plan} for plan in plans]
    assert len(groups[0] & groups[1]) < len(groups[0]) / 10  # composition changes
    assert plans[0] == plan_batches(frames, rng=make_rng(0, 2, 0, 7), batch_frames=20_000,
                                    max_batch_size=64, pad_multiple=8)  # fmt: skip


def test_worker_shards_split_each_epoch_disjointly() -> None:
    for epoch in range(3):
        lists = [worker_shards(10, seed=5, epoch=epoch, slot=s, num_slots=4) for s in range(4)]
        assert sorted(i for lst in lists for i in lst) == list(range(10))
    orders = [worker_shards(10, seed=5, epoch=e, slot=0, num_slots=1) for e in range(3)]
    assert orders[0] != orders[1] != orders[2]


# --- the stream -------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [False, True])
def test_every_utterance_once_per_epoch_two_ranks_two_workers(
    sample_cache: Path, sync: bool
) -> None:
    """Synced, the 4 slots share each bucket's 2 shards."""
    utterances = set(all_keys(sample_cache))
    for epoch in (0, 1):
        seen = Counter()
        for rank in range(2):
            stream = loader(sample_cache, rank=rank, world_size=2, num_workers=2, sync_buckets=sync)
            seen.update(epoch_keys(stream, epoch))
        assert set(seen) == utterances
        assert set(seen.values()) == {1}


def test_batches_keep_the_budget_within_one_bucket(sample_cache: Path) -> None:
    meta = all_keys(sample_cache)
    buckets = {b["bucket"]: b for b in index_of(sample_cache)["buckets"]}
    stream = loader(sample_cache, batch_frames=1200, max_batch_size=3, num_workers=2)
    for batch in take(stream, 40):
        size, length, n_mels = batch.mel.shape
        assert size <= 3 and size * length <= 1200 and length % 8 == 0 and n_mels == 100
        (bucket,) = {meta[k]["bucket"] for k in batch.keys}
        # Padding is bounded by the bucket's spread (plus rounding up to 8 frames).
        worst = 1 - buckets[bucket]["min_frames"] / round_up(buckets[bucket]["max_frames"], 8)
        assert 1 - batch.mel_lengths.sum().item() / (size * length) <= worst
    stream.close()


def test_batch_holds_the_utterances(sample_cache: Path) -> None:
    meta = all_keys(sample_cache)
    stream = loader(sample_cache)
    batch = next(iter(stream))
    assert batch.mel.dtype == torch.float16 and batch.text.dtype == torch.int64
    assert batch.mel_lengths.dtype == batch.text_lengths.dtype == torch.int64
    floor = np.float16(np.log(stream.features.log_floor))
    for row, key in enumerate(batch.keys):
        frames, text = meta[key]["frames"], meta[key]["text"]
        assert batch.mel_lengths[row] == frames
        assert (batch.mel[row, frames:] == torch.tensor(floor)).all()  # padding is silence
        ids = batch.text[row, : batch.text_lengths[row]]
        assert bytes((ids - 1).tolist()).decode("utf-8") == text  # bytes + 1, 0 = pad
        assert (batch.text[row, batch.text_lengths[row] :] == 0).all()
        assert batch.speaker[row] == meta[key]["speaker"]
    moved = batch.to("cpu")
    assert torch.equal(moved.mel, batch.mel) and moved.keys == batch.keys
    if torch.cuda.is_available():
        assert batch.pin_memory().mel.is_pinned()
    assert stream.features == FeatureConfig()
    assert stream.index["shards"]
    stream.close()


def test_global_torch_rng_is_left_alone(sample_cache: Path) -> None:
    before = torch.random.get_rng_state()
    take(loader(sample_cache, num_workers=2), 3)
    assert torch.equal(before, torch.random.get_rng_state())


def test_custom_tokenizer(sample_cache: Path) -> None:
    stream = loader(sample_cache, tokenizer=lambda text: [len(text)])
    batch = next(iter(stream))
    assert batch.text.shape[1] == 8 and (batch.text_lengths == 1).all()  # padded to 8
    stream.close()


def test_every_batch_is_aligned_for_the_attention_mask(sample_cache: Path) -> None:
    """Text and mel each padded to pad_multiple: text + mel, the attention mask's side, too."""
    for pad_multiple in (8, 5):
        stream = loader(sample_cache, num_workers=2, pad_multiple=pad_multiple)
        for batch in take(stream, 30):
            assert batch.mel.shape[1] % pad_multiple == 0
            assert batch.text.shape[1] % pad_multiple == 0
            assert batch.text.shape[1] - int(batch.text_lengths.max()) < pad_multiple
        stream.close()


def test_url_prefix_gives_the_same_stream(sample_cache: Path) -> None:
    local = take(loader(sample_cache), 12)
    assert_same(take(loader(f"pipe:cat {sample_cache}"), 12), local)


def test_ring_hands_over_copies_and_catches_an_overrun() -> None:
    ring = BatchRing(2, 12)
    ring.slot(0, (1, 3, 4))[:] = 1.0
    ring.publish(0)
    first = ring.take(0, (1, 3, 4), pin_memory=False)
    ring.slot(2, (1, 3, 4))[:] = 2.0  # same slot, next lap: the copy taken is unaffected
    ring.publish(2)
    assert (first == 1.0).all()
    with pytest.raises(RuntimeError, match="ran ahead"):
        ring.take(0, (1, 3, 4), pin_memory=False)


# --- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [False, True])
def test_resume_continues_with_exactly_the_next_batches(
    sample_cache: Path, tmp_path: Path, sync: bool
) -> None:
    options = {"num_workers": 2, "batch_frames": 1500, "max_batch_size": 2, "seed": 7,
               "sync_buckets": sync}  # fmt: skip
    reference = loader(sample_cache, **options)
    stream = iter(reference)
    batches, states, epochs = [], [], []
    for _ in range(44):  # about three epochs of this cache per worker
        state = reference.state_dict()
        states.append(state)
        epochs.append([int(e) for worker in reference.progress() for e in worker])
        batches.append(next(stream))
    reference.close()
    # A worker's epoch of a sub-stream ends (one of a few batches may begin in epoch 1: its
    # slot has none in epoch 0)
    rollover = next(i for i, e in enumerate(epochs) if e != epochs[0])
    assert 0 < rollover < 40
    for cut in sorted({0, 1, 5, rollover - 1, rollover, rollover + 1, 39}):
        path = tmp_path / f"state{cut}.pt"
        torch.save(states[cut], path)
        resumed = loader(sample_cache, **options)
        resumed.load_state_dict(torch.load(path, weights_only=True))
        assert_same(take(resumed, 44 - cut), batches[cut:])
        resumed.close()


@pytest.mark.parametrize("sync", [False, True])
def test_resume_reads_only_the_partial_shard(sample_cache: Path, monkeypatch, sync: bool) -> None:
    reads, decodes = [], []
    real_read, real_decode = (
        melcache.loader.shard_reads.read_shard,
        melcache.loader.batch.decode_mel_into,
    )
    monkeypatch.setattr(
        melcache.loader.shard_reads,
        "read_shard",
        lambda *a, **k: reads.append(a[0]) or real_read(*a, **k),
    )
    monkeypatch.setattr(
        melcache.loader.batch, "decode_mel_into", lambda *a: decodes.append(1) or real_decode(*a)
    )
    real_rows = Cache.raw_rows  # a slot resumed near a unit's end reads the rest by range
    monkeypatch.setattr(Cache, "raw_rows", lambda c, rows: reads.append(rows) or real_rows(c, rows))
    options = {"batch_frames": 1000, "max_batch_size": 1, "sync_buckets": sync}
    for cut in (2, 25):  # early and late in the first epoch (30 one-sample batches)
        first = loader(sample_cache, **options)
        stream = iter(first)
        take(stream, cut)
        state = first.state_dict()
        expected = next(stream)
        first.close()
        reads.clear()
        decodes.clear()
        resumed = loader(sample_cache, **options)
        resumed.load_state_dict(state)
        assert_same(take(resumed, 1), [expected])
        assert len(reads) == 1 and len(decodes) == 1
        resumed.close()


def test_restore_refuses_a_different_layout(sample_cache: Path) -> None:
    source = loader(sample_cache, num_workers=2, world_size=2)
    take(source, 3)
    state = source.state_dict()
    source.close()
    for changed, key in [
        ({"world_size": 1}, "world_size"),
        ({"num_workers": 1}, r"data\.num_workers \(workers per rank\) = 2"),
        ({"seed": 2}, "seed"),
        ({"batch_frames": 4000}, "batch_frames"),
        ({"attention_frames": 3000}, r"data\.attention_frames = 3072 .* 3000"),
    ]:
        options = {"num_workers": 2, "world_size": 2, **changed}
        with pytest.raises(UserError, match=key):
            loader(sample_cache, **options).load_state_dict(state)


# --- faults and safety ------------------------------------------------------------------------


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
    done = subprocess.run(
        [sys.executable, "-c", DROPPED_LOADERS, str(sample_cache)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
