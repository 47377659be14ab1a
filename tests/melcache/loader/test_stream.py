"""The streaming loader over caches made by the real build: planning, coverage, budget, resume
(its faults: test_faults.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import melcache.loader.batch
import melcache.loader.reads.shards
import melcache.loader.stream
from melcache.access import Cache
from melcache.batch_plans import make_rng, plan_batches, round_up, worker_shards
from melcache.errors import UserError
from melcache.features import FeatureConfig
from melcache.loader.transport import BatchRing
from tests.support.loaders import all_keys, assert_same, epoch_keys, index_of, loader, take

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
        melcache.loader.reads.shards.read_shard,
        melcache.loader.batch.decode_mel_into,
    )
    monkeypatch.setattr(
        melcache.loader.reads.shards,
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
