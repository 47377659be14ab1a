"""An ordered process-pool map that runs in-process for one worker (easy to debug and test)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

Runner = Callable[..., Iterator[Any]]


@contextlib.contextmanager
def ordered_map(
    workers: int, initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()
) -> Iterator[Runner]:
    """Yield ``run(fn, items, chunksize=1)``: results in input order, from ``workers`` processes."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield lambda fn, items, chunksize=1: map(fn, items)
        return
    # spawn: a forked child of a process that already ran torch/OpenMP code can deadlock.
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer, initargs)
    try:
        yield lambda fn, items, chunksize=1: pool.imap(fn, items, chunksize)
        pool.close()
    finally:
        pool.terminate()
        pool.join()
