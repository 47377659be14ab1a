"""Streaming loader: a melcache cache as an endless stream of padded batches, one per rank.

Usage::

    from melcache.loader import DataConfig, make_loader
    loader = make_loader("shards/", DataConfig(batch_frames=20_000), rank=rank, world_size=world)
    loader.load_state_dict(saved)          # optional, before iterating
    for step, batch in zip(range(steps), loader):
        batch = batch.to(device)           # non-blocking: the host copy is pinned with CUDA
        ...
        saved = loader.state_dict()        # what *this loop* has consumed, not the prefetch

A :class:`Batch` holds ``mel`` float16 ``[B, T, n_mels]`` (T a multiple of ``pad_multiple``,
padded with ``ln(log_floor)``, silence in log space), ``mel_lengths`` ``[B]``, ``text`` int64
``[B, L]`` (UTF-8 bytes + 1 by default: vocabulary 257, 0 = padding), ``text_lengths``,
``keys``, ``speaker`` (``None`` where unknown), ``bucket`` and ``extras`` (the per-utterance
fields ``data.extras`` asks for: ``melcache/loader/batch.py``). All samples of a batch come from
one length bucket ``b`` (one shard, or two neighbours of a unit of small shards); ``B × T <= batch_frames`` (one number, or the table's
entry for ``b``) and ``B <= max_batch_size``.

Splitting: the schedule (``melcache/loader/schedule.py``) picks each batch's sub-stream (one length
bucket of one cache; with ``sync_buckets = false`` one whole cache, the stream of earlier
releases) from ``(seed, step, rank, worker)``: bucket-synchronous across ranks, caches at
their weights. Each sub-stream reads every shard once per epoch across the job's
``world_size × max(1, num_workers)`` workers and never runs dry (no DDP hang).

Resume: DataLoader hands out its workers' batches round-robin, and each batch carries its
worker's position after it in its sub-stream (``melcache/loader/stream.py``); the loader records
it as the batch is handed to the caller, never as the iterator's hand-off thread takes it
ahead (``melcache/loader/iterator.py``): a state describes exactly the batches the loop
consumed. A restore re-reads at most one shard (or unit) per worker and sub-stream, skipping
its consumed batches without decoding a mel. A rank's own state resumes the same job batch for batch (``melcache/loader/resume/same_job.py``); the list of every rank's
state resumes a job of another world size, worker count or mix (``melcache/loader/resume/elsewhere.py``);
a state of another seed or batch budget is refused, naming the key.

Faults: ``on_error="raise"`` stops at the first unreadable, truncated or (unless
``shard_check="off"``) altered shard with a :class:`ShardError` naming it, in any epoch: every
read is checked (``melcache.reader.ShardCheck``); ``"skip"`` logs each such shard once, records
it in ``loader.skipped_shards`` and goes on, and still raises if no shard can be read at all
rather than spin. Only ``mel.npy`` and ``json`` members are read, never with pickle.

Lifetime: an iterator holds its loader (the loader holds it only weakly), so an inline
``for batch in make_loader(...)`` streams for as long as it is iterated; the workers stop when
the last iterator is dropped or at ``close()``. The stream is endless by contract: once
stopped, ``next()`` raises :class:`LoaderClosed` saying why, never ``StopIteration``.

Throughput: workers (``melcache/loader/workers.py``) pad mels straight into shared-memory ring
slots (``melcache/loader/transport.py``, each the size of the largest batch any bucket can
make) and DataLoader carries only the small rest; the consumer copies each mel out, into
pinned memory when ``pin_memory`` (default: CUDA available), on the iterator's hand-off
thread, a few batches ahead, so the training loop's ``next()`` is a queue get.
``benchmarks/loader/loader_bench.py`` measures it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from melcache.features import FeatureConfig
from melcache.loader.balance import epoch_report
from melcache.loader.batch import utf8_tokens
from melcache.loader.data_config import DataConfig
from melcache.loader.iterator import HANDOFF_DEPTH, BatchIterator, LoaderClosed
from melcache.loader.mix import (
    CacheArg,
    OpenedMix,
    check_disk_cache,
    check_extras,
    check_layout,
    open_mix,
    whole_shared_reads,
    with_choice,
    with_fields,
)
from melcache.loader.resume import (
    ELASTIC_VERSIONS,
    STATE_VERSION,
    LoaderStateError,
    Resumed,
    restore,
    resume_elsewhere,
    saved_deals,
    state_cut,
    state_identity,
    stream_keys,
)
from melcache.loader.schedule import SubStream, make_schedule, substreams
from melcache.loader.sequence import sequence_tops, text_tops, with_text
from melcache.loader.spec import Cursor, StreamSpec
from melcache.loader.stream import progress
from melcache.loader.workers import check_shared_memory, worker_batches
from melcache.sections import require

__all__ = ["BatchIterator", "LoaderClosed", "LoaderStateError", "StreamLoader", "make_loader"]

logger = logging.getLogger(__name__)


class StreamLoader:
    """Endless iterable of :class:`Batch` for one rank, with exact save/restore.

    Build it with :func:`make_loader`. Attributes: ``spec`` (everything the workers are
    given, the :class:`DataConfig` included), ``features`` (the caches' one
    :class:`FeatureConfig`), ``index`` (the first cache's parsed ``index.json``; ``indexes``:
    all), ``weights`` (each cache's share of the frames), ``skipped_shards`` (shard name →
    reason, each logged once, under ``on_error="skip"``), ``disk_cache`` (``data.cache_dir``'s
    hits and misses, or ``None``).
    """

    def __init__(self, spec: StreamSpec, mix: OpenedMix, pin_memory: bool) -> None:
        self.spec, self.pin_memory, self._mix = spec, pin_memory, mix
        self.features, self.indexes, self.weights = mix.features, mix.indexes, mix.weights
        self.index = mix.indexes[0]
        self.skipped_shards: dict[str, str] = {}
        # data.cache_dir's hits and misses by this rank's workers (None: no disk cache)
        self.disk_cache = {"hits": 0, "misses": 0} if spec.data.cache_dir else None
        self.resume_changes: tuple[str, ...] = ()  # what the last load_state_dict changed
        start = [spec.start(sub) for sub in spec.subs]
        self._positions = [list(start) for _ in range(spec.workers_per_rank)]
        self._next_worker = 0  # logical worker whose batch the consumer gets next
        self._batches = 0
        self._active: weakref.ref[BatchIterator] | None = None
        self._reported = -1  # the last epoch heard() reported

    @property
    def epoch(self) -> int:
        """Epochs every worker of this rank has finished in every sub-stream (each runs
        through its epochs by itself)."""
        return min(int(e) for worker in self.progress() for e in worker)

    def epochs(self) -> dict[str, float]:
        """Epochs consumed so far of each cache, by its location: per bucket sub-stream the
        batches the job has read of it ÷ its batches per epoch (the job's other slots keep the
        pace of this rank's workers, the schedule being the same), the frame-weighted mean
        over the cache's sub-streams; a whole-cache stream: where the workers stand in it. Not
        a slot's place in the sequence, which in its block of an epoch counts one slot's
        batches, not the job's."""
        progress, spec, workers = self.progress(), self.spec, len(self._positions)
        out: dict[str, list[float]] = {}
        for u, sub in enumerate(spec.subs):
            if sub.bucket >= 0:
                taken = sum(worker[u][0] for worker in self._positions) / workers
                mean = spec.deal(u).read_by_job(spec.num_slots, taken) / sub.per_epoch
            else:
                mean = sum(worker[u] for worker in progress) / workers
            share = out.setdefault(spec.sources[sub.source].location, [0.0, 0.0])
            share[0] += mean * sub.frames
            share[1] += sub.frames
        return {where: round(total / frames, 4) for where, (total, frames) in out.items()}

    def heard(self) -> dict[str, float]:
        """Under ``data.where`` or ``[data.balance]``, once per epoch finished since the last
        call: what that epoch dealt against the target
        (:func:`~melcache.loader.balance.epoch_report`); else nothing."""
        finished = self.epoch - 1
        if not self._mix.chosen or finished <= self._reported:
            return {}
        self._reported = finished
        spec = self.spec
        return epoch_report(spec.subs, self._mix.chosen, self.weights, spec.seed, finished)

    def progress(self) -> list[list[float]]:
        """Per worker and sub-stream: epochs of it behind the worker's next batch."""
        return progress(self.spec, self._positions)

    def __iter__(self) -> BatchIterator:
        self.close()  # one live stream at a time: it owns the state
        positions = [list(p) for p in self._positions]
        stream = worker_batches(self.spec, positions, self._batches, self.pin_memory)
        # Without worker processes the stream reads in next(), as DataLoader's own does.
        ahead = HANDOFF_DEPTH if self.spec.data.num_workers > 0 else 0
        iterator = BatchIterator(
            self, stream, self._consume, ahead, _pinning_device(self.pin_memory)
        )
        # Held weakly: the iterator keeps this loader alive, not the other way round, so the
        # workers stop as soon as the last iterator is dropped, whether or not the loader is.
        self._active = weakref.ref(iterator)
        return iterator

    def close(self) -> None:
        """Stop the running stream, if any, and its worker processes; its iterator then
        raises :class:`LoaderClosed` instead of giving more batches."""
        iterator = self._active() if self._active is not None else None
        self._active = None
        if iterator is not None:
            iterator.close("the loader was closed (close(), load_state_dict() or a new iter())")

    def _consume(self, cursor: Cursor) -> None:
        if cursor.worker != self._next_worker:  # DataLoader broke its round-robin promise
            raise RuntimeError(
                f"batch from worker {cursor.worker}, expected worker {self._next_worker}"
            )
        self._positions[cursor.worker][cursor.stream] = cursor.after
        self._next_worker = (cursor.worker + 1) % self.spec.workers_per_rank
        self._batches += 1
        if self.disk_cache is not None:
            self.disk_cache["hits"] += cursor.disk[0]
            self.disk_cache["misses"] += cursor.disk[1]
        for name, reason in cursor.skipped:
            if name not in self.skipped_shards:
                logger.warning("skipping shard %s: %s", name, reason)
                self.skipped_shards[name] = reason

    def state_dict(self) -> dict[str, Any]:
        """What the consumer has taken so far; plain ints/strs/lists/dicts, so it loads
        with ``torch.load(weights_only=True)``: per worker and sub-stream a position of one
        integer (a bucket) or three (a whole cache), then the real frames taken from it."""
        return {
            "version": STATE_VERSION,
            **self._identity(),
            "next_worker": self._next_worker,
            "batches": self._batches,
            "positions": [[list(p) for p in worker] for worker in self._positions],
            "skipped_shards": dict(self.skipped_shards),
            "streams": stream_keys(self.spec),
            "deals": saved_deals(self.spec),
        }

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue after the last batch the saved loader (or job) handed out.

        ``state``: this rank's state of the same job (batch for batch, as before), or the
        list of every rank's state of a job of any size, worker count or mix, in rank order
        (``melcache/loader/resume/elsewhere.py``: what the old job left unread of each sub-stream's
        epoch in progress is read once, then epochs go on as in a fresh job; an added cache
        starts at its epoch 0). ``resume_changes`` then says what changed. Call before
        iterating (a running iterator stops). Raises :class:`UserError` naming the key when
        the state cannot continue here (another seed or batch budget, a cache whose content
        changed without ``data.allow_data_change``). A state of an earlier release (version 1
        or 2) continues a one-cache loader with ``data.sync_buckets = false``.
        """
        self.close()
        self.resume_changes: tuple[str, ...] = ()
        first = state if isinstance(state, Mapping) else next(iter(state), {})
        if isinstance(first, Mapping):  # else refused below, naming what was given
            self._make_batches_of(first)
        if isinstance(state, Mapping):
            one_rank = state.get("world_size") == 1 and state.get("version") in ELASTIC_VERSIONS
            if not (one_rank and self._differs(state)):
                return self._continue(restore(self.spec, self._identity(), state))
            state = [state]
        states = list(state)
        mine = states[self.spec.rank] if len(states) > self.spec.rank else {}
        if len(states) == self.spec.world_size and not self._differs(mine):
            return self._continue(restore(self.spec, self._identity(), mine))
        allow = self.spec.data.allow_data_change
        return self._continue(resume_elsewhere(self.spec, self._identity(), states, allow))

    def _continue(self, resumed: Resumed) -> None:
        """Take up the positions, deals and counts a restore found."""
        self.spec = dataclasses.replace(self.spec, deals=resumed.deals)
        self._positions = resumed.positions
        self._batches = resumed.batches
        self._next_worker = resumed.batches % self.spec.workers_per_rank
        self.skipped_shards = resumed.skipped_shards
        self.resume_changes = resumed.changes

    def _make_batches_of(self, state: Mapping[str, Any]) -> None:
        """Cut batches as ``state``'s loader did (:func:`~melcache.loader.resume.elsewhere.state_cut`),
        so a state of an earlier release still continues batch for batch."""
        data = self.spec.data
        plan, split, attention = state_cut(state, data)
        if (plan, split, attention) == (self.spec.plan, data.split, data.attention):
            return
        data = dataclasses.replace(data, sync_split=split, attention_frames=attention)
        self.spec = dataclasses.replace(
            self.spec, data=data, plan=plan, **schedules(self._mix, data, self.spec.seed)
        )
        check_disk_cache(self._mix.sources, self.spec.subs, data)  # as a fresh stream's
        start = [self.spec.start(sub) for sub in self.spec.subs]
        self._positions = [list(start) for _ in range(self.spec.workers_per_rank)]

    def _differs(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` (version 3 or 4) was saved by another job layout or mix."""
        return state.get("version") not in ELASTIC_VERSIONS or any(
            state.get(key) != value for key, value in self._identity().items()
        )

    def _identity(self) -> dict[str, Any]:
        """What this loader's states are valid for (``melcache/loader/resume/same_job.py``)."""
        return state_identity(self.spec, self.weights)


def make_loader(
    cache: CacheArg,
    data: DataConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    expect_features: Mapping[str, Any] | FeatureConfig | None = None,
    tokenizer: Callable[[str], list[int]] | None = None,
    pin_memory: bool | None = None,
) -> StreamLoader:
    """Open ``cache`` as rank ``rank``'s endless stream: one location (folder or URL prefix),
    a list of them (a mix weighted by ``data.mix``, else by hours) or a mapping of locations
    to weights (``{"en/": 0.7, "zh/": 0.3}``: shares of the frames), ``^ data.mix_temperature``.

    ``data`` is the trainer's ``[data]`` table (:class:`DataConfig`), passed on whole to the
    workers: ``batch_frames`` bounds ``B × T`` with ``T`` the padded length (a multiple of
    ``pad_multiple``), ``max_batch_size`` bounds ``B``, ``sync_buckets`` keeps the ranks of a
    step in one bucket. ``tokenizer`` maps text to ids with 0 kept free for padding
    (default: UTF-8 bytes + 1, vocabulary 257). ``pin_memory`` defaults to whether CUDA is
    available. Raises :class:`UserError` for a bad argument, an unfinished cache, a feature
    mismatch (with the model or between caches), a ``data.extras`` field a cache lacks, a
    budget below the longest utterance, or,
    with ``sync_buckets = false``, fewer shards than ``world_size × max(1, num_workers)``.
    """
    require(_is_int(world_size) and world_size >= 1, "loader world_size", world_size, "an int ≥ 1")
    require(
        _is_int(rank) and 0 <= rank < world_size, "loader rank", rank, f"in 0..{world_size - 1}"
    )
    require(_is_int(seed) and seed >= 0, "loader seed", seed, "a non-negative integer")
    require(isinstance(data, DataConfig), "loader data", data, "a DataConfig")
    require(tokenizer is None or callable(tokenizer), "loader tokenizer", tokenizer, "a callable")
    require(
        data.sequence == "text,frames" or data.batch_text == 0,
        "data.batch_text",
        data.batch_text,
        '0 unless data.sequence = "text,frames", or the model declares it (the text is '
        "budgeted on its own only there)",
    )
    tokenizer = tokenizer or utf8_tokens
    opened = with_choice(open_mix(cache, data, expect_features), data)
    texts = with_text(opened.sources, opened.indexes, data, tokenizer)  # data.sequence
    opened = dataclasses.replace(opened, sources=texts)
    mix = with_fields(opened, data, "data.fields / data.field_provenance")
    check_extras(mix, data.extras)
    num_slots = world_size * max(1, data.num_workers)
    check_layout(mix.sources, data, num_slots)
    subs = planned_substreams(mix, data)
    check_disk_cache(mix.sources, subs, data)
    if rank == 0:  # one line per job, not per rank
        for line in whole_shared_reads(mix.sources, subs, data, num_slots):
            logger.warning(line)
    spec = StreamSpec(
        sources=mix.sources,
        **schedules(mix, data, seed, subs),
        data=data,
        rank=rank,
        world_size=world_size,
        seed=seed,
        n_mels=mix.features.n_mels,
        pad_value=math.log(mix.features.log_floor),
        tokenizer=tokenizer,
    )
    check_shared_memory(spec)
    return StreamLoader(spec, mix, _resolve_pin_memory(pin_memory))


def schedules(
    mix: OpenedMix, data: DataConfig, seed: int, subs: tuple[SubStream, ...] | None = None
) -> dict[str, Any]:
    """A stream's sub-streams and the schedules of its mix's phases, as ``StreamSpec`` takes
    them; ``subs``: the sub-streams where the caller has computed them already."""
    if subs is None:
        subs = planned_substreams(mix, data)
    return {
        "subs": subs,
        "schedule": make_schedule(subs, mix.weights, seed=seed, sync=data.sync_buckets),
        "phases": tuple(
            (start, make_schedule(subs, weights, seed=seed, sync=data.sync_buckets))
            for start, weights in mix.phases
        ),
    }


def planned_substreams(mix: OpenedMix, data: DataConfig) -> tuple[SubStream, ...]:
    """The mix's sub-streams, counted on what ``data.sequence`` declares (each shard's
    longest ``text + frames``, or its longest text beside its frames)."""
    shards = [s.shards for s in mix.sources]
    tops, texts = sequence_tops(mix.sources, data), text_tops(mix.sources, data)
    return substreams(shards, data, data.sync_buckets, mix.chosen, tops, texts)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pinning_device(pin_memory: bool) -> Callable[[], None] | None:
    """What the hand-off thread runs first when it pins memory: the caller's CUDA device made
    its own, or pinning would open a context on device 0 (a new thread's) on every rank."""
    if not pin_memory:
        return None
    device = torch.cuda.current_device()
    return lambda: torch.cuda.set_device(device)


def _resolve_pin_memory(requested: bool | None) -> bool:
    """Pin when CUDA is there to copy to; like DataLoader, warn and skip it otherwise."""
    if requested and not torch.cuda.is_available():
        logger.warning("pin_memory=True without CUDA: batches stay in pageable memory")
        return False
    return torch.cuda.is_available() if requested is None else requested
