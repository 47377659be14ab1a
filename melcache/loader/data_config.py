"""The loader's configuration: batch budgets, workers, shard checks, mixes, extras.

A frozen, keyword-only dataclass validated at creation; errors name the key, the bad value
and what it should be. The trainer reads it from its ``[data]`` table.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from melcache.fields.format import name_problem
from melcache.host.cpus import usable_cpus
from melcache.loader.balance import check_balance
from melcache.reader import SHARD_CHECKS
from melcache.sections import Bounds, as_float, bounded, check_numbers, require
from melcache.where import Where

ON_ERROR = ("raise", "skip")
MAX_SYNC_SPLIT = 1_000  # length ranges a bucket at most (data.sync_split)
MAX_ATTENTION_FRAMES = 1 << 24  # data.attention_frames at most
# data.sequence: frames alone, text tokens then frames in one sequence ("+": their lengths add),
# or text and frames as two axes of an encoder-decoder ("," as in a shape: each padded on its
# own); melcache/loader/sequence.py
SEQUENCES = ("frames", "text+frames", "text,frames")
# Length ranges per bucket of a fresh stream (data.sync_split = 0): on drawn 50 h and 200 h
# caches 6 ranges keep 0.97 of a step's compute at 8-512 ranks, against 0.88-0.91 with 1 and
# 0.96 with 4 (benchmarks/loader/schedule_bench.py --parts synthetic, docs/results.md).
SYNC_SPLIT = 6
# The padded length at which attention costs what the rest of a step does, for a fresh stream
# (data.attention_frames = 0): 6 × d 512, configs/base.toml's width. On drawn 3 h / 50 h
# caches at 512 ranks a step's ranks spend 0.982 / 0.977 of it computing by the FLOP model and
# 0.976 / 0.963 by one timed on a CPU, against 0.972 / 0.970 and 0.951 / 0.950 with equal
# frames (batch plan 2; docs/results.md, "Cost, not frames").
ATTENTION_FRAMES = 3072
# Reading and decoding a shard is cheap: two workers stream ~9,700 samples/s (docs/results.md).
MOST_DEFAULT_WORKERS = 2


def default_workers() -> int:
    """Loader workers per rank unless ``data.num_workers`` says: 2, or the CPUs this process
    may use (affinity mask, cgroup quota) shared by the ranks torchrun starts beside it
    (``LOCAL_WORLD_SIZE``) where that is fewer; at least 1."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    local_ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, min(MOST_DEFAULT_WORKERS, usable_cpus() // local_ranks))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The streaming loader's one configuration, handed whole to :func:`make_loader` and on
    to its workers (job rank, world size and seed aside): the loader keys of the trainer's
    ``[data]`` table, which adds its own (``train.config.tables.TrainDataConfig``)."""

    # Padded mel frames per micro-batch per rank: one count for every length bucket, or a
    # table {bucket: count} (``python -m train tune`` writes one), since attention memory grows
    # with the square of the length and a budget safe for the longest bucket starves the rest.
    batch_frames: int | Mapping[str, int] = 6_000
    max_batch_size: int = bounded(64, 1, 1 << 20)
    num_workers: int = dataclasses.field(
        default_factory=default_workers, metadata={"bounds": Bounds(0, 1024)}
    )
    pad_multiple: int = bounded(8, 1, 1 << 16)
    on_error: str = "raise"
    shard_check: str = "fast"  # "fast" (xxh3_128 every read), "sha256" or "off": docs/loader.md
    # Every rank's batches of a step from one length bucket (docs/loader.md, "One schedule");
    # false: the stream of earlier releases (one cache: the same batches, old states resume).
    sync_buckets: bool = True
    # Length ranges per bucket drawn alike on every rank: each bucket's units cut into this many
    # runs of neighbouring lengths, so one step's ranks read units of one narrower range
    # (docs/loader.md, "Finer than a bucket"). 0: SYNC_SPLIT for a fresh stream, and a resumed
    # one keeps its own (1, the stream of earlier releases, for their loader states).
    sync_split: int = bounded(0, 0, MAX_SYNC_SPLIT)
    # The padded length at which a batch's attention costs what the rest of the model does
    # (a transformer of width d: about 6·d): the even cut gives a unit's batches near-equal
    # cost B·T·(1 + T/attention_frames), not near-equal frames B·T, so ranks of one step wait
    # less where lengths differ within a unit (docs/loader.md, "Cost, not frames").
    # 0: ATTENTION_FRAMES for a fresh stream, and a resumed one keeps its own.
    attention_frames: int = bounded(0, 0, MAX_ATTENTION_FRAMES)
    # What the model's sequence is made of (a model's melcache_contract "sequence"): "frames",
    # "text+frames" (text tokens then frames, one sequence: every plan, budget and cost on
    # S = text + frames) or "text,frames" (an encoder's text and a decoder's frames, two axes
    # each padded and budgeted on its own); melcache/loader/sequence.py, docs/loader.md.
    sequence: str = "frames"
    # data.sequence = "text,frames": padded text tokens per micro-batch, a count or a table
    # {bucket: count} as batch_frames is (B × padded longest text ≤ it). 0: each bucket's
    # batch_frames (a text position costs an encoder of the decoder's width what a frame costs).
    batch_text: int | Mapping[str, int] = 0
    # Frame shares of the caches of a mix, keyed by location as given to --shards (default:
    # their hours), and α: the shares used are ∝ weight^α (α < 1 lifts small caches).
    mix: Mapping[str, float] = dataclasses.field(default_factory=dict)
    mix_temperature: float = bounded(1.0, 0, 100)
    # Weights that take over from a batch on, inside one run: {batch: {location: weight}},
    # the batch counted per rank (docs/loader.md, "Mix changes"); stored in the loader state.
    mix_schedule: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    # Resume a cache whose content (index digest) changed under the same location, from its
    # epoch 0, rather than refuse the saved loader state (docs/loader.md, "Resume").
    allow_data_change: bool = False
    # Per-utterance fields each batch carries in batch.extras ([build] extras of the cache, or
    # "reference"): melcache/loader/batch.py; a plug-in's melcache_contract "extras" adds its own.
    extras: tuple[str, ...] = ()
    # Derived fields each batch carries in batch.fields ("codes": python -m preprocess derive),
    # and, per field, provenance keys the cache's must equal (e.g. {codes = {checkpoint_sha256
    # = "..."}}); a plug-in's melcache_contract "fields" adds its own: docs/fields.md.
    fields: tuple[str, ...] = ()
    field_provenance: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    # False (a model's melcache_contract "mel": False): read the field shards alone, no mel
    # byte; batch.mel is [B, T, 0] and every frame count is the first field's.
    read_mel: bool = True
    # A node's local copies of a remote cache's shards (s3://, http(s)://), for jobs that read
    # it more than once per node: a folder melcache owns, bounded by bytes (melcache/remote/disk_cache.py).
    cache_dir: str = ""
    cache_bytes: int = bounded(0, 0, 1 << 60)
    # Which utterances are heard, and how often, decided from each cache's table before any
    # shard is read (melcache/loader/balance.py, docs/loader.md "Who is heard how often"):
    # a --where expression over speaker, frames, text_length and the cache's extras, and
    # speaker_temperature, language_temperature, language and weight = "EXPR".
    where: str = ""
    balance: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_numbers(self, "data")
        self._check_selection()
        self._check_batches()
        self._check_mix()
        self._check_reads()

    def _check_selection(self) -> None:
        """``data.where`` and ``[data.balance]``: parsed here, once, not in every worker."""
        require(isinstance(self.where, str), "data.where", self.where, "an expression (a string)")
        if self.where:
            Where(self.where, "data.where")
        object.__setattr__(self, "balance", check_balance(self.balance))
        require(
            self.sync_buckets or not (self.where or self.balance),
            "data.sync_buckets",
            self.sync_buckets,
            "true with data.where or data.balance (they are dealt per bucket)",
        )
        require(
            not self.balance.get("spread") or self.sequence != "text,frames",
            "data.balance.spread",
            True,
            'false with data.sequence = "text,frames" (its two-axis cut has no one order of '
            "lengths to spread copies along)",
        )

    def _check_batches(self) -> None:
        """How batches are cut: the budget, the sequence, the schedule and the shard check."""
        if isinstance(self.batch_frames, Mapping):
            object.__setattr__(self, "batch_frames", _budget_table(self.batch_frames))
        else:
            require(_is_count(self.batch_frames), "data.batch_frames", self.batch_frames, _BUDGET)
        if isinstance(self.batch_text, Mapping):
            object.__setattr__(self, "batch_text", _budget_table(self.batch_text, "batch_text"))
        else:
            require(
                self.batch_text == 0 or _is_count(self.batch_text),
                "data.batch_text",
                self.batch_text,
                f"0 (each bucket's batch_frames) or {_BUDGET}",
            )
        require(self.sequence in SEQUENCES, "data.sequence", self.sequence, " or ".join(SEQUENCES))
        # "frames" may yet become "text,frames" by the model's declaration (train/model/
        # contract.py): the loader refuses a text budget that no axis of text takes.
        require(
            self.sequence != "text+frames" or self.batch_text == 0,
            "data.batch_text",
            self.batch_text,
            '0 unless data.sequence = "text,frames" (the text is budgeted on its own only there)',
        )
        require(
            self.sequence == "frames" or self.sync_buckets,
            "data.sequence",
            self.sequence,
            '"frames" with data.sync_buckets = false (the stream of earlier releases)',
        )
        require(self.on_error in ON_ERROR, "data.on_error", self.on_error, " or ".join(ON_ERROR))
        require(
            self.shard_check in SHARD_CHECKS,
            "data.shard_check",
            self.shard_check,
            " or ".join(SHARD_CHECKS),
        )
        require(
            isinstance(self.sync_buckets, bool),
            "data.sync_buckets",
            self.sync_buckets,
            "true or false",
        )

    def _check_mix(self) -> None:
        """The mix's weights, its schedule, and whether a cache may change under a resume."""
        require(
            isinstance(self.allow_data_change, bool),
            "data.allow_data_change",
            self.allow_data_change,
            "true or false",
        )
        require(
            isinstance(self.mix, Mapping), "data.mix", self.mix, "a table of locations to weights"
        )
        object.__setattr__(self, "mix", {w: _weight(w, v) for w, v in self.mix.items()})
        object.__setattr__(self, "mix_schedule", _mix_schedule(self.mix_schedule))

    def _check_reads(self) -> None:
        """What each batch carries beyond the mel, and where remote shards are kept."""
        require(
            isinstance(self.extras, tuple) and all(isinstance(n, str) and n for n in self.extras),
            "data.extras",
            self.extras,
            "a list of field names",
        )
        require(
            isinstance(self.fields, tuple) and not any(map(name_problem, self.fields)),
            "data.fields",
            self.fields,
            'a list of derived field names such as ["codes"]',
        )
        require(isinstance(self.cache_dir, str), "data.cache_dir", self.cache_dir, "a folder")
        require(
            not self.cache_dir or self.cache_bytes > 0,
            "data.cache_bytes",
            self.cache_bytes,
            "the bytes data.cache_dir may hold (> 0)",
        )
        require(
            isinstance(self.read_mel, bool) and (self.read_mel or bool(self.fields)),
            "data.read_mel",
            self.read_mel,
            "true, or false with data.fields naming what is read instead",
        )
        require(
            isinstance(self.field_provenance, Mapping)
            and all(isinstance(v, Mapping) for v in self.field_provenance.values()),
            "data.field_provenance",
            self.field_provenance,
            "a table of field names to tables of provenance keys",
        )

    @property
    def split(self) -> int:
        """``sync_split`` in effect: :data:`SYNC_SPLIT` where it is 0 (the default)."""
        return self.sync_split or SYNC_SPLIT

    @property
    def attention(self) -> int:
        """``attention_frames`` in effect: :data:`ATTENTION_FRAMES` where it is 0 (the default)."""
        return self.attention_frames or ATTENTION_FRAMES

    def budget(self, bucket: int) -> int:
        """Padded frames per micro-batch in length bucket ``bucket`` (the loader checks at start
        that a table names every bucket of the cache)."""
        if isinstance(self.batch_frames, int):
            return self.batch_frames
        return self.batch_frames[str(bucket)]

    def text_budget(self, bucket: int) -> int:
        """Padded text tokens per micro-batch in bucket ``bucket`` (``data.sequence =
        "text,frames"``): ``batch_text``, or the bucket's ``batch_frames`` where it is 0."""
        if isinstance(self.batch_text, Mapping):
            return self.batch_text[str(bucket)]
        return self.batch_text or self.budget(bucket)


_BUDGET = "a positive count, or a table of bucket numbers to counts such as {0 = 24000, 1 = 16000}"


def _weight(where: str, value: Any) -> float:
    """A mix weight as a float: a finite positive number (an int is converted, not raised to
    the temperature as a Python big integer)."""
    number = as_float(value)
    require(0 < number < 1e300, f"data.mix.{where}", value, _WEIGHT)  # NaN fails too
    return number


_WEIGHT = "a finite positive weight (a share of frames, any scale)"


def _mix_schedule(table: Any) -> dict[str, dict[str, float]]:
    """``data.mix_schedule`` keyed by canonical batch numbers in order, each a weight table."""
    shape = "a table of batch numbers to tables of locations to weights"
    require(isinstance(table, Mapping), "data.mix_schedule", table, shape)
    out: dict[str, dict[str, float]] = {}
    for key, weights in table.items():
        require(str(key).isdigit() and int(key) > 0, "data.mix_schedule", dict(table), shape)
        name = f"data.mix_schedule.{key}"
        require(isinstance(weights, Mapping) and weights, name, weights, shape)
        out[str(int(key))] = {w: _weight(w, v) for w, v in weights.items()}
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _budget_table(table: Mapping[Any, Any], key_name: str = "batch_frames") -> dict[str, int]:
    """A budget table (``batch_frames``, ``batch_text``) checked and keyed by canonical bucket
    numbers, in order."""
    name = f"data.{key_name}"
    require(len(table) > 0, name, dict(table), _BUDGET)
    out: dict[str, int] = {}
    for key, value in table.items():
        require(str(key).isdigit(), name, dict(table), _BUDGET)
        require(_is_count(value), f"{name}.{key}", value, "a positive count")
        out[str(int(key))] = value
    return dict(sorted(out.items(), key=lambda item: int(item[0])))
