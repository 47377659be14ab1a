"""An ordered process-pool map that runs in-process for one worker (easy to debug and test)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from melcache.errors import UserError

Runner = Callable[..., Iterator[Any]]


@contextlib.contextmanager
def ordered_map(
    workers: int, initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()
) -> Iterator[Runner]:
    """Yield ``run(fn, items, chunksize=1)``: results in input order, from ``workers`` processes.

    A worker that dies (kill -9, the OOM killer) becomes a clear error instead of a hang.
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield lambda fn, items, chunksize=1: map(fn, items)
        return
    # fork starts workers without re-importing torch (seconds each under load); it is safe
    # because initializers pin torch to one thread, as DataLoader workers do.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    executor = ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_start_worker,
        initargs=(os.getpid(), initializer, initargs),
    )
    try:
        yield lambda fn, items, chunksize=1: executor.map(fn, items, chunksize=chunksize)
    except BrokenProcessPool:
        raise UserError(
            "a worker process died (killed, or out of memory?); rerun the same command to resume"
        ) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


# glibc's mallopt parameters, and what a build writer sets them to (see keep_freed_memory).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BELOW = 32 << 20  # glibc's largest dynamic mmap threshold: any one utterance's arrays
_TRIM_ABOVE = 512 << 20


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for the next allocation, where it can.

    A build writer allocates and frees the same few large arrays for every utterance (its
    samples, frames, spectrum, mel: 0.1-10 MB each). By default glibc maps each afresh and
    returns it when freed, so every page is faulted in and zeroed again: ~180 page faults
    per utterance and 15 % of the writer's CPU time in the kernel. Kept on the heap, they
    are reused. Elsewhere than glibc this does nothing.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BELOW)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)
    except (OSError, AttributeError):
        pass


def _start_worker(
    parent: int, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]
) -> None:
    # Executor workers block on a queue whose other end siblings keep open: without this, a
    # kill -9 of the build would leave them running (and writing shards) forever.
    if not _kill_me_with_parent():
        threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before we were watching
        os._exit(1)
    if initializer is not None:
        initializer(*initargs)


def _kill_me_with_parent() -> bool:
    """Linux: have the kernel SIGKILL this process the moment its parent dies."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(1, signal.SIGKILL) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.1)
    os._exit(1)
