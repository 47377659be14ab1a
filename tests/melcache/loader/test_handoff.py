"""The iterator's hand-off thread (``melcache/loader/iterator.py``): batches taken ahead of the
training loop are not consumed, so a state saved while they wait resumes at the next batch the
loop would have had; a worker's error reaches the loop in order, with its message; the thread
and the workers stop however the iterator ends, and a process exits without waiting on them.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch

import melcache.loader.workers
from melcache.errors import ShardError
from melcache.loader import LoaderClosed
from melcache.loader.iterator import HANDOFF_DEPTH, BatchIterator, HandOff
from tests.support.helpers import group_gone
from tests.support.loaders import assert_same, loader, run_script, take

OPTIONS = {"num_workers": 2, "batch_frames": 1500, "max_batch_size": 2, "seed": 3}


def children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def handoff_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "melcache-handoff"]


def wait_until_full(batches: BatchIterator) -> None:
    """Until the thread holds ``HANDOFF_DEPTH`` batches the loop has not taken."""
    deadline = time.monotonic() + 30
    while not batches._handoff._queue.full():
        assert time.monotonic() < deadline, "the hand-off thread never filled its queue"
        time.sleep(0.01)


@pytest.mark.parametrize("cut", [1, 7])
def test_a_state_saved_while_batches_wait_ahead_resumes_at_the_loops_next_batch(
    sample_cache: Path, tmp_path: Path, cut: int
) -> None:
    reference = loader(sample_cache, **OPTIONS)
    batches = iter(reference)
    take(batches, cut)
    wait_until_full(batches)  # the thread has taken HANDOFF_DEPTH more from DataLoader
    state = reference.state_dict()
    assert state["batches"] == cut  # what the loop consumed, not what the thread took
    following = take(batches, 3 * HANDOFF_DEPTH)
    reference.close()
    torch.save(state, tmp_path / "state.pt")  # as a checkpoint holds it
    resumed = loader(sample_cache, **OPTIONS)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert_same(take(resumed, len(following)), following)
    resumed.close()


def test_a_worker_error_reaches_the_loop_in_order_then_the_stream_is_closed(
    sample_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each (forked) worker gives 3 batches, then fails as a broken shard does."""
    real = melcache.loader.workers.worker_stream

    def three_then_broken(*args, **kwargs):
        stream = real(*args, **kwargs)
        for _ in range(3):
            yield next(stream)
        raise ShardError("b00-000001.tar: truncated member mel.npy")

    monkeypatch.setattr(melcache.loader.workers, "worker_stream", three_then_broken)
    before = children()
    intact = take(loader(sample_cache, **OPTIONS), 6)
    batches = iter(loader(sample_cache, **OPTIONS))
    assert_same([next(batches) for _ in range(6)], intact)  # round robin: 3 from each worker
    with pytest.raises(ShardError) as failure:
        next(batches)
    # DataLoader puts the worker's traceback in the message; the CLI prints its last line.
    last = str(failure.value).splitlines()[-1]
    assert last == "melcache.errors.ShardError: b00-000001.tar: truncated member mel.npy"
    with pytest.raises(LoaderClosed, match="worker processes stopped"):
        next(batches)
    batches.close()
    assert children() == before and not handoff_threads()


def test_dropping_an_iterator_whose_thread_waits_to_hand_over_stops_it_and_the_workers(
    sample_cache: Path,
) -> None:
    before = children()
    batches = iter(loader(sample_cache, **OPTIONS))
    next(batches)
    wait_until_full(batches)  # the thread now waits in put()
    assert len(children() - before) == 2 and len(handoff_threads()) == 1
    del batches
    assert children() == before and not handoff_threads()


EXITS_WITHOUT_CLOSE = """
import multiprocessing, sys
from melcache.loader import DataConfig, make_loader

batches = iter(make_loader(sys.argv[1], DataConfig(num_workers=2, batch_frames=1500)))
for _ in range(5):
    next(batches)
print(*(p.pid for p in multiprocessing.active_children()), flush=True)
raise RuntimeError("the training loop failed")  # the iterator is still alive, never closed
"""


@pytest.mark.slow  # a subprocess that must exit by itself
def test_a_process_that_fails_mid_stream_exits_at_once_and_leaves_no_worker(
    sample_cache: Path,
) -> None:
    start = time.monotonic()
    done = run_script(EXITS_WITHOUT_CLOSE, str(sample_cache), timeout=120)
    assert time.monotonic() - start < 60
    assert done.returncode == 1
    assert done.stderr.count("Traceback") == 1, done.stderr
    assert done.stderr.strip().endswith("RuntimeError: the training loop failed"), done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    for worker in map(int, done.stdout.split()):
        assert group_gone(worker, timeout=10), f"loader worker {worker} outlived its process"


def test_a_handoff_closed_on_its_own_thread_still_stops_and_closes_its_stream(
    sample_cache: Path,
) -> None:
    """A garbage collection on the hand-off thread may finalise the iterator there."""
    before = children()
    opened = loader(sample_cache, **OPTIONS)
    stream = melcache.loader.workers.worker_batches(opened.spec, opened._positions, 0, False)
    errors: list[Exception] = []

    def close_here() -> None:
        try:
            handoff.close()
        except Exception as exc:  # a thread joining itself
            errors.append(exc)

    handoff = HandOff(stream, on_start=close_here)
    next(handoff)  # the first batch on this thread; the thread starts and closes itself
    handoff._thread.join(timeout=30)
    assert not errors and not handoff._thread.is_alive() and children() == before
    assert stream.gi_frame is None  # closed: its finally stopped the workers
