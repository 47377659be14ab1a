"""One pass over a :class:`melcache.loader.stream_loader.StreamLoader`: the iterator ``iter(loader)``
returns, and the error an endless stream ends with. The iterator knows nothing of its
loader: it reports each consumed batch's :class:`Cursor` through a callback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from melcache.loader.batch import Batch
from melcache.loader.spec import Cursor


class Closable(Protocol):
    """What an iterator keeps alive: its loader, seen only as something that closes."""

    def close(self) -> None: ...


class LoaderClosed(RuntimeError):
    """The loader's endless stream stopped: it was closed, or its workers ended."""


class BatchIterator:
    """One pass over a loader's stream: endless until closed, then raises
    :class:`LoaderClosed` (never ``StopIteration``, which would end a training loop as if
    it had succeeded).

    ``consumed`` is told each batch's cursor as it is handed out. It holds its ``loader``, so
    ``for batch in make_loader(...)`` keeps the loader alive for as long as it iterates;
    dropping the iterator frees the stream, whose ``finally`` stops the worker processes.
    """

    def __init__(
        self,
        loader: Closable,
        stream: Iterator[tuple[Batch, Cursor]],
        consumed: Callable[[Cursor], None],
    ) -> None:
        self.loader, self._stream, self._consumed = loader, stream, consumed
        self._closed: str | None = None

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._closed is not None:
            raise LoaderClosed(f"no more batches: {self._closed}")
        try:
            batch, cursor = next(self._stream)
        except StopIteration:
            self.close("its worker processes stopped before the endless stream could end")
            raise LoaderClosed(f"no more batches: {self._closed}") from None
        self._consumed(cursor)
        return batch

    def close(self, reason: str = "the iterator was closed") -> None:
        """Stop the stream and its worker processes; later ``next()`` calls raise."""
        if self._closed is None:
            self._closed = reason
            self._stream.close()
