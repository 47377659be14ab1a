"""data.sequence = "text,frames" (#52): an encoder-decoder's text and frames as two axes, each
padded to its own longest and bounded by its own budget (``data.batch_frames``,
``data.batch_text``), cut by cost on both. Real loaders over the real sample cache."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import numpy as np
import pytest

from melcache.access import Cache
from melcache.batch_plans import even_batch_count, make_rng, round_up
from melcache.errors import UserError
from melcache.loader import DataConfig
from melcache.loader.batch import utf8_tokens
from melcache.loader.resume.state import LoaderStateError
from melcache.loader.sequence import CELL_GAIN, plan_two_axis_batches, two_axis_cost
from melcache.loader.stream import planned_stream
from tests.melcache.loader.test_sequence_plan import (
    job,
    keys,
    loader,
    repeats_before_whole,
    sidecars,  # noqa: F401 (a fixture)
)

TWO = {"sequence": "text,frames"}
pytestmark = pytest.mark.usefixtures("sidecars")  # text lengths counted in a test's own folder


def shape(samples) -> tuple[int, int, int]:
    """Rows, longest text (tokens) and longest frames of a planned batch."""
    return (len(samples), max(len(utf8_tokens(s.text)) for s in samples),
            max(s.frames for s in samples))  # fmt: skip


@pytest.mark.parametrize("batch_text", [0, 200])
def test_every_batch_fits_both_budgets_and_an_epoch_reads_each_key_once(
    sample_cache: Path, batch_text: int
) -> None:
    spec = loader(sample_cache, batch_frames=1600, batch_text=batch_text, **TWO).spec
    text_budget = batch_text or 1600
    epoch = sum(sub.per_epoch for sub in spec.subs)
    seen = collections.Counter()
    for _, _, samples, _, _ in itertools.islice(planned_stream(spec, 0), 40 * epoch):
        rows, text, frames = shape(samples)
        assert rows * round_up(frames, 8) <= 1600 and rows <= 6
        assert rows * round_up(text, 8) <= text_budget
        seen.update(s.key for s in samples)
    with Cache(sample_cache) as cache:
        assert set(seen) == set(cache.keys())
    frames_only = sum(sub.per_epoch for sub in loader(sample_cache, batch_frames=1600).spec.subs)
    # a text budget that binds cuts more batches; the bucket's batch_frames alone does not
    assert (epoch > frames_only) == bool(batch_text), (epoch, frames_only)


def test_a_balanced_stream_fits_both_budgets(sample_cache: Path) -> None:
    chosen = {"where": "frames > 100", "balance": {"speaker_temperature": 0.0}}
    spec = loader(sample_cache, batch_frames=1600, batch_text=200, **TWO, **chosen).spec
    for _, _, samples, _, _ in itertools.islice(planned_stream(spec, 0), 200):
        rows, text, frames = shape(samples)
        assert rows * round_up(frames, 8) <= 1600 and rows * round_up(text, 8) <= 200
        assert frames > 100


def test_budgets_that_do_not_fit_the_text_axis_are_refused_by_name(sample_cache: Path) -> None:
    with Cache(sample_cache) as cache:
        longest = max(len(utf8_tokens(u.text)) for u in cache)
    loader(sample_cache, batch_text=round_up(longest, 8), **TWO)
    with pytest.raises(UserError, match=r"tokens, over data.batch_text"):
        loader(sample_cache, batch_text=round_up(longest, 8) - 8, **TWO)
    with pytest.raises(UserError, match=r"data.batch_text names buckets \[0\]"):
        loader(sample_cache, batch_text={"0": 4000}, **TWO)
    with pytest.raises(UserError, match=r"data\.batch_text"):
        DataConfig(batch_text=400, sequence="text+frames")
    # "frames" in the config may be a model's "text,frames" (train/model/contract.py); a
    # loader given no axis of text refuses the text budget
    with pytest.raises(UserError, match=r"data\.batch_text = 400 .* or the model declares it"):
        loader(sample_cache, batch_text=400)
    with pytest.raises(UserError, match=r"data\.batch_text\.1"):
        DataConfig(batch_text={"1": 0}, **TWO)


def test_a_state_resumes_batch_for_batch_and_is_refused_under_another_axis_or_budget(
    sample_cache: Path,
) -> None:
    whole = keys(iter(loader(sample_cache, batch_text=200, **TWO)), 30)
    first = loader(sample_cache, batch_text=200, **TWO)
    assert keys(iter(first), 12) == whole[:12]
    state = first.state_dict()
    again = loader(sample_cache, batch_text=200, **TWO)
    again.load_state_dict(state)
    assert keys(iter(again), 18) == whole[12:]
    others = (loader(sample_cache, sequence="text+frames"), loader(sample_cache, **TWO))
    for other in others:
        with pytest.raises(LoaderStateError, match=r"data\.sequence .*data\.batch_text"):
            other.load_state_dict(state)


@pytest.mark.parametrize("world_size", [4, 2])
def test_4_ranks_resume_on_the_same_job_and_on_2_reading_each_epoch_whole(
    sample_cache: Path, world_size: int
) -> None:
    # 27 steps: a fresh job after them repeats keys (after 31, as many epochs' worth, none)
    before, states = job(sample_cache, 4, 27, sequence="text,frames")
    after, _ = job(sample_cache, world_size, 120 // world_size, states, sequence="text,frames")
    both = {b: before.get(b, []) + after.get(b, []) for b in {*before, *after}}
    assert repeats_before_whole(both) == 0
    afresh, _ = job(sample_cache, world_size, 120 // world_size, sequence="text,frames")
    fresh = {b: before.get(b, []) + afresh.get(b, []) for b in {*before, *afresh}}
    assert repeats_before_whole(fresh) > 0  # the check can fail


def padded_cost(batches, text, frames) -> int:
    return sum(
        len(b) * int(two_axis_cost(round_up(max(text[b]), 8), round_up(max(frames[b]), 8), 400))
        for b in batches
    )


def cut(text, frames, count: int, seed: int = 0) -> list[np.ndarray]:
    batches = plan_two_axis_batches(text, frames, rng=make_rng(seed, 9), count=count,
                                    max_batch_size=16, pad_multiple=8, attention_frames=400)  # fmt: skip
    return [np.asarray(b) for b in batches]


def test_the_two_axis_cut_keeps_its_count_and_both_budgets_and_takes_cells_where_they_pay() -> None:
    rng = np.random.default_rng(5)
    frames = rng.integers(300, 340, 400)
    # text half short (Mandarin-like), half three times longer: cells pay where text weighs
    text = np.where(rng.random(400) < 0.5, 40, 120) + rng.integers(0, 8, 400)
    count = even_batch_count(400, 340, batch_frames=3000, max_batch_size=16, pad_multiple=8)
    for lengths in (text, text // 20 + 1):  # text that weighs, and text that does not
        batches = cut(lengths, frames, count)
        assert len(batches) == count
        assert sorted(np.concatenate(batches).tolist()) == list(range(400))
        fit = min(16, 3000 // round_up(340, 8))
        for b in batches:
            assert len(b) * round_up(int(frames[b].max()), 8) <= fit * round_up(340, 8)
            assert len(b) * round_up(int(lengths[b].max()), 8) <= fit * round_up(
                int(lengths.max()), 8
            )
    heavy = cut(text, frames, count)
    mixed = sum(len(set((text[b] >= 100).tolist())) > 1 for b in heavy)
    assert mixed <= 2  # cells: short and long texts batched apart, a run across the edge aside
    # a frames-first cut of the same samples (no cells) costs more than CELL_GAIN more
    ordered = np.lexsort((-text, -frames))
    flat = [ordered[part] for part in np.array_split(np.arange(400), count)]
    assert padded_cost(heavy, text, frames) < (1 - CELL_GAIN) * padded_cost(flat, text, frames)
    assert cut(text, frames, count, seed=1)[0].tolist() != heavy[0].tolist()  # ties reshuffled
