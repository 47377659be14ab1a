"""What a model's sequence is made of, and its length per utterance, for the planners.

``data.sequence`` (a model's ``melcache_contract["sequence"]``):

- ``"frames"`` (default): the mel (or first field's) frames; every plan is today's.
- ``"text+frames"``: one sequence of the text's tokens then the frames (ChatTTS's GPT, a
  decoder-only TTS LM), ``S = text + frames`` per utterance. The units' batch counts, the
  sort and the cut of each unit, the cost cut ``B·S·(1 + S/A)``, the length ranges and the
  budget (``data.batch_frames`` then counts padded ``S`` positions) all run on ``S``.
- ``"text,frames"``: two axes, the text's tokens to an encoder and the frames to a decoder
  (an encoder-decoder TTS), each padded to its own longest: ``,`` as in a shape ``(text,
  frames)``, where ``+`` adds the two into one length. A batch of ``B`` rows, ``T`` padded
  text and ``F`` padded frames keeps ``B·F ≤ data.batch_frames`` and ``B·T ≤
  data.batch_text`` (0: the bucket's ``batch_frames``), as NeMo's 2-D buckets bound a cell
  on duration and tokens at once; the units' counts fit both (:func:`text_tops`). Buckets and
  length ranges stay on frames (the decoder's axis, most of the positions); each unit is cut
  by :func:`plan_two_axis_batches`.

Text lengths under the run's tokenizer are read from each cache once, with the table's help
(only the ``json`` members, no mel), and kept in a sidecar bound to the table's digest and
the tokenizer's fingerprint (:func:`text_lengths`); a loader start reads the sidecar and
checks it, never the texts. Counts stay a pure function of (index, table, sidecar, config),
so any batch is still located in O(1) and resumes stay exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from numpy.lib.stride_tricks import sliding_window_view

from melcache.access import Cache
from melcache.batch_plans import batches_at_ends, least_true, round_up
from melcache.errors import ShardError, UserError
from melcache.fields.format import ROW_COLUMNS
from melcache.format import write_atomic
from melcache.loader.batch import token_ids
from melcache.loader.data_config import SEQUENCES

FRAMES, TEXT_FRAMES, TWO_AXES = SEQUENCES
FIELD_FRAMES = ROW_COLUMNS.index("frames")  # a field's rows.npy column of each row's frames
SIDECAR_VERSION = 1
# Texts the fingerprint tokenises: scripts, digits, punctuation and ChatTTS's control tokens,
# so two tokenizers (or vocabularies) that split any of them otherwise differ.
_PROBES = (
    "The quick brown fox, 1984 jumps; over 12 lazy dogs!",
    "今天天气很好，我们去公园散步吧。",
    "Mixed 中英文 text [uv_break] with [laugh] and ünïcödé.",
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class TextLengths:
    """One cache's text tokens per table row, with the table's rows per shard and frames."""

    per_row: np.ndarray  # int32, tokens of each row's text under the run's tokenizer
    shard_rows: np.ndarray  # the first row of each shard, then the row count
    frames: np.ndarray  # the frames the loader counts of each row: the mel's, or a field's

    def of_shard(self, shard: int) -> np.ndarray:
        """Text tokens of shard number ``shard``'s rows, in tar order."""
        return self.per_row[int(self.shard_rows[shard]) : int(self.shard_rows[shard + 1])]

    def longest_texts(self) -> list[int]:
        """Each shard's longest text in tokens (an empty shard: 0)."""
        pairs = itertools.pairwise(self.shard_rows.tolist())
        return [int(self.per_row[a:b].max(initial=0)) for a, b in pairs]

    def tops(self, shards: Sequence[Mapping[str, Any]]) -> list[int]:
        """Each shard's longest ``text + frames`` (an empty shard: its ``max_frames``)."""
        out = []
        for shard, entry in enumerate(shards):
            rows = slice(int(self.shard_rows[shard]), int(self.shard_rows[shard + 1]))
            held = self.frames[rows].astype(np.int64) + self.per_row[rows]
            out.append(int(held.max()) if len(held) else int(entry["max_frames"]))
        return out


def tokenizer_fingerprint(tokenizer: Callable[[str], Any]) -> str:
    """A name for the tokenizer's behaviour: its type and vocabulary size with the ids it
    gives a few probe texts (a different vocabulary or rule splits some of them otherwise)."""
    kind = getattr(tokenizer, "__qualname__", None) or type(tokenizer).__qualname__
    ids = [token_ids(tokenizer, text).tolist() for text in _PROBES]
    what = json.dumps([kind, getattr(tokenizer, "vocab_size", None), ids])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def sidecar_folder(cache_dir: str) -> Path:
    """Where text-length sidecars live: ``data.cache_dir`` (a folder melcache owns) or
    ``$XDG_CACHE_HOME/melcache`` (``~/.cache/melcache``); a cache itself stays read-only."""
    if cache_dir:
        return Path(cache_dir) / "text_lengths"
    home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(home) / "melcache" / "text_lengths"


def text_lengths(
    location: str,
    index: Mapping[str, Any],
    tokenizer: Callable[[str], Any],
    folder: Path,
    field: str | None = None,
) -> TextLengths:
    """The cache's text tokens per table row under ``tokenizer``: the sidecar in ``folder``
    when it is this table's and tokenizer's and whole, else counted from the texts (the json
    members only) and written there; with the frames of each row the loader counts, the
    table's or derived field ``field``'s (its ``rows.npy``). A cache without a table is
    refused, naming the command that writes one."""
    if not index.get("table"):
        raise UserError(
            f"cache {location}: data.sequence with text plans on text lengths by the "
            f"cache's utterances.table, which it has not; python -m preprocess index-table "
            f"{location} writes one"
        )
    fingerprint = tokenizer_fingerprint(tokenizer)
    binding = {"version": SIDECAR_VERSION, "table": index["table"]["xxh3_128"],
               "tokenizer": fingerprint}  # fmt: skip
    stem = folder / f"{binding['table'][:16]}-{fingerprint}"
    with Cache(location) as cache:
        shard_rows = np.array(cache.table.column("shard_rows"))
        per_row = _read_sidecar(stem, binding, len(cache))
        if per_row is None:
            per_row = _count(cache, tokenizer, shard_rows)
            folder.mkdir(parents=True, exist_ok=True)
            # Atomic: the ranks of a node (or two jobs) share the folder and may count at once.
            array = io.BytesIO()
            np.save(array, per_row, allow_pickle=False)
            write_atomic(stem.with_suffix(".npy"), array.getvalue())
            header = {**binding, "rows": len(per_row), "xxh3_64": _digest(per_row)}
            write_atomic(stem.with_suffix(".json"), json.dumps(header).encode())
        frames = cache.lengths if field is None else cache.fields.rows(field)[:, FIELD_FRAMES]
        return TextLengths(per_row, shard_rows, np.asarray(frames))


def _digest(values: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(values).tobytes())


def _read_sidecar(stem: Path, binding: Mapping[str, Any], rows: int) -> np.ndarray | None:
    """The sidecar's lengths where its header binds it to this table and tokenizer and its
    array is whole; ``None`` (logged where one was there) otherwise."""
    try:
        header = json.loads(stem.with_suffix(".json").read_text())
        values = np.load(stem.with_suffix(".npy"), allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError) as exc:  # np.load says EOFError of an empty file
        logger.warning("text lengths %s unreadable (%s): counting them again", stem, exc)
        return None
    whole = {**binding, "rows": rows, "xxh3_64": _digest(values)}
    if header != whole or values.dtype != np.int32 or values.shape != (rows,):
        logger.warning("text lengths %s do not match this table: counting them again", stem)
        return None
    return values


def _count(cache: Cache, tokenizer: Callable[[str], Any], shard_rows: np.ndarray) -> np.ndarray:
    """Tokens of every row's text, shard by shard (a shard's json members in one read)."""
    out = np.zeros(len(cache), dtype=np.int32)
    for shard in range(len(shard_rows) - 1):
        start, stop = int(shard_rows[shard]), int(shard_rows[shard + 1])
        for row, text in zip(range(start, stop), cache.texts(shard), strict=True):
            out[row] = len(token_ids(tokenizer, text))
    return out


def declared_texts(
    owners: Sequence[Mapping[str, Any]],
    unit: Iterable[int],
    shards: Sequence[Mapping[str, Any]],
    text: TextLengths,
) -> list[int]:
    """Text tokens of a unit's samples (their shards' entries ``owners``, in unit order; a
    shard is there whole or not at all, as a unit is read)."""
    out: list[int] = []
    for shard in unit:
        held = sum(1 for owner in owners[len(out) :] if owner is shards[shard])
        if not held:
            continue
        tokens = text.of_shard(shard)
        if len(tokens) != held:
            raise ShardError(
                f"{shards[shard]['name']}: {held} samples read, the table holds {len(tokens)}"
            )
        out += tokens.tolist()
    return out


def with_text(
    sources: Sequence[Any],
    indexes: Sequence[Mapping[str, Any]],
    data: Any,
    tokenizer: Callable[[str], Any],
) -> tuple[Any, ...]:
    """The mix's sources (``melcache.loader.spec.Source``, each of the cache at its
    location, before any field takes its place) with their text lengths where
    ``data.sequence`` holds text, else as they are."""
    if data.sequence == FRAMES:
        return tuple(sources)
    folder = sidecar_folder(data.cache_dir)
    field = None if data.read_mel else data.fields[0]  # what the loader counts: docs/fields.md
    return tuple(
        dataclasses.replace(
            source, text=text_lengths(source.location, index, tokenizer, folder, field)
        )
        for source, index in zip(sources, indexes, strict=True)
    )


def sequence_tops(sources: Sequence[Any], data: Any) -> list[list[int] | None]:
    """Per source, each shard's longest declared sequence (``None``: frames, the index's
    own); a shard whose longest does not fit its bucket's budget is refused by name."""
    out: list[list[int] | None] = []
    for source in sources:
        if source.text is None or data.sequence != TEXT_FRAMES:  # frames: the index's own
            out.append(None)
            continue
        tops = source.text.tops(source.shards)
        for entry, top in zip(source.shards, tops, strict=True):
            budget = data.budget(entry["bucket"])
            if -(-top // data.pad_multiple) * data.pad_multiple > budget:
                raise UserError(
                    f"{source.location}: shard {entry['name']} holds an utterance of {top} "
                    f"text + frames positions, over data.batch_frames = {budget} (bucket "
                    f"{entry['bucket']}); with data.sequence = {TEXT_FRAMES!r} the budget "
                    "counts text and frames"
                )
        out.append(tops)
    return out


def text_tops(sources: Sequence[Any], data: Any) -> list[list[int] | None]:
    """Per source, each shard's longest text (``data.sequence = "text,frames"``; else
    ``None``); a shard whose longest text does not fit its bucket's ``data.batch_text`` (or a
    table of them that leaves out a bucket) is refused by name."""
    out: list[list[int] | None] = []
    for source in sources:
        if source.text is None or data.sequence != TWO_AXES:
            out.append(None)
            continue
        tops = source.text.longest_texts()
        for entry, top in zip(source.shards, tops, strict=True):
            bucket = entry["bucket"]
            if isinstance(data.batch_text, Mapping) and str(bucket) not in data.batch_text:
                raise UserError(
                    f"data.batch_text names buckets {sorted(map(int, data.batch_text))} but "
                    f"cache {source.location} has bucket {bucket}: give one budget per bucket"
                )
            if round_up(top, data.pad_multiple) > data.text_budget(bucket):
                raise UserError(
                    f"{source.location}: shard {entry['name']} holds a text of {top} tokens, "
                    f"over data.batch_text = {data.text_budget(bucket)} (bucket {bucket}); "
                    f"with data.sequence = {TWO_AXES!r} the text axis has its own budget"
                )
        out.append(tops)
    return out


def most_per_batch(data: Any, bucket: int, longest_text: int | None) -> int:
    """Utterances a batch of ``bucket`` may hold beside the frames' budget: ``max_batch_size``,
    and with a text axis (``longest_text``: the unit's longest) what fits ``batch_text``."""
    if longest_text is None:
        return data.max_batch_size
    fit = data.text_budget(bucket) // round_up(max(1, longest_text), data.pad_multiple)
    return min(data.max_batch_size, fit)


# Text cells of a unit (2-D cells, :func:`two_axis_order`): at most this many, and taken only
# where they cut the unit's padded cost by more than CELL_GAIN of it. Cells leave the counts
# alone (they come from the unit's longest), so only the batches' shapes, hence the ranks'
# costs within a step, move; a gain under 1 % is within that spread (docs/results.md).
MOST_CELLS = 4
CELL_GAIN = 0.01
CAP_STEP = 0.001  # the two-axis cut's cost caps, apart by this share


def two_axis_cost(text: Any, frames: Any, attention: int) -> np.ndarray:
    """``A`` × the cost of one row of an encoder-decoder padded to ``text`` and ``frames``:
    ``T·(1 + T/A) + F·(1 + F/A) + T·F/A`` (the encoder, the decoder, and the decoder's cross
    attention over the text: ``4·d·T·F`` a layer, as self-attention's ``4·d·F²``), in
    integers; layers of encoder and decoder counted alike."""
    t, f = np.asarray(text, dtype=np.int64), np.asarray(frames, dtype=np.int64)
    return t * (attention + t) + f * (attention + f) + t * f


def two_axis_order(
    text: np.ndarray, frames: np.ndarray, *, rng: np.random.Generator, count: int, pad: int,
    attention: int,
) -> np.ndarray:  # fmt: skip
    """Places of a unit's samples (``text`` tokens and ``frames`` of each) as the two-axis cut
    takes them: longest padded frames first (the decoder's axis, most positions), then
    longest text, ties in random order (so batches change members between epochs); or, where
    they pay, text cells first (2-D cells: the unit split at quantiles of its text into 2 to
    :data:`MOST_CELLS` cells, longest text first), each sorted so. Cells pay where the
    padded cost of ``count`` equal runs (:func:`two_axis_cost` of each run's longest padded
    text and frames) falls by more than :data:`CELL_GAIN`; the choice is a function of the
    lengths alone."""
    tie = rng.random(len(text))
    padded_t, padded_f = -(-text // pad) * pad, -(-frames // pad) * pad
    sizes = np.diff(np.linspace(0, len(text), count + 1).astype(np.int64))  # equal runs
    starts = np.cumsum(sizes) - sizes
    best, best_cost = np.arange(0), 0
    for cells in range(1, MOST_CELLS + 1):
        edges = np.quantile(text, np.linspace(0, 1, cells + 1)[1:-1])
        order = np.lexsort((tie, -text, -padded_f, -np.searchsorted(edges, text)))
        longest_t = np.maximum.reduceat(padded_t[order], starts)
        longest_f = np.maximum.reduceat(padded_f[order], starts)
        cost = int(sizes @ two_axis_cost(longest_t, longest_f, attention))
        if cells == 1 or cost < best_cost * (1 - CELL_GAIN):
            best, best_cost = order, cost
    return best


def plan_two_axis_batches(
    text: Sequence[int],
    frames: Sequence[int],
    *,
    rng: np.random.Generator,
    count: int,
    max_batch_size: int,
    pad_multiple: int,
    attention_frames: int,
) -> list[list[int]]:
    """Cut a unit's samples (``text`` tokens and ``frames`` of each) into ``count`` batches of
    near-equal cost (:func:`two_axis_cost` of each batch's padded longest text and frames),
    in :func:`two_axis_order`, in shuffled order.

    A run from place ``i`` grows while its size × its longest padded text, × its longest
    padded frames and × its cost stay within the caps: the first two those of ``count``
    equal runs (so within the budgets :func:`most_per_batch` counts with), the cost the least
    that ``count`` greedy runs reach. Growing a run only raises its longest, so the greedy
    runs are the fewest, and equal runs meet the caps: the search always ends within
    ``count``, and the count is known before the unit is read."""
    t, f = np.asarray(text, dtype=np.int64), np.asarray(frames, dtype=np.int64)
    order = two_axis_order(t, f, rng=rng, count=count, pad=pad_multiple, attention=attention_frames)
    t = -(-t[order] // pad_multiple) * pad_multiple
    f = -(-f[order] // pad_multiple) * pad_multiple
    sizes = np.full(count, len(t) // count)  # count equal runs, as np.array_split cuts them
    sizes[: len(t) % count] += 1
    sizes = sizes[sizes > 0]
    starts = np.cumsum(sizes) - sizes
    longest_t, longest_f = np.maximum.reduceat(t, starts), np.maximum.reduceat(f, starts)
    text_cap, frame_cap = int((sizes * longest_t).max()), int((sizes * longest_f).max())
    top = int((sizes * two_axis_cost(longest_t, longest_f, attention_frames)).max())
    # Caps on a geometric grid from the least any count runs can reach (each sample's own
    # cost, and the mean run's) to ``top``: 0.1 % apart, so the search takes ~10 tries.
    alone = two_axis_cost(t, f, attention_frames)
    low = min(top, max(int(alone.max()), -(-int(alone.sum()) // count)))
    tries = math.ceil(math.log(top / low) / math.log1p(CAP_STEP))
    cap = lambda k: top if k >= tries else math.ceil(low * (1 + CAP_STEP) ** k)  # noqa: E731

    run_cost = _run_costs(t, f, max_batch_size, (text_cap, frame_cap), attention_frames)

    def ends(cap: int) -> list[int]:
        longest_run = (run_cost <= cap).sum(axis=1)  # from each place: costs rise with size
        out, start = [], 0
        while start < len(t):
            start += max(1, int(longest_run[start]))
            out.append(start)
        return out

    return batches_at_ends(
        order, ends(cap(least_true(0, tries, lambda k: len(ends(cap(k))) <= count))), count, rng
    )


def _run_costs(
    t: np.ndarray, f: np.ndarray, max_batch_size: int, caps: tuple[int, int], attention: int
) -> np.ndarray:
    """``[place, size - 1]``: the cost of the run of ``size`` samples from ``place`` (size ×
    :func:`two_axis_cost` of its longest text and frames), the int64 maximum where it passes
    the unit's end or a cap (``caps``: of size × longest text, size × longest frames). Costs
    rise with size, so the runs that fit a cost are a prefix of each row, counted in one pass
    for every place at once: the cap search costs ``tries`` vector sums, not ``tries`` ×
    ``count`` slices. No run is longer than the frames cap over the unit's shortest frames."""
    text_cap, frame_cap = caps
    width = max(1, min(max_batch_size, len(t), frame_cap // max(1, int(f.min()))))
    past_end = np.full(width - 1, frame_cap + 1, dtype=np.int64)  # frames no run fits
    windows = [np.concatenate([x, past_end]) for x in (t, f)]
    longest_t, longest_f = (
        np.maximum.accumulate(sliding_window_view(x, width), axis=1) for x in windows
    )
    size = np.arange(1, width + 1)
    cost = size * two_axis_cost(longest_t, longest_f, attention)
    cost[(size * longest_t > text_cap) | (size * longest_f > frame_cap)] = np.iinfo(np.int64).max
    return cost
