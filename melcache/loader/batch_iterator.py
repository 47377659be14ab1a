"""One pass over a :class:`melcache.loader.make.StreamLoader`: the iterator ``iter(loader)``
returns, and the error an endless stream ends with."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from melcache.loader.batch import Batch
from melcache.loader.stream import Cursor

if TYPE_CHECKING:  # the loader makes its iterators: make.py imports this module
    from melcache.loader.make import StreamLoader


class LoaderClosed(RuntimeError):
    """The loader's endless stream stopped: it was closed, or its workers ended."""


class BatchIterator:
    """One pass over a :class:`StreamLoader`: endless until closed, then raises
    :class:`LoaderClosed` (never ``StopIteration``, which would end a training loop as if
    it had succeeded).

    It holds its loader, so ``for batch in make_loader(...)`` keeps the loader alive for as
    long as it iterates; dropping the iterator frees the stream, whose ``finally`` stops the
    worker processes.
    """

    def __init__(self, loader: StreamLoader, stream: Iterator[tuple[Batch, Cursor]]) -> None:
        self.loader, self._stream = loader, stream
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
        self.loader._consume(cursor)
        return batch

    def close(self, reason: str = "the iterator was closed") -> None:
        """Stop the stream and its worker processes; later ``next()`` calls raise."""
        if self._closed is None:
            self._closed = reason
            self._stream.close()
