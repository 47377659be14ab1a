"""The loader tests' own helpers (tests/melcache/loader/, and the store's): a loader with small
test defaults, batches taken and compared, an epoch's keys, a cache's index and utterances."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from melcache.format import INDEX_NAME, decode_meta
from melcache.loader import Batch, DataConfig, StreamLoader, make_loader
from melcache.tar.reader import group_samples, iter_members
from tests.support.helpers import REPO

TENSORS = ("mel", "mel_lengths", "text", "text_lengths")


def take(loader: Iterable[Batch], count: int) -> list[Batch]:
    return [batch for _, batch in zip(range(count), loader, strict=False)]


def assert_same(got: list[Batch], want: list[Batch]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys == b.keys, f"batch {i}"
        assert a.speaker == b.speaker, f"batch {i}"
        for name in TENSORS:
            assert torch.equal(getattr(a, name), getattr(b, name)), f"batch {i} {name}"


def epoch_keys(loader: StreamLoader, epoch: int) -> list[str]:
    """Keys of the batches of ``epoch`` (of their worker's sub-stream) from a fresh loader.

    The position a batch moves (worker, sub-stream) names where it comes from; the epoch is
    the loader's progress before it in a whole-cache stream, and in a bucket sub-stream the
    epoch of the batch number it took (a skipped shard may move a worker past an epoch's end).
    """
    keys: list[str] = []
    stream = iter(loader)
    for _ in range(10_000):  # a bound, so that a bug fails instead of hanging
        if loader.epoch > epoch:
            loader.close()
            return keys
        worker, before = loader.state_dict()["next_worker"], loader.progress()
        positions = loader.state_dict()["positions"][worker]
        batch = next(stream)
        (moved,) = [
            u for u, p in enumerate(loader.state_dict()["positions"][worker]) if p != positions[u]
        ]
        sub, spec = loader.spec.subs[moved], loader.spec
        if sub.bucket < 0:
            batch_epoch = int(before[worker][moved])
        else:
            taken = loader.state_dict()["positions"][worker][moved][0] - 1
            slot = spec.rank * spec.workers_per_rank + worker
            number = spec.deal(moved).number(sub, slot=slot, num_slots=spec.num_slots, taken=taken)
            batch_epoch = number // sub.per_epoch
        if batch_epoch == epoch:
            keys.extend(batch.keys)
    raise AssertionError(f"epoch {epoch} did not end within 10,000 batches")


def index_of(cache: Path) -> dict:
    return json.loads((cache / INDEX_NAME).read_text())


def all_keys(cache: Path) -> dict[str, dict]:
    """Every utterance's metadata by key, read with melcache.format's general reader."""
    out = {}
    for entry in index_of(cache)["shards"]:
        with open(cache / entry["name"], "rb") as stream:
            for sample in group_samples(iter_members(stream, entry["name"]), entry["name"]):
                out[sample["__key__"]] = decode_meta(sample["json"], entry["name"])
    return out


def loader(cache: Path | str, **kwargs) -> StreamLoader:
    """``make_loader`` with small test defaults; ``[data]`` keys go into its DataConfig.

    The whole-cache stream (``sync_buckets = false``) by default: the tests here pin the
    stream of earlier releases, which it must keep giving; those of bucket sub-streams pass
    ``sync_buckets=True`` (and tests/melcache/loader/test_schedule.py).
    """
    options = {"batch_frames": 3000, "max_batch_size": 3, "num_workers": 0, "seed": 1,
               "sync_buckets": False, **kwargs}  # fmt: skip
    data_keys = {f.name for f in dataclasses.fields(DataConfig)} - {"tokenizer"}  # a callable
    data = DataConfig(**{k: v for k, v in options.items() if k in data_keys})
    return make_loader(cache, data, **{k: v for k, v in options.items() if k not in data_keys})


def run_script(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``python -c SCRIPT ARGS`` from the repository; return the finished process."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
