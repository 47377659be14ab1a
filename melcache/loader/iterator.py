"""One pass over a :class:`melcache.loader.stream_loader.StreamLoader`: the iterator ``iter(loader)``
returns, the thread that takes its batches ahead of the training loop, and the error an
endless stream ends with. The iterator knows nothing of its loader: it reports each consumed
batch's :class:`Cursor` through a callback."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Generic, Protocol, TypeVar

from melcache.loader.batch import Batch
from melcache.loader.spec import Cursor

logger = logging.getLogger(__name__)

# Batches taken ahead of the consumer: a step's micro-batches come in a burst (grad_accum of
# them), and each one waiting here is a copy of ~1-10 MB.
HANDOFF_DEPTH = 4
# How long close() waits for the thread: it must first finish taking the batch it is waiting
# for, then stop the workers (DataLoader gives each 5 s to exit).
CLOSE_TIMEOUT_S = 15.0

Item = TypeVar("Item")


class Closable(Protocol):
    """What an iterator keeps alive: its loader, seen only as something that closes."""

    def close(self) -> None: ...


class LoaderClosed(RuntimeError):
    """The loader's endless stream stopped: it was closed, or its workers ended."""


class _End:
    """What the hand-off thread sends last: the error its stream raised, or ``None`` when
    the stream simply ended."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class HandOff(Generic[Item]):
    """Takes ``stream``'s items on a thread of its own, up to ``depth`` ahead of ``next()``.

    Taking a batch from DataLoader (its result queue, unpickling the small rest, copying the
    mel out of its ring slot) cost the training thread 0.7-2 ms a batch on busy cores, mostly
    waiting for the GIL; here it happens while the step computes, and ``next()`` is a queue
    get. The items waiting here are not consumed: whoever counts progress counts as ``next()``
    returns, never as the thread takes an item, so a checkpoint describes what the training
    loop used. The first item is taken on the caller's thread, where DataLoader forks its
    workers: a worker dies with the thread that forked it (``melcache/loader/workers.py``).
    ``on_start`` runs first on the thread (CUDA: the device to pin memory for). With ``depth``
    0 there is no thread: every item is taken on the caller's (a loader without worker
    processes, which reads and pads in ``next()`` as DataLoader's ``num_workers=0`` does).
    """

    def __init__(
        self,
        stream: Generator[Item, None, None],
        depth: int = HANDOFF_DEPTH,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._stream, self._on_start = stream, on_start
        self._depth = depth
        self._queue: queue.Queue[Item | _End] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ended = False
        self._owner = os.getpid()

    def __next__(self) -> Item:
        if self._depth == 0:
            return next(self._stream)
        if self._thread is None:
            item = next(self._stream)  # on the caller's thread: DataLoader forks here
            self._thread = threading.Thread(target=self._run, name="melcache-handoff", daemon=True)
            self._thread.start()
            return item
        if self._ended:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self._ended = True
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def _run(self) -> None:
        try:
            if self._on_start is not None:
                self._on_start()
            for item in self._stream:
                self._queue.put(item)  # waits while the consumer has ``depth`` in hand
                if self._stop.is_set():
                    return
            self._queue.put(_End(None))
        except BaseException as exc:  # whatever ends the thread must reach the consumer
            self._queue.put(_End(exc))
        finally:
            self._stream.close()  # the stream's own ``finally`` (stopping the workers) runs here

    def close(self) -> None:
        """Stop the thread and the stream, dropping the items taken ahead. Only the process
        that made this hand-off acts: a forked child (a loader worker) inherits it and may
        finalise it, but not its thread."""
        if os.getpid() != self._owner:
            return
        if self._thread is None:
            self._stream.close()
            return
        self._stop.set()
        if threading.current_thread() is self._thread:
            # A garbage collection on the thread finalised the iterator: the thread cannot
            # join itself, but with room made for its put it sees the stop and ends.
            self._drain()
            return
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._drain()  # a thread waiting to put an item sees the stop after the put
            self._thread.join(0.05)
        self._drain()
        if self._thread.is_alive():  # waiting on a worker that is stuck (a dead mount)
            logger.warning(
                "the loader's hand-off thread did not stop within %.0f s: a worker is stuck; "
                "its workers stop with this process",
                CLOSE_TIMEOUT_S,
            )

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass


class BatchIterator:
    """One pass over a loader's stream: endless until closed, then raises
    :class:`LoaderClosed` (never ``StopIteration``, which would end a training loop as if
    it had succeeded).

    The stream's batches are taken ``ahead`` by a :class:`HandOff` thread; ``consumed`` is told
    each batch's cursor as it is handed out, not as it is taken ahead. It holds its
    ``loader``, so ``for batch in make_loader(...)`` keeps the loader alive for as long as it
    iterates; dropping the iterator stops the thread, and the stream's ``finally`` the worker
    processes.
    """

    def __init__(
        self,
        loader: Closable,
        stream: Generator[tuple[Batch, Cursor], None, None],
        consumed: Callable[[Cursor], None],
        ahead: int = HANDOFF_DEPTH,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self.loader, self._consumed = loader, consumed
        self._handoff = HandOff(stream, ahead, on_start)
        # Not a __del__: the thread must stop however the iterator goes, cycles included.
        self._finalizer = weakref.finalize(self, self._handoff.close)
        self._closed: str | None = None

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._closed is not None:
            raise LoaderClosed(f"no more batches: {self._closed}")
        try:
            batch, cursor = next(self._handoff)
        except StopIteration:
            self.close("its worker processes stopped before the endless stream could end")
            raise LoaderClosed(f"no more batches: {self._closed}") from None
        self._consumed(cursor)
        return batch

    def close(self, reason: str = "the iterator was closed") -> None:
        """Stop the stream and its worker processes; later ``next()`` calls raise."""
        if self._closed is None:
            self._closed = reason
            self._finalizer()
