"""The loader's lifetime: an iterator keeps its loader, the stream never ends silently.

A loader made inline (``for batch in make_loader(...)``) is held by nothing but its iterator;
it must stream for as long as it is iterated, stop its workers once the last iterator is
gone or at ``close()``, and raise :class:`LoaderClosed` rather than ``StopIteration`` when
its stream has been stopped.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

import melcache.loader.workers
from melcache.loader import DataConfig, LoaderClosed, make_loader

STEPS = 300  # many epochs of the sample cache: each worker rolls over again and again


def config(workers: int) -> DataConfig:
    return DataConfig(batch_frames=3000, max_batch_size=3, num_workers=workers)


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_for_loop_over_an_inline_loader_streams_until_it_breaks(
    sample_cache: Path, workers: int
) -> None:
    before = children()
    count = 0
    for batch in make_loader(sample_cache, config(workers)):
        assert len(batch) > 0
        count += 1
        if count == STEPS:
            break
    assert count == STEPS
    assert children() == before  # the loop's iterator is gone, and with it the workers


@pytest.mark.parametrize("workers", [0, 2])
def test_zip_over_an_inline_loader_gives_every_step(sample_cache: Path, workers: int) -> None:
    """The pattern the loader's own docstring shows, without binding the loader to a name."""
    before = children()
    stream = zip(range(STEPS), make_loader(sample_cache, config(workers)), strict=False)
    steps = [step for step, _ in stream]
    del stream
    assert steps == list(range(STEPS))
    assert children() == before


@pytest.mark.parametrize("workers", [0, 2])
def test_iter_of_an_inline_loader_streams_then_close_stops_it(
    sample_cache: Path, workers: int
) -> None:
    before = children()
    batches = iter(make_loader(sample_cache, config(workers)))
    assert all(len(next(batches)) > 0 for _ in range(STEPS))
    if workers:
        assert len(children() - before) == workers  # still streaming: its workers are alive
    batches.loader.close()
    assert children() == before
    with pytest.raises(LoaderClosed, match="the loader was closed"):
        next(batches)
    with pytest.raises(LoaderClosed):  # and it stays closed
        next(batches)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_closed_mid_iteration_raises_at_the_next_batch(
    sample_cache: Path, workers: int
) -> None:
    loader = make_loader(sample_cache, config(workers))
    batches = iter(loader)
    next(batches)
    loader.close()
    with pytest.raises(LoaderClosed, match="close"):
        next(batches)
    # A new iteration takes over from where the closed one stopped.
    assert len(next(iter(loader))) > 0
    loader.close()


def test_a_second_iterator_closes_the_first(sample_cache: Path) -> None:
    """One live stream at a time: it owns the loader's position."""
    loader = make_loader(sample_cache, config(0))
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(LoaderClosed, match="new iter"):
        next(first)
    assert len(next(second)) > 0
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])  # with workers, the end comes through the hand-off
def test_a_stream_that_ends_is_an_error_not_the_end_of_training(
    sample_cache: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """If the workers' streams ever end, ``next()`` says so instead of StopIteration."""
    real = melcache.loader.workers.worker_stream

    def three_batches(*args, **kwargs):
        stream = real(*args, **kwargs)
        for _ in range(3):
            yield next(stream)

    monkeypatch.setattr(melcache.loader.workers, "worker_stream", three_batches)
    before = children()
    batches = iter(make_loader(sample_cache, config(workers)))
    for _ in range(3 * max(1, workers)):
        next(batches)
    with pytest.raises(LoaderClosed, match="worker processes stopped"):
        next(batches)
    assert children() == before  # the stream's end stopped the workers
