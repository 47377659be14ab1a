"""The schedule (#25): ranks in one bucket per step, any job size, even cuts, weighted mixes.

Whole jobs (64 or 512 ranks) are planned with the loader's own readers over the real caches
(shards read, batches planned, no mel decoded); the rest runs real loaders.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from melcache.batch_plans import (
    even_batch_count,
    even_units,
    make_rng,
    plan_batches,
    plan_even_batches,
    round_up,
)
from melcache.errors import UserError
from melcache.format import INDEX_NAME
from melcache.loader import DataConfig, StreamLoader, make_loader
from melcache.loader.data_config import SYNC_SPLIT
from melcache.loader.deal import locate
from melcache.loader.stream import planned_stream
from tests.support.helpers import REPO, metrics, run_ok, train_cmd
from train.run.metrics import epochs_names

DATA = {"batch_frames": 3000, "max_batch_size": 3, "num_workers": 0}


def make(cache, rank: int = 0, world_size: int = 1, seed: int = 1, **data) -> StreamLoader:
    return make_loader(
        cache, DataConfig(**{**DATA, **data}), rank=rank, world_size=world_size, seed=seed
    )


def take(loader: StreamLoader, count: int) -> list:
    return [b for _, b in zip(range(count), loader, strict=False)]


def plan(loader: StreamLoader, worker: int, steps: int) -> list[tuple[str, int, list]]:
    """(source, bucket, samples) of a worker's first ``steps`` batches, from its readers."""
    spec = loader.spec
    stream = planned_stream(spec, worker)
    return [
        (spec.sources[source].location, entries[0]["bucket"], samples)
        for _, (_, _, samples, source, entries) in zip(range(steps), stream, strict=False)
    ]


def test_every_rank_of_a_step_is_in_one_bucket_unless_switched_off(sample_cache: Path) -> None:
    for sync in (True, False):
        streams = [iter(make(sample_cache, r, 4, sync_buckets=sync)) for r in range(4)]
        steps = [[next(s).bucket for s in streams] for _ in range(40)]
        for s in streams:
            s.close()
        together = sum(len(set(step)) == 1 for step in steps)
        assert together == 40 if sync else together < 20, steps
        assert len({step[0] for step in steps}) == 4  # every bucket comes up


@pytest.mark.parametrize("ranks, workers", [(64, 2), (512, 4)])
def test_any_job_size_reads_every_utterance_once_per_epoch(
    sample_cache: Path, ranks: int, workers: int
) -> None:
    """8 shards over 4 buckets, 128 or 2,048 slots: slots share shards, none runs dry."""
    loaders = [make(sample_cache, r, ranks, num_workers=workers) for r in (0, ranks - 1)]
    spec = loaders[0].spec
    for u, sub in enumerate(spec.subs):
        for epoch in (0, 1):
            keys = Counter()
            for slot in range(spec.num_slots):
                for taken in range(10**6):
                    number = spec.deal(u).number(
                        sub, slot=slot, num_slots=spec.num_slots, taken=taken
                    )
                    if number >= (epoch + 1) * sub.per_epoch:
                        break
                    e, place, batch = locate(sub, seed=spec.seed, number=number)
                    if e == epoch:
                        keys[(sub.units[place], batch)] += 1
            assert set(keys.values()) == {1}  # each batch of the epoch by exactly one slot
            assert len(keys) == sub.per_epoch
    # The readers of real slots (first and last rank) give batches of their bucket's lengths.
    bounds = {
        b["bucket"]: b for b in json.loads((sample_cache / INDEX_NAME).read_text())["buckets"]
    }
    for loader in loaders:
        for worker in range(workers):
            for _, bucket, samples in plan(loader, worker, 6):
                low, high = bounds[bucket]["min_frames"], bounds[bucket]["max_frames"]
                assert samples and all(low <= s.frames <= high for s in samples)


def test_even_cut_keeps_the_budget_with_no_small_remainder() -> None:
    frames = np.random.default_rng(0).integers(500, 513, size=36).tolist()  # one shard
    count = even_batch_count(36, max(frames), batch_frames=4000, max_batch_size=64, pad_multiple=8)
    batches = plan_even_batches(frames, rng=make_rng(0, 4), count=count, max_batch_size=64,
                                pad_multiple=8)  # fmt: skip
    greedy = plan_batches(frames, rng=make_rng(0, 2), batch_frames=4000, max_batch_size=64,
                          pad_multiple=8)  # fmt: skip
    assert sorted(len(b) for b in greedy) == [1, 7, 7, 7, 7, 7]  # the remainder batch
    assert count == 6 and sorted(i for b in batches for i in b) == list(range(36))
    assert sorted(len(b) for b in batches) == [6] * 6
    for b in batches:
        assert len(b) * round_up(max(frames[i] for i in b), 8) <= 4000


def test_the_even_cut_pads_alike_every_epoch_while_its_batches_change() -> None:
    """Batch plan 2 sorts by padded length with ties at random: each epoch's cut costs the
    same, less than plan 1's (its jitter crossed padded lengths), and the samples of one padded
    length change batches from one epoch (rng) to the next."""
    frames = np.random.default_rng(3).integers(300, 420, size=400).tolist()
    cut = {"count": 12, "max_batch_size": 64, "pad_multiple": 8}

    def padding(batches: list[list[int]]) -> int:
        return sum(len(b) * round_up(max(frames[i] for i in b), 8) for b in batches) - sum(frames)

    epochs = [plan_even_batches(frames, rng=make_rng(0, 4, epoch), **cut) for epoch in (0, 1)]
    older = plan_even_batches(frames, rng=make_rng(0, 4, 0), plan=1, **cut)
    assert padding(epochs[0]) == padding(epochs[1]) < padding(older)
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(len(frames)))
    assert {frozenset(b) for b in epochs[0]} != {frozenset(b) for b in epochs[1]}


def test_even_cut_balances_padded_frames_not_counts() -> None:
    """A unit of long and shorter utterances: batches of the shorter hold more of them."""
    frames = [1000] * 40 + [700] * 40
    cut = {"max_batch_size": 64, "pad_multiple": 8}
    count = even_batch_count(80, 1000, batch_frames=32000, **cut)
    batches = plan_even_batches(frames, rng=make_rng(0, 4), count=count, **cut)
    padded = [len(b) * round_up(max(frames[i] for i in b), 8) for b in batches]
    assert len(batches) == count == 3 and sorted(i for b in batches for i in b) == list(range(80))
    assert max(padded) <= 32000 and max(padded) / min(padded) < 1.1, padded  # equal counts: 1.47
    few = plan_even_batches([100] * 200, rng=make_rng(0, 4), count=4, max_batch_size=50,
                            pad_multiple=8)  # fmt: skip
    assert sorted(len(b) for b in few) == [50] * 4  # max_batch_size holds


def test_attention_frames_balances_the_cost_of_a_units_batches_not_their_frames() -> None:
    """A unit of 3000- to 2000-frame utterances: equal frames leave its longest batches the
    costliest under ``B·T·(1 + T/A)``; ``attention_frames`` evens that cost, every batch still
    within equal counts' padded frames and max_batch_size, every sample once."""
    frames = np.random.default_rng(5).integers(2000, 3001, size=160).tolist()
    cut = {"count": 16, "max_batch_size": 64, "pad_multiple": 8}

    def costs(batches: list[list[int]], attention: int) -> list[float]:
        longest = [round_up(max(frames[i] for i in b), 8) for b in batches]
        return [len(b) * t * (1 + t / attention) for b, t in zip(batches, longest, strict=True)]

    frames_cut = plan_even_batches(frames, rng=make_rng(0, 4), **cut)
    cost_cut = plan_even_batches(frames, rng=make_rng(0, 4), attention_frames=600, **cut)
    # mean ÷ max: the share of a step of these batches on as many ranks not spent waiting
    even = [sum(c) / len(c) / max(c) for c in (costs(frames_cut, 600), costs(cost_cut, 600))]
    assert even[1] > 0.93 > 0.9 > even[0], even  # 0.943 and 0.869
    equal = max(len(p) * round_up(max(p), 8) for p in np.array_split(sorted(frames)[::-1], 16))
    assert len(cost_cut) == 16 and sorted(i for b in cost_cut for i in b) == list(range(160))
    assert all(len(b) * round_up(max(frames[i] for i in b), 8) <= equal for b in cost_cut)
    # attention_frames 0 is the frames cut itself, and plan 1 (earlier states) keeps its own
    assert plan_even_batches(frames, rng=make_rng(0, 4), attention_frames=0, **cut) == frames_cut
    older = plan_even_batches(frames, rng=make_rng(0, 4), plan=1, **cut)
    assert plan_even_batches(frames, rng=make_rng(0, 4), plan=1, attention_frames=600,
                             **cut) == older  # fmt: skip


def test_a_batch_continues_into_the_next_shard_of_its_unit(sample_cache: Path) -> None:
    # Bucket 8 of the 3 h benchmark cache: three shards of 36 and the bucket's last, of 3.
    samples, longest = [36, 36, 36, 3], [878, 943, 1001, 1013]
    cut = {"batch_frames": 32000, "max_batch_size": 64, "pad_multiple": 8}
    alone = [even_batch_count(n, m, **cut) for n, m in zip(samples, longest, strict=True)]
    assert alone == [1, 2, 2, 1]  # batches of 36, 18, 18, 18, 18 and 3 utterances
    assert even_units(samples, longest, **cut) == [[0, 1, 2, 3]]
    assert even_batch_count(111, 1013, **cut) == 4  # 27 or 28 each, 28 × 1016 <= 32000
    assert even_units([800, 800, 5], [300, 310, 320], **cut) == [[0], [1, 2]]
    # In a real loader: batches whose samples come from two shards of one bucket.
    loader = make(sample_cache)
    spanning = [entries for *_, entries in itertools.islice(planned_stream(loader.spec, 0), 200)
                if len(entries) == 2]  # fmt: skip
    assert spanning and all(a["bucket"] == b["bucket"] for a, b in spanning)


def frame_share(batches: list[tuple[str, int, list]], source: str) -> float:
    frames = Counter()
    for where, _, samples in batches:
        frames[where] += sum(s.frames for s in samples)
    return frames[source] / sum(frames.values())


@pytest.mark.parametrize("sync", [True, False])
def test_a_mix_gives_each_cache_its_frame_share_at_every_scale(
    sample_cache: Path, train_cache: Path, sync: bool
) -> None:
    """Frame shares within ±2 % over 2,000 batches and over every 200 (windows every 20
    batches), while the buckets of each cache keep one pace (train_cache has no bucket 3:
    its draws fall on sample_cache alone, and the other buckets make up for it)."""
    a, b = str(sample_cache), str(train_cache)
    mix = make({a: 0.7, b: 0.3}, 1, 4, sync_buckets=sync, max_batch_size=64)
    batches = plan(mix, 0, 2000)
    assert abs(frame_share(batches, a) - 0.7) < 0.02
    windows = [frame_share(batches[i : i + 200], a) for i in range(0, 1801, 20)]
    assert max(abs(w - 0.7) for w in windows) < 0.02, windows
    assert {where for where, _, _ in batches[:20]} == {a, b}
    if sync:  # epochs of each cache's buckets within 10 % of each other
        taken = Counter((where, bucket) for where, bucket, _ in batches)
        for source, cache in enumerate(mix.spec.sources):
            epochs = [taken[(cache.location, s.bucket)] / s.per_epoch for s in mix.spec.subs
                      if s.source == source]  # fmt: skip
            assert max(epochs) < 1.1 * min(epochs), (cache.location, epochs)


def test_the_ranks_of_a_step_take_different_caches(sample_cache: Path, train_cache: Path) -> None:
    a, b = str(sample_cache), str(train_cache)
    ranks = [plan(make({a: 0.7, b: 0.3}, r, 8, max_batch_size=64), 0, 40) for r in range(8)]
    steps = [{where for where, _, _ in batches} for batches in zip(*ranks, strict=True)]
    assert sum(len(step) == 2 for step in steps) > 0.6 * len(steps), steps
    assert len(steps[0]) == len(steps[1]) == 2  # from the start: each slot has its own lead


def test_mix_weights_default_to_hours_and_temperature_evens_them(
    sample_cache: Path, train_cache: Path
) -> None:
    a, b = str(sample_cache), str(train_cache)
    hours = [sum(s["frames"] for s in json.loads((c / INDEX_NAME).read_text())["shards"])
             for c in (sample_cache, train_cache)]  # fmt: skip
    assert make([a, b]).weights == pytest.approx([h / sum(hours) for h in hours])
    assert make([a, b], mix_temperature=0.0).weights == pytest.approx([0.5, 0.5])
    assert make([a, b], mix={a: 3, b: 1}).weights == pytest.approx([0.75, 0.25])
    with pytest.raises(UserError, match=r"data\.mix names"):
        make([a, b], mix={a: 3})


def test_a_mix_resumes_exactly_at_any_point(
    sample_cache: Path, train_cache: Path, tmp_path: Path
) -> None:
    caches = {str(sample_cache): 0.6, str(train_cache): 0.4}
    reference = make(caches, 1, 2, num_workers=2, seed=3)
    stream = iter(reference)
    states, batches = [], []
    for _ in range(70):
        states.append(reference.state_dict())
        batches.append(next(stream))
    reference.close()
    assert {b.source for b in batches} == set(caches)
    for cut in random.Random(0).sample(range(65), 20):
        resumed = make(caches, 1, 2, num_workers=2, seed=3)
        torch.save(states[cut], tmp_path / "state.pt")
        resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
        got = take(resumed, 5)
        for x, y in zip(got, batches[cut : cut + 5], strict=True):
            assert x.keys == y.keys and x.source == y.source and torch.equal(x.mel, y.mel)
    changed = make({str(sample_cache): 0.5, str(train_cache): 0.5}, 1, 2, num_workers=2, seed=3)
    with pytest.raises(UserError, match="mix"):
        changed.load_state_dict(states[10])
    with pytest.raises(UserError, match="world_size"):
        make(caches, 1, 3, num_workers=2, seed=3).load_state_dict(states[10])
    with pytest.raises(UserError, match="sync_buckets"):
        make(caches, 1, 2, num_workers=2, seed=3, sync_buckets=False).load_state_dict(states[10])


def test_caches_of_a_mix_need_one_feature_config(sample_cache: Path, tmp_path: Path) -> None:
    other = Path(shutil.copytree(sample_cache, tmp_path / "other"))
    index = json.loads((other / INDEX_NAME).read_text())
    index["features"]["f_max"] = 8000.0
    (other / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(UserError, match=rf"{other} was built with features\.f_max = 8000\.0"):
        make([str(sample_cache), str(other)])


PREVIOUS = """
import json, sys, torch
from train.data import DataConfig, make_loader  # the previous release: its own address
loader = make_loader(sys.argv[1], DataConfig(batch_frames=1500, max_batch_size=2, num_workers=2),
                     seed=7)
stream = iter(loader)
for _ in range(int(sys.argv[3])):
    next(stream)
torch.save(loader.state_dict(), sys.argv[2])
print(json.dumps([next(stream).keys for _ in range(12)]))
loader.close()
"""


@pytest.mark.slow  # the previous release's loader, run from its commit in a subprocess
def test_a_state_of_the_previous_release_resumes_with_sync_off(
    sample_cache: Path, tmp_path: Path
) -> None:
    old = tmp_path / "previous"
    old.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "fe02391", "melcache", "train"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    for cut in (5, 23):
        state = tmp_path / f"state{cut}.pt"
        done = subprocess.run(
            [sys.executable, "-c", PREVIOUS, str(sample_cache), str(state), str(cut)],
            cwd=old, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        data = {"batch_frames": 1500, "max_batch_size": 2, "num_workers": 2}
        resumed = make(sample_cache, seed=7, sync_buckets=False, **data)
        saved = torch.load(state, weights_only=True)
        assert saved["version"] == 1
        resumed.load_state_dict(saved)
        assert [b.keys for b in take(resumed, 12)] == json.loads(done.stdout)
        with pytest.raises(UserError, match="sync_buckets = false"):
            make(sample_cache, seed=7, **data).load_state_dict(saved)


@pytest.mark.slow  # torchrun, 2 processes
def test_the_trainer_trains_on_a_weighted_mix(
    train_cache: Path, sample_cache: Path, tmp_path: Path
) -> None:
    """--shards twice, [data.mix] keyed by location; metrics.jsonl logs each cache's epochs."""
    out = tmp_path / "run"
    mix = f'data.mix={{"{train_cache}" = 0.7, "{sample_cache}" = 0.3}}'
    entry = ("-m", "train", "--shards", str(sample_cache))  # options before the overrides
    run_ok(train_cmd(train_cache, out, mix, "data.batch_frames=3000", entry=entry))
    logged = [m for m in metrics(out) if "loss" in m]
    names = epochs_names([str(sample_cache), str(train_cache)])  # --shards in the given order
    assert names == [f"epochs/0_{sample_cache.name}", f"epochs/1_{train_cache.name}"]
    assert logged and all(m[names[1]] >= 0 for m in logged)  # a tag: no path, no space
    assert logged[-1][names[0]] > 0 and logged[-1][names[1]] > 0


def test_a_version_2_state_resumes_one_whole_cache_and_is_refused_otherwise(
    sample_cache: Path,
) -> None:
    """Version 2: this release before units and frames taken (same whole-cache stream)."""
    reference = make(sample_cache, num_workers=2, sync_buckets=False)
    stream = iter(reference)
    for _ in range(7):
        next(stream)
    state = reference.state_dict()
    expected = [next(stream).keys for _ in range(5)]
    reference.close()
    assert all(p[-1] > 0 for w in state["positions"] for p in w if any(p[:3]))  # frames taken
    old = {**state, "version": 2, "positions": [[p[:-1] for p in w] for w in state["positions"]]}
    resumed = make(sample_cache, num_workers=2, sync_buckets=False)
    resumed.load_state_dict(old)
    assert [b.keys for b in take(resumed, 5)] == expected
    with pytest.raises(UserError, match=r"version 2.*sync_buckets = false"):
        make(sample_cache, num_workers=2).load_state_dict(old)


@pytest.mark.parametrize(("world_size", "workers"), [(4, 0), (2, 2)])
def test_epochs_count_the_batches_the_job_consumed(
    sample_cache: Path, world_size: int, workers: int
) -> None:
    """``epochs()`` is, per bucket, the job's batches of it consumed ÷ its batches per epoch
    (every rank takes the bucket of each step, so the job's are ``world_size`` × this rank's,
    counted here from the batches themselves), frame-weighted over the buckets; not one
    slot's place in the sequence, which stays behind through an epoch's first chunk (0.45
    at 92 % of an epoch of a 50 h cache, ``benchmarks.loader.schedule_bench --parts synthetic``).
    One length range per bucket (``sync_split = 1``), so that a batch's bucket names its
    sub-stream; the synthetic part counts ranges by their shards."""
    loader = make(
        sample_cache,
        world_size=world_size,
        num_workers=workers,
        sync_buckets=True,
        sync_split=1,
        max_batch_size=1,
    )
    subs = {sub.bucket: sub for sub in loader.spec.subs}
    frames = sum(sub.frames for sub in subs.values())
    taken = Counter()
    stream = iter(loader)
    for _ in range(3 * sum(sub.per_epoch for sub in subs.values()) // world_size):
        taken[next(stream).bucket] += 1
        consumed = sum(
            world_size * taken[b] / sub.per_epoch * sub.frames for b, sub in subs.items()
        )
        assert loader.epochs()[str(sample_cache)] == pytest.approx(consumed / frames, abs=1e-4)
    loader.close()


def test_sync_split_keeps_a_steps_ranks_in_one_length_range_and_reads_each_key_once(
    sample_cache: Path,
) -> None:
    """``data.sync_split``: each bucket's units cut into runs of neighbouring lengths, drawn
    alike on every rank, so a step's ranks read one range (not the whole bucket's); each
    range still reads every key of it once an epoch. Its states name the key."""
    ranks, options = 4, {"sync_buckets": True, "max_batch_size": 1, "sync_split": 2}
    loaders = [make(sample_cache, rank=r, world_size=ranks, **options) for r in range(ranks)]
    spec = loaders[0].spec
    shards = spec.sources[0].shards
    range_of = {
        shards[i]["name"]: (sub.bucket, sub.part) for sub in spec.subs for u in sub.units for i in u
    }
    split = [b for b in {s.bucket for s in spec.subs} if sum(s.bucket == b for s in spec.subs) > 1]
    assert split  # buckets of two units or more are cut in two
    for bucket in split:  # part 0 holds the shorter units
        low, high = (
            [shards[i] for s in spec.subs if (s.bucket, s.part) == (bucket, part) for u in s.units
             for i in u]
            for part in (0, 1)
        )  # fmt: skip
        assert max(e["max_frames"] for e in low) <= min(e["min_frames"] for e in high)
    streams = [planned_stream(loader.spec, 0) for loader in loaders]
    keys: dict[tuple[int, int], list[str]] = {}
    for _ in range(2 * sum(sub.per_epoch for sub in spec.subs) // ranks):
        batches = [next(stream) for stream in streams]
        ranges = {range_of[entries[0]["name"]] for *_, entries in batches}
        assert len(ranges) == 1, ranges  # every rank in one length range of one bucket
        for _, _, samples, _, _ in batches:
            keys.setdefault(next(iter(ranges)), []).extend(s.key for s in samples)
    for (bucket, part), read in keys.items():
        sub = next(s for s in spec.subs if (s.bucket, s.part) == (bucket, part))
        first = read[: sub.per_epoch]  # one sample a batch: an epoch is per_epoch keys
        assert len(set(first)) == len(first) == sub.per_epoch, (bucket, part)
    stream = iter(loaders[0])
    next(stream)
    state = loaders[0].state_dict()
    assert state["sync_split"] == 2
    expected = [next(stream).keys for _ in range(4)]
    loaders[0].close()
    left = make(sample_cache, rank=0, world_size=ranks, sync_buckets=True, max_batch_size=1)
    assert left.spec.data.split == SYNC_SPLIT  # 0, the default: a fresh stream's ranges
    left.load_state_dict(state)  # and a resumed one's own
    assert left.spec.data.split == 2
    assert [b.keys for b in take(left, 4)] == expected
    other = make(sample_cache, rank=0, world_size=ranks, sync_buckets=True, max_batch_size=1,
                 sync_split=1)  # fmt: skip
    with pytest.raises(UserError, match=r"data\.sync_split = 2"):
        other.load_state_dict(state)
