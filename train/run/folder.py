"""The run folder ``--out``: usable, and owned by this job alone, before step 1.

Two trainers writing one folder delete each other's checkpoints and interleave their
metrics; a folder that is a file or read-only would fail at the first checkpoint, after the
work. Rank 0 checks and locks it (``OUT/trainer.lock``, held for the whole run: see
``melcache/host/lock.py``) and tells every rank the outcome, so that all stop together, before
any of them builds a model, and none waits in a collective for a rank that left.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from melcache.errors import UserError
from melcache.host.lock import FolderLock
from train.parallel.env import Env

LOCK_NAME = "trainer.lock"


@contextlib.contextmanager
def owned_run_folder(out: Path, env: Env) -> Iterator[None]:
    """Hold ``out`` for this job while the block runs; :class:`UserError` on every rank when
    rank 0 cannot use it (a file, read-only, or another trainer's)."""
    lock, problem = None, ""
    if env.is_main:
        try:
            lock = _claim(Path(out))
        except UserError as exc:
            problem = str(exc)
    if env.distributed:  # every rank learns rank 0's outcome here, before any other collective
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem:
        raise UserError(problem if env.is_main else f"rank 0 cannot start the run: {problem}")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _claim(out: Path) -> FolderLock:
    """Lock ``out`` (made if missing) and prove that checkpoints can be written under it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"--out {out} is a file (or lies under one), not a run folder") from None
    except OSError as exc:
        raise UserError(f"--out {out} cannot be made: {exc.strerror or exc}") from None
    try:
        lock = FolderLock(out / LOCK_NAME, "a training run")
    except OSError as exc:
        raise UserError(f"--out {out} is not writable: {exc.strerror or exc}") from None
    try:
        (out / "checkpoints").mkdir(exist_ok=True)
        with tempfile.TemporaryFile(dir=out / "checkpoints"):
            pass  # a file can be made where checkpoints go
    except OSError as exc:
        lock.release()
        raise UserError(f"--out {out}: checkpoints cannot be written in it: {exc}") from None
    return lock
