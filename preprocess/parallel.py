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
    # fork starts workers without re-importing torch (seconds each under load); it is safe
    # because initializers pin torch to one thread, as DataLoader workers do.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(workers, initializer, initargs)
    try:
        yield lambda fn, items, chunksize=1: pool.imap(fn, items, chunksize)
        pool.close()
    finally:
        pool.terminate()
        pool.join()
