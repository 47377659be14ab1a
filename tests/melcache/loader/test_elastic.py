"""Resume on another number of ranks and workers, or with another mix (#39): real loaders over
the real sample caches, the old job's states handed to every rank of the new one."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from melcache.loader import Batch, DataConfig, StreamLoader, make_loader
from melcache.loader.resume.state import STATE_KEYS, LoaderStateError, parse_deals
from tests.support.helpers import REPO

# Epochs of 6, 2, 2 and 1 batches in the sample cache's four buckets. One-process ranks read
# each epoch whole before the next at any job size (batch plan 4's deal); the chunks of the
# earlier plans, which old states resume with, do too at these sizes (each is a whole share
# of an epoch, or a single batch). Where they are not, see the test of epochs 17, 6, 5 and 2.
DATA = {"batch_frames": 3000, "max_batch_size": 3}

Steps = list[list[Batch]]


def make(cache, rank: int, world_size: int, workers: int, **data) -> StreamLoader:
    options = DataConfig(**{**DATA, "num_workers": workers, **data})
    return make_loader(cache, options, rank=rank, world_size=world_size, seed=1)


def run_job(
    cache, world_size: int, workers: int, steps: int, states=None, **data
) -> tuple[Steps, list[dict], list[StreamLoader]]:
    """``steps`` steps of a job (every rank's batch of each), and its ranks' states after."""
    loaders = [make(cache, r, world_size, workers, **data) for r in range(world_size)]
    if states is not None:
        for loader in loaders:
            loader.load_state_dict(states)
    streams = [iter(loader) for loader in loaders]
    out = [[next(stream) for stream in streams] for _ in range(steps)]
    saved = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    return out, saved, loaders


def keys_by_substream(steps: Steps) -> dict[tuple[str, int], list[str]]:
    """Each sub-stream's keys in the order the job read them (step by step, rank by rank)."""
    out: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for step in steps:
        for batch in step:
            out[(batch.source, batch.bucket)].extend(batch.keys)
    return out


def early_repeats(steps: Steps) -> dict[tuple[str, int], int]:
    """Per sub-stream: keys read again before every key of it had been read since the last
    time all had."""
    out = {}
    for name, keys in keys_by_substream(steps).items():
        every, seen, count = set(keys), set(), 0
        for key in keys:
            count += key in seen
            seen.add(key)
            if seen == every:
                seen = set()
        out[name] = count
    return out


def window_repeats(steps: Steps) -> dict[tuple[str, int], float]:
    """Per sub-stream: the mean share of samples, over every window of one epoch's worth of
    them, whose key an earlier sample of the window has."""
    out = {}
    for name, keys in keys_by_substream(steps).items():
        size = len(set(keys))
        repeats = [size - len(set(keys[i : i + size])) for i in range(len(keys) - size + 1)]
        out[name] = sum(repeats) / len(repeats) / size
    return out


def in_one_bucket(steps: Steps) -> bool:
    return all(len({batch.bucket for batch in step}) == 1 for step in steps)


# Steps after which the 6-batch bucket is a third and two thirds into an epoch (the others,
# of 1 or 2 batches, are read whole at every step of 4 ranks).
@pytest.mark.parametrize("cut", [62, 77])
@pytest.mark.parametrize("world_size", [3, 2, 1, 8])
def test_4_ranks_resume_on_any_number_reading_each_bucket_epoch_whole(
    sample_cache: Path, world_size: int, cut: int
) -> None:
    before, states, _ = run_job(sample_cache, 4, 0, cut)
    after, _, loaders = run_job(sample_cache, world_size, 0, 300 // world_size, states)
    assert in_one_bucket(before + after)
    assert set(early_repeats(before + after).values()) == {0}, early_repeats(before + after)
    assert loaders[0].resume_changes == (f"world_size 4 -> {world_size}",)
    # The check can fail: a new job started afresh repeats what the old one had read.
    afresh, _, _ = run_job(sample_cache, world_size, 0, 300 // world_size)
    assert sum(early_repeats(before + afresh).values()) > 0


def consumed_numbers(loader: StreamLoader, state: Mapping) -> list[list[int]]:
    """Per sub-stream, the numbers (in its endless sequence) of the batches a saved rank read."""
    spec = loader.spec
    deals = parse_deals(state["deals"], len(spec.subs), spec.plan)
    out = []
    for u, sub in enumerate(spec.subs):
        numbers = []
        for worker, row in enumerate(state["positions"]):
            slot = state["rank"] * spec.workers_per_rank + worker
            numbers += [
                deals[u].number(sub, slot=slot, num_slots=spec.num_slots, taken=t)
                for t in range(row[u][0])
            ]
        out.append(numbers)
    return out


@pytest.mark.parametrize("mix", [False, True])
def test_a_chain_of_job_changes_reads_every_batch_once(
    sample_cache: Path, train_cache: Path, mix: bool
) -> None:
    """4 ranks, then 3, then 8 with 2 workers, then 1: every batch of each sub-stream's
    sequence is read at most once, and none is left behind the slowest slot."""
    cache = {str(sample_cache): 0.6, str(train_cache): 0.4} if mix else sample_cache
    read: list[collections.Counter[int]] = []
    states = None
    for world_size, workers, steps in ((4, 0, 41), (3, 0, 29), (8, 2, 13), (1, 0, 37)):
        _, states_after, loaders = run_job(cache, world_size, workers, steps, states)
        numbers = [consumed_numbers(x, y) for x, y in zip(loaders, states_after, strict=True)]
        spec = loaders[0].spec
        if not read:
            read = [collections.Counter() for _ in spec.subs]
        for u in range(len(spec.subs)):
            for rank in numbers:
                read[u].update(rank[u])
        states = states_after
    for u, sub in enumerate(spec.subs):
        assert max(read[u].values()) == 1, (sub.bucket, read[u].most_common(3))
        slowest = min(
            spec.deal(u).number(sub, slot=slot, num_slots=spec.num_slots, taken=row[u][0])
            for rank, state in enumerate(states)
            for slot, row in enumerate(state["positions"], rank * spec.workers_per_rank)
        )
        assert set(range(slowest)) <= set(read[u]), (sub.bucket, slowest, sorted(read[u]))


@pytest.mark.slow  # 4 × 2, then 2 × 1 and 8 × 1 worker processes
@pytest.mark.parametrize("mix", [False, True])
def test_4x2_workers_resume_on_2x1_and_8x1_repeating_no_more_than_uninterrupted(
    sample_cache: Path, train_cache: Path, mix: bool
) -> None:
    cache = {str(sample_cache): 0.6, str(train_cache): 0.4} if mix else sample_cache
    # One length range a bucket for a mix: its ranges of one bucket run through their epochs
    # apart, so the per-bucket criterion holds per range (the mix tests below say more).
    data = {"sync_split": 1} if mix else {}
    before, states, _ = run_job(cache, 4, 2, 60, **data)
    uninterrupted = window_repeats(run_job(cache, 4, 2, 200, **data)[0])
    for world_size in (2, 8):
        after, _, loaders = run_job(cache, world_size, 1, 140, states, **data)
        assert in_one_bucket(after)
        resumed = window_repeats(before + after)
        # 0.02: the uninterrupted job's own share differs by up to 0.03 between its first 200
        # steps and the 200 after step 60 (sub-streams of 5 to 17 keys).
        assert all(resumed[k] <= uninterrupted[k] + 0.02 for k in resumed), (resumed, uninterrupted)
        assert "data.num_workers (workers per rank) 2 -> 1" in loaders[0].resume_changes


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_job_reads_each_epoch_whole_where_its_slots_do_not_divide_it(
    sample_cache: Path, world_size: int
) -> None:
    """Sub-streams of 17, 6, 5 and 2 batches an epoch (one utterance a batch), 2 or 3 ranks:
    every epoch of each is read before any batch of the next. The chunks of earlier plans
    (a state of plan 3 continues with them) ran across epoch ends there."""
    data = {"max_batch_size": 1, "sync_split": 1}
    steps = run_job(sample_cache, world_size, 0, 90, **data)[0]
    assert in_one_bucket(steps)
    assert set(early_repeats(steps).values()) == {0}
    chunked = [make(sample_cache, r, world_size, 0, **data) for r in range(world_size)]
    for loader in chunked:
        loader.spec = dataclasses.replace(loader.spec, plan=3)
    streams = [iter(loader) for loader in chunked]
    assert sum(early_repeats([[next(s) for s in streams] for _ in range(90)]).values()) > 0


def test_states_of_another_job_are_refused_by_name(sample_cache: Path) -> None:
    _, states, _ = run_job(sample_cache, 2, 0, 9)
    with pytest.raises(UserError, match="world_size = 2 but this loader has world_size = 3"):
        make(sample_cache, 0, 3, 0).load_state_dict(states[0])  # one rank's of a 2-rank job
    with pytest.raises(UserError, match="saved by rank 1 of 2: give every rank's state"):
        make(sample_cache, 0, 3, 0).load_state_dict(states[::-1])
    with pytest.raises(UserError, match="seed = 1 but this loader has seed = 2"):
        options = DataConfig(**DATA, num_workers=0)
        make_loader(sample_cache, options, world_size=3, seed=2).load_state_dict(states)
    with pytest.raises(UserError, match=r"data\.batch_frames = 3000 .* 2000, which cuts other"):
        make(sample_cache, 0, 3, 0, batch_frames=2000).load_state_dict(states)
    _, later, _ = run_job(sample_cache, 2, 0, 10)
    with pytest.raises(UserError, match="differ in batches"):
        make(sample_cache, 0, 3, 0).load_state_dict([states[0], later[1]])
    whole = run_job(sample_cache, 2, 0, 3, sync_buckets=False)[1]
    with pytest.raises(UserError, match=r"only data\.sync_buckets = true resumes"):
        make(sample_cache, 0, 3, 0, sync_buckets=False).load_state_dict(whole)


@pytest.mark.parametrize(
    ("key", "value"), [("batch_plan", 99), ("batch_plan", "2"), ("sync_split", True),
                       ("sync_split", -3), ("sync_split", 10**9), ("attention_frames", 0),
                       ("attention_frames", 2.5)],
)  # fmt: skip
def test_a_states_garbage_batch_setting_is_refused_by_name(
    sample_cache: Path, key: str, value: object
) -> None:
    """A state's batch plan and length ranges choose how batches are cut before any other key
    is checked, so a forged one is refused by its name, not taken (99 cut as plan 3) or
    raised as a ValueError from int()."""
    _, states, _ = run_job(sample_cache, 1, 0, 5)
    said = re.escape(f"{STATE_KEYS[key]} = {value!r}, not a whole number in 1..")
    with pytest.raises(LoaderStateError, match=said):
        make(sample_cache, 0, 1, 0).load_state_dict({**states[0], key: value})


def test_a_loader_left_at_attention_frames_0_takes_the_states_own(sample_cache: Path) -> None:
    """As ``data.sync_split``: 0 is the default for a fresh stream and the state's value on a
    resume, so it continues batch for batch; a value given otherwise is checked."""
    first = make(sample_cache, 0, 1, 0, attention_frames=600)
    stream = iter(first)
    for _ in range(7):
        next(stream)
    state, expected = first.state_dict(), [next(stream).keys for _ in range(5)]
    first.close()
    again = make(sample_cache, 0, 1, 0)
    again.load_state_dict(state)
    assert again.spec.data.attention == 600 and state["attention_frames"] == 600
    assert [b.keys for _, b in zip(range(5), again, strict=False)] == expected
    again.close()
    with pytest.raises(LoaderStateError, match=r"data\.attention_frames = 600 .* 3072"):
        make(sample_cache, 0, 1, 0, attention_frames=3072).load_state_dict(state)


TODAY = """
import json, sys, torch
from melcache.loader import DataConfig, make_loader  # the release before elastic resumes
data = DataConfig(batch_frames=3000, max_batch_size=3, num_workers=0)
loaders = [make_loader(sys.argv[1], data, rank=r, world_size=2, seed=1) for r in range(2)]
streams = [iter(loader) for loader in loaders]
for _ in range(int(sys.argv[3])):
    [next(stream) for stream in streams]
torch.save([loader.state_dict() for loader in loaders], sys.argv[2])
print(json.dumps([next(streams[0]).keys for _ in range(12)]))
"""


# Earlier releases, run from their commits: the last before elastic resumes (batch plan 1, one
# length range a bucket), the last before the cost cut (plan 2, six ranges) and the last before
# epochs dealt whole (plan 3: the cost cut, chunks across epoch ends).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("commit", "version", "plan"), [("988e0ec", 3, None), ("0935133", 4, 2), ("2af1f2a", 4, 3)]
)
def test_a_state_of_an_earlier_release_resumes_batch_for_batch_and_on_3_ranks(
    sample_cache: Path, tmp_path: Path, commit: str, version: int, plan: int | None
) -> None:
    old = tmp_path / "before"
    old.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "melcache"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    state = tmp_path / "states.pt"
    done = subprocess.run(
        [sys.executable, "-c", TODAY, str(sample_cache), str(state), "31"],
        cwd=old, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = torch.load(state, weights_only=True)
    assert [s["version"] for s in saved] == [version, version]
    assert saved[0].get("batch_plan") == plan
    same = make(sample_cache, 0, 2, 0)
    same.load_state_dict(saved[0])
    assert same.spec.plan == (plan or 1)  # the state's cut, and its deal: chunks in turn
    assert not any(same.spec.deal(u).by_epoch for u in range(len(same.spec.subs)))
    assert [b.keys for _, b in zip(range(12), same, strict=False)] == json.loads(done.stdout)
    same.close()
    after, _, loaders = run_job(sample_cache, 3, 0, 60, saved)
    assert loaders[0].resume_changes == ("world_size 2 -> 3",)
    assert in_one_bucket(after)
    assert all(deal.frontier > 0 for deal in loaders[0].spec.deals)  # not from the start
    assert not any(deal.by_epoch for deal in loaders[0].spec.deals)


def frames_of(steps: Steps, source: str) -> list[tuple[bool, int]]:
    """(from ``source``, real frames) of every batch, step by step, rank by rank."""
    return [(b.source == source, int(b.mel_lengths.sum())) for step in steps for b in step]


def test_new_weights_hold_from_the_first_window_and_each_cache_keeps_its_place(
    sample_cache: Path, train_cache: Path
) -> None:
    """0.5 / 0.5 for 300 batches, then 0.8 / 0.2: every 200 batches after the change within
    2 % of 0.8, and no key of a cache's bucket read twice before all of it was (one rank: the
    ranks of a mix take different caches within a step, so their reads of a bucket drift
    apart by a batch or two even uninterrupted; one length range a bucket: a mix's ranges of
    one bucket run through their epochs apart, 163 keys early in 1,100 batches here even
    uninterrupted, so the criterion holds per range, not per bucket)."""
    a, b = str(sample_cache), str(train_cache)
    before, states, _ = run_job({a: 0.5, b: 0.5}, 1, 0, 300, sync_split=1)
    after, _, loaders = run_job({a: 0.8, b: 0.2}, 1, 0, 800, states, sync_split=1)
    assert loaders[0].resume_changes == (
        "mix shares (data.mix, data.mix_temperature, the caches' hours) [0.5, 0.5] -> [0.8, 0.2]",
    )
    batches = frames_of(after, a)
    for start in range(0, len(batches) - 200 + 1, 10):
        window = batches[start : start + 200]
        share = sum(f for mine, f in window if mine) / sum(f for _, f in window)
        assert abs(share - 0.8) <= 0.02, (start, share)
    assert set(early_repeats(before + after).values()) == {0}


def test_a_cache_added_starts_at_its_epoch_0_and_one_dropped_leaves_the_rest_in_place(
    sample_cache: Path, train_cache: Path
) -> None:
    a, b = str(sample_cache), str(train_cache)
    before, states, _ = run_job(a, 1, 0, 77, sync_split=1)  # per bucket: the test above
    after, mixed, loaders = run_job({a: 0.5, b: 0.5}, 1, 0, 120, states, sync_split=1)
    assert f"cache {b} added: it starts at its epoch 0" in loaders[0].resume_changes
    spec = loaders[0].spec
    assert all(spec.deal(u).frontier == 0 for u, s in enumerate(spec.subs) if s.source == 1)
    assert set(early_repeats(before + after).values()) == {0}
    again, _, loaders = run_job(a, 1, 0, 100, mixed, sync_split=1)
    assert f"cache {b} dropped" in loaders[0].resume_changes
    mine = [[x for x in step if x.source == a] for step in before + after]
    assert set(early_repeats([*mine, *again]).values()) == {0}


def test_a_cache_whose_content_changed_is_refused_unless_allowed(
    sample_cache: Path, train_cache: Path, tmp_path: Path
) -> None:
    moving = tmp_path / "cache"
    shutil.copytree(sample_cache, moving)
    _, states, _ = run_job({str(moving): 0.5, str(train_cache): 0.5}, 2, 0, 20)
    shutil.rmtree(moving)
    shutil.copytree(train_cache, moving)  # another cache, rebuilt under the same location
    caches = {str(moving): 0.5, str(train_cache): 0.5}
    with pytest.raises(UserError, match=rf"cache {moving} changed since .*allow_data_change"):
        run_job(caches, 2, 0, 1, states)
    after, _, loaders = run_job(caches, 2, 0, 30, states, allow_data_change=True)
    assert f"cache {moving} changed content: it starts again at its epoch 0" in (
        loaders[0].resume_changes
    )
    assert {b.source for step in after for b in step} == set(caches)


@pytest.mark.slow  # 1,100 + 320 batches of a mix
def test_a_mix_schedule_changes_the_weights_inside_one_run_and_resumes_exactly(
    sample_cache: Path, train_cache: Path
) -> None:
    a, b = str(sample_cache), str(train_cache)
    cache, schedule = {a: 0.5, b: 0.5}, {"300": {a: 0.8, b: 0.2}}
    data = {"mix_schedule": schedule, "sync_split": 1}  # per bucket: the tests above
    steps = run_job(cache, 1, 0, 1100, **data)[0]
    batches = frames_of(steps, a)
    for start, end, weight in ((0, 300, 0.5), (300, 1100, 0.8)):
        for first in range(start, end - 200 + 1, 10):
            window = batches[first : first + 200]
            share = sum(f for mine, f in window if mine) / sum(f for _, f in window)
            assert abs(share - weight) <= 0.02, (first, share, weight)
    assert set(early_repeats(steps).values()) == {0}
    _, states, _ = run_job(cache, 1, 0, 290, **data)
    assert states[0]["mix_schedule"] == [[300, [0.8, 0.2]]]
    resumed, _, _ = run_job(cache, 1, 0, 30, states[0], **data)
    assert [b.keys for [b] in resumed] == [b.keys for [b] in steps[290:320]]
    with pytest.raises(UserError, match=r"data\.mix_schedule\.300 names"):
        make({a: 0.5, b: 0.5}, 0, 1, 0, mix_schedule={"300": {a: 1.0}})
