"""The loader's worker processes: DataLoader over the workers' streams, their shared-memory
batch rings, and how they live and die with their rank.

Each DataLoader worker plays one logical worker (``melcache/loader/stream.py``'s ``worker_stream``) and
pads its batches' mels straight into its ring (``melcache/loader/transport.py``); DataLoader carries
only the small rest, and the consumer copies each mel out of the ring in order.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
from collections.abc import Generator, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from melcache.errors import UserError
from melcache.loader.batch import Batch, PackedBatch
from melcache.loader.mix import largest_batch
from melcache.loader.spec import Cursor, StreamSpec
from melcache.loader.stream import worker_stream
from melcache.loader.transport import BatchRing

logger = logging.getLogger(__name__)

# Batches each worker keeps ready: a batch is ~1 MB-10 MB and costs one shard read at most,
# 4 hides a shard boundary without holding much memory.
PREFETCH_FACTOR = 4
# prefetch_factor + 1 slots suffice (see melcache/loader/transport.py); one more for margin.
RING_SLOTS = PREFETCH_FACTOR + 2


class WorkerDataset(IterableDataset):
    """Runs in each DataLoader worker: picks its logical worker and streams from its position.

    DataLoader worker ``i`` plays logical worker ``(i + first) % n``: DataLoader always asks
    its worker 0 first, while a restored stream must continue with whichever worker's turn
    it was.
    """

    def __init__(
        self,
        spec: StreamSpec,
        positions: list[list[tuple[int, ...]]],
        batches: int,
        rings: list[BatchRing],
    ) -> None:
        self.spec, self.positions, self.batches, self.rings = spec, positions, batches, rings

    def __iter__(self) -> Iterator[tuple[PackedBatch, Cursor]]:
        info, count = get_worker_info(), self.spec.workers_per_rank
        first = self.batches % count  # whose turn it is: DataLoader asks its worker 0 first
        worker = ((0 if info is None else info.id) + first) % count
        step = self.batches // count + (1 if worker < first else 0)  # its batches so far
        stream = worker_stream(self.spec, worker, step, self.positions[worker], self.rings[worker])
        return StaysFailed(stream)


class StaysFailed:
    """A worker's stream that, once it has raised, raises the same error for every later batch.

    A generator that raised is finished, and DataLoader gives a finished worker's share of
    batches to the others at once; they would then run more batches ahead than their rings
    hold, and the consumer would stop on a ring overrun before it reached, in order, the error
    that names the shard.
    """

    def __init__(self, stream: Iterator[tuple[PackedBatch, Cursor]]) -> None:
        self.stream = stream
        self.error: Exception | None = None

    def __iter__(self) -> StaysFailed:
        return self

    def __next__(self) -> tuple[PackedBatch, Cursor]:
        if self.error is not None:
            raise self.error
        try:
            return next(self.stream)
        except StopIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise


def _keep(item: Any) -> Any:
    """DataLoader ``collate_fn`` for ready-made batches (module level: picklable)."""
    return item


def worker_batches(
    spec: StreamSpec, positions: list[list[tuple[int, ...]]], batches: int, pin_memory: bool
) -> Generator[tuple[Batch, Cursor], None, None]:
    """One rank's batches from DataLoader workers, each with the worker position after it.
    Its first batch is taken on the thread that forks the workers, the rest on the iterator's
    hand-off thread (``melcache/loader/iterator.py``), which also closes it."""
    data = spec.data
    rings = [
        BatchRing(RING_SLOTS, largest_batch(spec.sources, data) * spec.n_mels)
        for _ in range(spec.workers_per_rank)
    ]
    dataset = WorkerDataset(spec, positions, batches, rings)
    loader = DataLoader(
        dataset,
        batch_size=None,  # the dataset yields whole batches
        collate_fn=_keep,
        num_workers=data.num_workers,
        # Pinning happens as the mel is copied out of the ring, not in DataLoader's
        # pin thread: one copy instead of two.
        pin_memory=False,
        persistent_workers=data.num_workers > 0,
        prefetch_factor=PREFETCH_FACTOR if data.num_workers > 0 else None,
        # DataLoader draws its workers' base seed from this generator; the default would
        # consume the global torch RNG, which belongs to the model (dropout on resume).
        generator=torch.Generator().manual_seed(spec.seed),
        worker_init_fn=_leave_process_group,
    )
    owner = os.getpid()
    batches = iter(loader)
    try:
        for packed, cursor in batches:
            mel = rings[cursor.worker].take(packed.seq, packed.mel_shape, pin_memory)
            yield packed.unpack(mel, pin_memory), cursor
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)
        # Only the process that started the workers stops them: a forked child (the next
        # loader's worker) inherits this generator and may finalise it.
        if shutdown is not None and os.getpid() == owner:
            shutdown()


def ring_bytes(spec: StreamSpec) -> int:
    """Shared memory one rank's batch rings take: a ring of float16 slots per worker, each
    the size of the largest batch."""
    return (
        spec.workers_per_rank
        * RING_SLOTS
        * largest_batch(spec.sources, spec.data)
        * spec.n_mels
        * 2
    )


def check_shared_memory(spec: StreamSpec, folder: str = "/dev/shm") -> None:
    """Refuse to start when /dev/shm cannot hold the rings (Docker's default is 64 MB), rather
    than fail at the first batch with a bus error."""
    if not os.path.isdir(folder):
        return  # not Linux: torch's shared memory lives elsewhere
    needed, free = ring_bytes(spec), shutil.disk_usage(folder).free
    if needed > free:
        raise UserError(
            f"the loader needs {needed / 2**20:.0f} MiB of shared memory per rank for its batch "
            f"rings, {folder} has {free / 2**20:.0f} MiB free: give the container more "
            "(docker run --shm-size=8g, or --ipc=host), or lower data.batch_frames or "
            "data.num_workers"
        )


def _leave_process_group(worker_id: int) -> None:
    """torchrun signals each rank's whole process group: a worker in its own group outlives
    the SIGTERM so the rank can take its checkpoint, and the rank still stops it after.

    Out of the group, a worker would also outlive a rank killed outright (``kill -9``, the
    out-of-memory killer) wherever it blocks (a hung network read) where DataLoader's own
    check for a dead parent never runs; so on Linux the kernel kills it with its parent
    (strictly, with the thread that started iterating the loader: keep that thread alive).
    """
    os.setpgrp()
    if not sys.platform.startswith("linux"):
        return
    # PR_SET_PDEATHSIG (1 in <linux/prctl.h>) has no Python binding: ctypes reaches prctl(2).
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning(
            "loader worker cannot ask to die with its rank: errno %d", ctypes.get_errno()
        )
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(0)  # the rank died before the request above: nobody is left to serve
