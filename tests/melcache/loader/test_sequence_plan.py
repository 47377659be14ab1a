"""data.sequence (#52): a model whose sequence is text then frames gets batches, counts and
budgets planned on ``text + frames``; a model of frames plans exactly as before. Real loaders
over the real sample cache; the text lengths' sidecar counted once, read and checked after."""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from melcache.access import Cache
from melcache.batch_plans import round_up
from melcache.errors import UserError
from melcache.loader import DataConfig, make_loader
from melcache.loader.batch import utf8_tokens
from melcache.loader.resume.state import LoaderStateError
from melcache.loader.sequence import sidecar_folder
from melcache.loader.stream import planned_stream
from tests.support.helpers import run_preprocess

TEXT = {"sequence": "text+frames"}
ONE_RANGE = {"sync_split": 1}  # a sub-stream a bucket: epochs counted by bucket
SETTINGS = (
    {"batch_frames": 3000, "max_batch_size": 8},
    {"batch_frames": 2000, "max_batch_size": 3, "sync_split": 2, "attention_frames": 400},
    {"batch_frames": 3000, "max_batch_size": 8, "sync_buckets": False},
)


def plan_digest(cache) -> str:
    """The keys of the first 30 planned batches of every worker of every rank, at 1 and 3
    ranks, 0 and 2 workers, under each of SETTINGS."""
    digest = hashlib.sha256()
    for setting, world, workers in itertools.product(SETTINGS, (1, 3), (0, 2)):
        if not setting.get("sync_buckets", True) and world * max(1, workers) > 10:
            continue  # the whole-cache stream needs a shard per slot
        data = DataConfig(**setting, num_workers=workers)
        for rank in range(world):
            spec = make_loader(cache, data, rank=rank, world_size=world, seed=7).spec
            for worker in range(max(1, workers)):
                for planned in itertools.islice(planned_stream(spec, worker), 30):
                    digest.update(repr([s.key for s in planned[2]]).encode())
    return digest.hexdigest()[:32]


# plan_digest of the sample cache computed by main at 086de34, before data.sequence existed.
MAIN_DIGEST = "5a2b086ba23ab94dc8722df2010bee46"


def test_a_model_of_frames_plans_exactly_as_before(sample_cache: Path) -> None:
    assert plan_digest(sample_cache) == MAIN_DIGEST


def loader(cache: Path, rank: int = 0, world_size: int = 1, tokenizer=None, **data):
    options = DataConfig(**{"batch_frames": 1600, "max_batch_size": 6, "num_workers": 0, **data})
    return make_loader(
        cache, options, rank=rank, world_size=world_size, seed=3, tokenizer=tokenizer
    )


def doubled(text: str) -> np.ndarray:
    """Another tokenizer: every byte twice."""
    return np.repeat(utf8_tokens(text), 2)


@pytest.fixture
def sidecars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return sidecar_folder("")


def test_text_lengths_are_counted_once_then_read_and_checked(
    sample_cache: Path, sidecars: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    first = loader(sample_cache, **TEXT).spec.sources[0].text
    with Cache(sample_cache) as cache:
        expected = [len(utf8_tokens(u.text)) for u in cache]
    assert first.per_row.tolist() == expected
    (array,) = sidecars.glob("*.npy")

    def no_texts(*_):
        raise AssertionError("texts read again")

    with monkeypatch.context() as patched:
        patched.setattr(Cache, "texts", no_texts)
        assert loader(sample_cache, **TEXT).spec.sources[0].text.per_row.tolist() == expected
        with pytest.raises(AssertionError, match="texts read again"):
            loader(sample_cache, tokenizer=doubled, **TEXT)  # another tokenizer: counted anew
    damaged = np.load(array)
    damaged[0] += 1
    np.save(array, damaged)
    with caplog.at_level(logging.WARNING):
        assert loader(sample_cache, **TEXT).spec.sources[0].text.per_row.tolist() == expected
    assert "do not match this table: counting them again" in caplog.text
    assert np.load(array).tolist() == expected
    array.write_bytes(b"")  # as another process's write once left it, before writes were atomic
    with caplog.at_level(logging.WARNING):
        assert loader(sample_cache, **TEXT).spec.sources[0].text.per_row.tolist() == expected
    assert "unreadable (" in caplog.text
    assert np.load(array).tolist() == expected
    loader(sample_cache, tokenizer=doubled, **TEXT)
    assert len(list(sidecars.glob("*.npy"))) == 2  # one per tokenizer


def test_every_batch_fits_the_budget_in_text_plus_frames_and_an_epoch_reads_each_key_once(
    sample_cache: Path, sidecars: Path
) -> None:
    budget, pad = 1600, 8
    spec = loader(sample_cache, batch_frames=budget, **TEXT).spec
    seen = collections.Counter()
    epoch_batches = sum(sub.per_epoch for sub in spec.subs)
    planned = list(itertools.islice(planned_stream(spec, 0), 40 * epoch_batches))
    for _, _, samples, _, _ in planned:
        longest = max(s.frames + len(utf8_tokens(s.text)) for s in samples)
        assert len(samples) * round_up(longest, pad) <= budget
        seen.update(s.key for s in samples)
    with Cache(sample_cache) as cache:
        assert set(seen) == set(cache.keys())  # every key read, none lost
    frames = loader(sample_cache, batch_frames=budget).spec.subs
    counts = [sum(s.batches) for s in spec.subs]
    assert counts != [sum(s.batches) for s in frames]  # the counts follow text + frames


def test_a_balanced_stream_fits_the_budget_in_text_plus_frames(
    sample_cache: Path, sidecars: Path
) -> None:
    budget, pad = 1600, 8
    chosen = {"where": "frames > 100", "balance": {"speaker_temperature": 0.0}}
    spec = loader(sample_cache, batch_frames=budget, **TEXT, **chosen).spec
    seen = collections.Counter()
    for _, _, samples, _, _ in itertools.islice(planned_stream(spec, 0), 200):
        longest = max(s.frames + len(utf8_tokens(s.text)) for s in samples)
        assert len(samples) * round_up(longest, pad) <= budget
        seen.update(s.key for s in samples)
    with Cache(sample_cache) as cache:
        kept = {u.key for u in cache if u.frames > 100}
    # the filter holds (speakers evened: a few of the larger speakers' keys may go unheard)
    assert set(seen) <= kept and len(seen) > len(kept) // 2


def test_a_budget_below_the_longest_text_plus_frames_is_refused_by_name(
    sample_cache: Path, sidecars: Path
) -> None:
    longest = max(s["max_frames"] for s in loader(sample_cache).spec.sources[0].shards)
    loader(sample_cache, batch_frames=round_up(longest, 8))
    with pytest.raises(UserError, match=r"text \+ frames positions, over data.batch_frames"):
        loader(sample_cache, batch_frames=round_up(longest, 8), **TEXT)
    with pytest.raises(UserError, match=r"data\.sequence"):
        DataConfig(sequence="text+frames", sync_buckets=False)
    with pytest.raises(UserError, match=r"data\.sequence"):
        DataConfig(sequence="frames+text")


def keys(stream, steps: int) -> list[list[str]]:
    return [batch.keys for batch in itertools.islice(stream, steps)]


def test_a_state_resumes_batch_for_batch_and_is_refused_under_another_sequence(
    sample_cache: Path, sidecars: Path
) -> None:
    whole = keys(iter(loader(sample_cache, **TEXT)), 30)
    first = loader(sample_cache, **TEXT)
    assert keys(iter(first), 12) == whole[:12]
    state = first.state_dict()
    again = loader(sample_cache, **TEXT)
    again.load_state_dict(state)
    assert keys(iter(again), 18) == whole[12:]
    for other in (loader(sample_cache), loader(sample_cache, tokenizer=doubled, **TEXT)):
        with pytest.raises(LoaderStateError, match=r"data\.sequence"):
            other.load_state_dict(state)


def job(cache: Path, world_size: int, steps: int, states=None, sequence: str = "text+frames"):
    """``steps`` steps of a job of one-process ranks declaring ``sequence``: each
    sub-stream's keys in reading order, and the ranks' states after."""
    data = {"sequence": sequence, **ONE_RANGE}
    loaders = [loader(cache, r, world_size, **data) for r in range(world_size)]
    for each in loaders if states is not None else ():
        each.load_state_dict(states)
    streams = [iter(each) for each in loaders]
    read = collections.defaultdict(list)
    for _ in range(steps):
        for stream in streams:
            batch = next(stream)
            read[batch.bucket].extend(batch.keys)
    return read, [each.state_dict() for each in loaders]


def repeats_before_whole(read: dict[int, list[str]]) -> int:
    """Keys read again within a bucket before all of its keys had been read since the last
    time all were."""
    count = 0
    for bucket_keys in read.values():
        every, seen = set(bucket_keys), set()
        for key in bucket_keys:
            count += key in seen
            seen = set() if seen | {key} == every else seen | {key}
    return count


@pytest.mark.parametrize("world_size", [4, 2])
def test_4_ranks_resume_on_the_same_job_and_on_2_reading_each_epoch_whole(
    sample_cache: Path, sidecars: Path, world_size: int
) -> None:
    before, states = job(sample_cache, 4, 31)
    after, _ = job(sample_cache, world_size, 120 // world_size, states)
    both = {b: before.get(b, []) + after.get(b, []) for b in {*before, *after}}
    assert repeats_before_whole(both) == 0
    afresh, _ = job(sample_cache, world_size, 120 // world_size)  # the check can fail
    fresh = {b: before.get(b, []) + afresh.get(b, []) for b in {*before, *afresh}}
    assert repeats_before_whole(fresh) > 0


@pytest.fixture(scope="module")
def half_rate_cache(sample_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample cache with codes at half its frame rate (the GPT example's shape)."""
    cache = tmp_path_factory.mktemp("codes") / "cache"
    shutil.copytree(sample_cache, cache)
    encoder = "benchmarks.loader.sequence_bench:half_rate_codes"
    run_preprocess("derive", str(cache), "--field", "codes", "--encoder", encoder, "--workers", "1")
    return cache


def test_a_model_of_fields_alone_plans_on_text_plus_the_fields_frames(
    half_rate_cache: Path, sidecars: Path
) -> None:
    codes = {"fields": ("codes",), "read_mel": False, **TEXT}
    spec = loader(half_rate_cache, batch_frames=800, **codes).spec
    with Cache(half_rate_cache) as cache:
        halves = cache.fields.rows("codes")[:, 2]
        assert (halves * 2 >= cache.lengths).all() and (halves < cache.lengths).all()
    assert spec.sources[0].text.frames.tolist() == halves.tolist()
    for _, _, samples, _, _ in itertools.islice(planned_stream(spec, 0), 60):
        longest = max(s.frames + len(utf8_tokens(s.text)) for s in samples)
        assert len(samples) * round_up(longest, 8) <= 800
        assert all(s.frames in halves for s in samples)  # the codes' frames, not the mel's


def test_the_trainers_metrics_report_text_sequence_and_axes_padding() -> None:
    import torch

    from train.parallel.env import Env
    from train.run.metrics import Meter

    meter = Meter(Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    # Rows of 2 + 10 and 6 + 4 positions: text padded to 6 (12 slots, 8 real), frames to 16
    # (32 slots, 14 real; T = 16), text then frames to 12 (24 slots, 22 real).
    meter.add_batch(torch.tensor([10, 4]), torch.Size([2, 16, 100]), torch.tensor([2, 6]))
    meter.end_step()
    out = meter.summary()
    assert out["text_padding_pct"] == pytest.approx(100 * 4 / 12)
    assert out["padding_pct"] == pytest.approx(100 * 18 / 32)
    assert out["sequence_padding_pct"] == pytest.approx(100 * 2 / 24)
    assert out["axes_padding_pct"] == pytest.approx(100 * (4 + 18) / (12 + 32))  # two axes


@pytest.mark.parametrize("sequence", ["text+frames", "text,frames"])
def test_a_4_rank_job_resumes_batch_for_batch(
    sample_cache: Path, sidecars: Path, sequence: str
) -> None:
    def ranks(states=None):
        made = [loader(sample_cache, r, 4, sequence=sequence) for r in range(4)]
        for rank, each in enumerate(made if states is not None else ()):
            each.load_state_dict(states[rank])  # each rank its own state: the same job
        return made, [iter(each) for each in made]

    _, whole = ranks()
    uninterrupted = [[next(s).keys for s in whole] for _ in range(50)]
    first, streams = ranks()
    assert [[next(s).keys for s in streams] for _ in range(20)] == uninterrupted[:20]
    _, resumed = ranks([each.state_dict() for each in first])
    assert [[next(s).keys for s in resumed] for _ in range(30)] == uninterrupted[20:]
