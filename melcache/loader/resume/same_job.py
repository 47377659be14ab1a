"""Resuming in the same job: one rank's own loader state, continued batch for batch.

A state is valid only for the job that saved it (:func:`state_identity`: its layout, seed,
caches, mix and batch budget); this module checks that and reads its positions back,
earlier releases' versions included. The list of every rank's state of another job goes to
``melcache/loader/resume/elsewhere.py`` instead; both read the state of ``state.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from melcache.batch_plans import COST_CUT_PLAN
from melcache.loader.balance import selection_key
from melcache.loader.mix import content_digest
from melcache.loader.resume.state import (
    ELASTIC_VERSIONS,
    STATE_KEYS,
    LoaderStateError,
    Resumed,
    parse_deals,
)
from melcache.loader.sequence import FRAMES, TWO_AXES, tokenizer_fingerprint
from melcache.loader.spec import StreamSpec

STATE_VERSION = 4
# Version 1 (before sub-streams) holds one (epoch, shard, batch) per worker: the whole-cache
# stream of data.sync_buckets = false over one cache, which continues it exactly.
WHOLE_CACHE_VERSION = 1
# Version 2 (this release before units of shards and the frames each position ends with now)
# continues exactly only where neither changed the stream: one cache, sync_buckets = false.
NO_FRAMES_VERSION = 2
# Version 3 (this release before resumes on another job size or mix) lacks the sub-streams'
# names and deals: every deal fresh, the caches and mix this loader's.


def state_identity(spec: StreamSpec, weights: Sequence[float]) -> dict[str, Any]:
    """What a state is only valid for: job layout, seed, caches and mix (``weights``, the
    caches' frame shares), and budget."""
    data = spec.data
    digests = [content_digest(source.shards) for source in spec.sources]
    return {
        "rank": spec.rank,
        "world_size": spec.world_size,
        "workers_per_rank": spec.workers_per_rank,
        "seed": spec.seed,
        "batch_frames": data.batch_frames,
        "max_batch_size": data.max_batch_size,
        "pad_multiple": data.pad_multiple,
        "cache_digest": digests[0] if len(digests) == 1 else digests,
        "sync_buckets": data.sync_buckets,
        "mix": [round(w, 9) for w in weights],
        **({"mix_schedule": _mix_schedule(spec)} if spec.phases else {}),
        # None where 1 (or unused): the states of earlier releases hold no such keys, and
        # match them.
        "sync_split": data.split if data.split != 1 else None,
        "batch_plan": spec.plan if spec.plan != 1 else None,
        "attention_frames": data.attention if spec.plan >= COST_CUT_PLAN else None,
        # None: every utterance once
        "selection": selection_key(data.where, data.balance, spec.selection_versions),
        # None for frames (states of earlier releases hold no such key): text lengths change
        # the counts, so a state holds the sequence and its tokenizer's fingerprint.
        "sequence": _sequence(spec),
    }


def _sequence(spec: StreamSpec) -> str | None:
    """``data.sequence`` as a state holds it: ``None`` for frames, else with the tokenizer's
    fingerprint (another tokenizer counts other text lengths, so cuts other batches)."""
    if spec.data.sequence == FRAMES:
        return None
    held = f"{spec.data.sequence}:{tokenizer_fingerprint(spec.tokenizer)}"
    # a text axis of its own has its own budget, which counts batches too
    return f"{held}:{spec.data.batch_text}" if spec.data.sequence == TWO_AXES else held


def _mix_schedule(spec: StreamSpec) -> list[list[Any]]:
    """``data.mix_schedule`` as the state holds it: [first batch, frame shares] a phase."""
    return [[start, [round(w, 9) for w in s.weights]] for start, s in spec.phases]


def restore(spec: StreamSpec, identity: Mapping[str, Any], state: Mapping[str, Any]) -> Resumed:
    """Where this rank continues from its own ``state`` of the same job (``identity``: this
    loader's :func:`state_identity`); :class:`LoaderStateError` naming the key or shape that
    differs."""
    version = state.get("version")
    if version in (WHOLE_CACHE_VERSION, NO_FRAMES_VERSION):
        if len(spec.subs) != 1 or spec.subs[0].bucket >= 0:
            raise LoaderStateError(
                f"loader state was saved by an earlier loader (version {version}), whose "
                "stream continues here only as one cache with data.sync_buckets = false"
            )
        if version == WHOLE_CACHE_VERSION:  # one position per worker, no sync_buckets/mix
            identity = {k: v for k, v in identity.items() if k not in ("sync_buckets", "mix")}
            positions = [[[*p, 0]] for p in state["positions"]]
        else:
            positions = [[[*p, 0] for p in worker] for worker in state["positions"]]
    elif version in ELASTIC_VERSIONS:
        positions = state["positions"]
    else:
        raise LoaderStateError(f"loader state version {version!r}, expected {STATE_VERSION}")
    for key, value in identity.items():
        if state.get(key) != value:
            name = STATE_KEYS.get(key, key)
            raise LoaderStateError(
                f"loader state was saved with {name} = {state.get(key)!r} but this loader "
                f"has {name} = {value!r} (a job of another size or mix resumes from the "
                "list of every rank's state)"
            )
    workers = spec.workers_per_rank
    shape = [[len(spec.start(sub)) for sub in spec.subs]] * workers
    restored = [[tuple(map(int, p)) for p in worker] for worker in positions]
    next_worker, batches = int(state["next_worker"]), int(state["batches"])
    if [[len(p) for p in worker] for worker in restored] != shape or (
        next_worker != batches % workers
    ):
        raise LoaderStateError(
            f"loader state has positions of shape {[[len(p) for p in w] for w in restored]} "
            f"and next_worker = {next_worker} after {batches} batches; expected {shape}"
        )
    return Resumed(
        positions=[list(worker) for worker in restored],
        deals=parse_deals(state["deals"], len(spec.subs), spec.plan) if version == 4 else (),
        batches=batches,
        skipped_shards=dict(state.get("skipped_shards", {})),
        changes=(),
    )
