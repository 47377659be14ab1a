"""Who is heard how often: ``data.where`` and ``[data.balance]``, realised inside the schedule.

Each utterance of a cache gets an expected number of copies per epoch, ``w``, from its
table row alone (no shard is read): 0 where ``data.where`` leaves it out; else, with
``[data.balance]``, the share of its language ``l`` goes as ``hours_l^τ_language`` and,
within the language, the share of its speaker ``g`` as ``hours_g^τ_speaker`` (τ = 1 natural,
τ = 0 uniform), over hours weighted by the optional per-utterance ``weight = "EXPR"``. An
epoch keeps the hours of what ``data.where`` leaves: ``Σ w·frames = Σ frames``.

The copies are dealt per unit of a bucket sub-stream (``melcache/loader/schedule.py``), so
every unit's size per epoch is fixed, its batch count known before any shard is read, and
exact O(1) resume, elastic resume and ranks in step hold as before:

- a unit's copies ``N_u``: the running sum of ``w`` over the sub-stream's units, rounded, so
  the sub-stream's epoch holds ``round(Σ w)``;
- a speaker's copies within a unit: ``N_u`` shared by largest remainders, each speaker's
  remainder carried on to its next unit, so a speaker's count over an epoch is within one
  of its target however many units it spans;
- which utterances of the speaker in the unit: a systematic sample by ``w`` with an offset
  drawn per epoch, so each is heard ``w`` times per epoch on average, and the picks change
  from epoch to epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from melcache.batch_plans import make_rng
from melcache.errors import UserError
from melcache.sections import as_float
from melcache.table import Table
from melcache.where import Where

BALANCE_PICKS = 6  # purpose tag of the per-epoch systematic offsets (melcache.batch_plans)
MOST_BINS = 10  # weights with more distinct values are not reported per value
BALANCE_KEYS = {
    "speaker_temperature": "the speakers' shares go as hours^τ (1: natural, 0: uniform)",
    "language_temperature": "the languages' shares go as hours^τ (1: natural, 0: uniform)",
    "language": "the extra that names an utterance's language (default: language)",
    "weight": 'a per-utterance weight, an expression such as "2 if dnsmos >= 3.5 else 1"',
    "spread": "true: an utterance's copies in an epoch a batch apart, not side by side in one "
    "batch (padding rises: 1.0 to 1.6 % on a drawn 50 h cache)",
}


def check_balance(table: Any) -> dict[str, Any]:
    """``[data.balance]`` checked: temperatures in [0, 100], names and expressions strings;
    :class:`UserError` naming the key otherwise."""
    if not isinstance(table, Mapping):
        raise UserError(
            f"data.balance = {table!r} is invalid: expected a table of {list(BALANCE_KEYS)}"
        )
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in BALANCE_KEYS:
            raise UserError(
                f"data.balance.{key} is not a key; expected one of {', '.join(BALANCE_KEYS)}"
            )
        if key.endswith("temperature"):
            number = as_float(value)
            if not (isinstance(number, float) and 0 <= number <= 100):
                raise UserError(
                    f"data.balance.{key} = {value!r} is invalid: expected a number in 0..100 "
                    f"({BALANCE_KEYS[key]})"
                )
            out[key] = number
        elif key == "spread":
            if not isinstance(value, bool):
                raise UserError(
                    f"data.balance.spread = {value!r} is invalid: expected true or false"
                )
            out[key] = value
        elif not (isinstance(value, str) and value):
            raise UserError(
                f"data.balance.{key} = {value!r} is invalid: expected {BALANCE_KEYS[key]}"
            )
        else:
            out[key] = value
    if "weight" in out:
        Where(out["weight"], "data.balance.weight")  # parsed now: one line at config time
    return out


@dataclasses.dataclass(frozen=True)
class Rows:
    """What the selection knows of each utterance of one cache, from its table."""

    frames: np.ndarray  # int64
    speakers: np.ndarray  # int64 codes, 0: none
    meta: list[dict[str, Any]]  # what expressions see: speaker, frames, text_length, extras

    @classmethod
    def of(
        cls, table: Table, fields: Sequence[str], scalars: Mapping[str, np.ndarray] | None = None
    ) -> Rows:
        """The rows of ``table``; each row's ``meta`` holds only ``fields`` (those the
        expressions name), so a cache's strings are decoded only where asked for.
        ``scalars``: derived fields of one number per utterance, by name, a value per row."""
        frames = table.column("frames").astype(np.int64)
        speakers = table.column("speaker").astype(np.int64)
        names = [None, *table.strings("speakers")]
        lengths = table.column("text_length").tolist()
        extras = table.strings("extras") if table.has("extras") else None
        scalars = scalars or {}
        wanted = set(fields) - {"speaker", "frames", "text_length", *scalars}
        if wanted and extras is None:
            raise UserError(
                f"{table.location}: has no extras column, but data.where / data.balance name "
                f"{sorted(wanted)}: python -m preprocess index-table {table.location.rsplit('/', 1)[0]} "
                "rewrites the table with one (a cache built with [build] extras)"
            )
        derived = {name: values.tolist() for name, values in scalars.items()}
        meta = []
        for row, (frame, speaker, length) in enumerate(
            zip(frames.tolist(), speakers.tolist(), lengths, strict=True)
        ):
            item = {"speaker": names[speaker], "frames": frame, "text_length": length}
            if wanted:
                item.update({k: v for k, v in extras[row].items() if k in wanted})
            item.update({name: values[row] for name, values in derived.items()})
            meta.append(item)
        return cls(frames, speakers, meta)


def selection_key(
    data_where: str, balance: Mapping[str, Any], versions: Sequence[str] = ()
) -> str | None:
    """What a loader state records of ``data.where`` and ``[data.balance]`` (``None``:
    neither): ``w:DIGEST`` and ``b:DIGEST`` joined by ``+``, each where set, so a resume
    tells a filter changed (a data change) from weights changed (allowed, as a mix's).
    ``versions``: the derived fields the expressions read (``name@provenance digest``), so a
    field derived again counts as a filter changed."""
    parts = []
    if data_where:
        parts.append(f"w:{_digest([data_where, *versions] if versions else data_where)}")
    if balance:
        parts.append(f"b:{_digest(dict(sorted(balance.items())))}")
    return "+".join(parts) or None


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class Chosen:
    """One cache's selection: each table row's expected copies per epoch (``weights``), its
    (language, speaker) cell, the table's first row per shard and each row's frames; what
    an epoch's report groups by: each row's speaker, language and weight (their codes,
    and the languages' and weights' names)."""

    weights: np.ndarray
    cells: np.ndarray
    shard_rows: np.ndarray
    frames: np.ndarray
    groups: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    names: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def named_fields(where: str, balance: Mapping[str, Any]) -> dict[str, list[str]]:
    """The field names ``data.where`` and ``[data.balance]`` read, by the key naming them."""
    named = {"data.where": Where(where, "data.where").fields if where else []}
    if "weight" in balance:
        named["data.balance.weight"] = Where(balance["weight"], "data.balance.weight").fields
    if "language_temperature" in balance:
        named["data.balance.language"] = [balance.get("language", "language")]
    return named


def choose(
    table: Table,
    extras: Sequence[str],
    where: str,
    balance: Mapping[str, Any],
    location: str,
    scalars: Mapping[str, np.ndarray] | None = None,
) -> Chosen:
    """The selection of one cache from its table (see the module docstring; ``extras``: the
    cache's, ``build.extras``; ``scalars``: the derived fields of one number per utterance
    the expressions read, a value per row); one line for a field the cache does not carry,
    when nothing is left, or for a weight that is not a finite number ≥ 0."""
    named = named_fields(where, balance)
    known = ["speaker", "frames", "text_length", *extras, *(scalars or {})]
    for key, names in named.items():
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise UserError(
                f"cache {location}: {key} names {unknown[0]!r}, which its utterances do not "
                f"carry (they have {', '.join(known)}); a field of the corpus's metadata is "
                'carried by [build] extras = ["NAME"], a score of the audio by python -m '
                "preprocess derive with a per-utterance encoder"
            )
    fields = {name for names in named.values() for name in names}
    shard_rows = table.column("shard_rows").astype(np.int64)
    rows = Rows.of(table, sorted(fields), scalars)
    return weigh(rows, shard_rows, where, balance, location)


def weigh(
    rows: Rows, shard_rows: np.ndarray, where: str, balance: Mapping[str, Any], location: str
) -> Chosen:
    """:func:`choose` over ``rows`` (``shard_rows``: the first row of each shard, then the
    row count)."""
    keep = np.ones(len(rows.frames), bool)
    if where:
        test = Where(where, "data.where")
        keep = np.fromiter((test(m) for m in rows.meta), bool, len(rows.meta))
    if not keep.any():
        raise UserError(f"cache {location}: data.where = {where!r} leaves no utterance")
    hours = np.where(keep, rows.frames, 0).astype(np.float64)
    total = hours.sum()
    quality = None
    if "weight" in balance:
        quality = _weights(rows, keep, balance["weight"], location)
        hours *= quality
        if hours.sum() <= 0:
            raise UserError(
                f"cache {location}: data.balance.weight = {balance['weight']!r} is 0 for every "
                "utterance data.where leaves"
            )
    language_names = [m.get(balance.get("language", "language")) for m in rows.meta]
    languages = _codes(language_names)
    cells = languages * (int(rows.speakers.max(initial=0)) + 1) + rows.speakers
    target = _tempered(hours, languages, balance.get("language_temperature", 1.0))
    within = _tempered(hours, cells, balance.get("speaker_temperature", 1.0), languages)
    cell_hours = np.bincount(cells, hours, minlength=int(cells.max(initial=0)) + 1)[cells]
    share = np.divide(target * within, cell_hours, out=np.zeros_like(hours), where=hours > 0)
    weights = share * hours / np.maximum(rows.frames, 1) * total
    groups = {"speaker": rows.speakers, "language": languages}
    names = {"language": tuple(str(v) for v in dict.fromkeys(language_names))}
    if quality is not None and len(set(quality[keep].tolist())) <= MOST_BINS:
        groups["weight"] = _codes(quality.tolist())
        names["weight"] = tuple(f"{v:g}" for v in dict.fromkeys(quality.tolist()))
    return Chosen(weights, cells, shard_rows, rows.frames, groups, names)


def _weights(rows: Rows, keep: np.ndarray, text: str, location: str) -> np.ndarray:
    weight = Where(text, "data.balance.weight")
    out = np.zeros(len(keep))
    for row in np.flatnonzero(keep).tolist():
        value = weight.value(rows.meta[row])
        number = as_float(value) if not isinstance(value, bool) else float(value)
        if not (isinstance(number, float) and math.isfinite(number) and number >= 0):
            raise UserError(
                f"cache {location}: data.balance.weight = {text!r} gives {value!r} for row "
                f"{row} ({rows.meta[row]}); expected a finite number ≥ 0"
            )
        out[row] = number
    return out


def _codes(values: Sequence[Any]) -> np.ndarray:
    """Each value's number among the distinct values (``None`` is one of them)."""
    seen: dict[str, int] = {}
    return np.fromiter(
        (seen.setdefault(json.dumps(v), len(seen)) for v in values), np.int64, len(values)
    )


def _tempered(
    hours: np.ndarray, groups: np.ndarray, temperature: float, within: np.ndarray | None = None
) -> np.ndarray:
    """Each row's group's share, ``hours_g^τ`` normalised over all groups, or over the
    groups of the row's ``within`` group (a speaker within its language)."""
    size = int(groups.max(initial=0)) + 1
    group_hours = np.bincount(groups, hours, minlength=size)
    powered = np.zeros(size)
    alive = group_hours > 0
    if temperature == 0:
        powered[alive] = 1.0
    else:  # in log space: hours^τ overflows for large τ
        logs = temperature * np.log(group_hours[alive])
        powered[alive] = np.exp(logs - logs.max())
    if within is None:
        return (powered / powered.sum())[groups]
    parent = np.zeros(size, np.int64)
    parent[groups] = within
    totals = np.bincount(parent, powered, minlength=int(within.max(initial=0)) + 1)
    return np.divide(powered, totals[parent], out=np.zeros(size), where=totals[parent] > 0)[groups]


@dataclasses.dataclass(frozen=True)
class UnitPicks:
    """One unit's copies per epoch: its rows grouped by speaker (``rows``, the cells'
    ``starts``), each cell's ``counts`` and the rows' weights ``w``."""

    rows: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    weights: np.ndarray

    @property
    def size(self) -> int:
        """Copies the unit holds each epoch."""
        return int(self.counts.sum())

    def rows_of(self, seed: int, source: int, epoch: int, first_shard: int) -> np.ndarray:
        """The table rows of the unit's copies in ``epoch`` (a row may come more than once):
        per cell, its rows in an order drawn for the epoch, a systematic sample of
        ``counts[cell]`` by weight. All cells at once: cell ``c`` spans ``[C_c, C_c +
        counts[c])`` of one line (``C``: the counts before it), each row a stretch of its
        cell's in proportion to its weight, and the marks ``C_c + k + u_c`` fall in them."""
        rng = make_rng(seed, BALANCE_PICKS, source, epoch, first_shard)
        sizes = np.diff(self.starts)
        cell = np.repeat(np.arange(len(sizes)), sizes)
        order = np.lexsort((rng.random(len(cell)), cell))  # within each cell, shuffled
        totals = np.add.reduceat(self.weights, self.starts[:-1]) if len(cell) else sizes
        scale = np.divide(self.counts, totals, out=np.zeros(len(sizes)), where=totals > 0)
        ends = np.cumsum(self.weights[order] * scale[cell])
        before = np.cumsum(self.counts) - self.counts
        offsets = rng.random(len(sizes))
        marks = np.repeat(before + offsets, self.counts) + (
            np.arange(self.size) - np.repeat(before, self.counts)
        )
        return self.rows[order[np.minimum(np.searchsorted(ends, marks, "right"), len(cell) - 1)]]


def allocate(chosen: Chosen, units: Sequence[Sequence[int]]) -> list[UnitPicks]:
    """The copies of each of a sub-stream's ``units`` (shard ids), dealt as the module
    docstring says. A cell's remainder is carried in frames, not copies: a copy of a unit of
    short utterances carried into one of long ones would move the cell's hours."""
    weights, cells_of, shard_rows = chosen.weights, chosen.cells, chosen.shard_rows
    carry = np.zeros(int(cells_of.max(initial=0)) + 1)  # frames owed to each cell
    done, out = 0.0, []
    for unit in units:
        rows = np.concatenate([np.arange(shard_rows[s], shard_rows[s + 1]) for s in unit])
        rows = rows[weights[rows] > 0].astype(np.int64)
        rows = rows[np.argsort(cells_of[rows], kind="stable")]
        before = round(done)
        done += float(weights[rows].sum())
        cells, starts = np.unique(cells_of[rows], return_index=True)
        counts = np.zeros(0, np.int64)
        if len(rows):
            copies = np.add.reduceat(weights[rows], starts)
            frames = np.add.reduceat(weights[rows] * chosen.frames[rows], starts)
            per_copy = frames / copies
            target = (frames + carry[cells]) / per_copy
            counts = _largest_remainders(target, round(done) - before)
            carry[cells] += frames - counts * per_copy
        out.append(UnitPicks(rows, np.append(starts, len(rows)), counts, weights[rows]))
    return out


def _largest_remainders(target: np.ndarray, size: int) -> np.ndarray:
    """Whole counts ≥ 0 summing to ``size``, each as near its ``target`` as that allows."""
    counts = np.maximum(np.floor(target), 0).astype(np.int64)
    while (short := size - int(counts.sum())) != 0 and len(counts):
        rest = target - counts
        if short > 0:  # the largest remainders first
            counts[np.argsort(-rest, kind="stable")[:short]] += 1
        else:  # the smallest, of cells that still hold a copy
            held = [i for i in np.argsort(rest, kind="stable").tolist() if counts[i] > 0]
            counts[held[:-short]] -= 1
    return counts


def epoch_report(
    subs: Sequence[Any], chosen: Sequence[Chosen], shares: Sequence[float], seed: int, epoch: int
) -> dict[str, float]:
    """What epoch ``epoch`` of every sub-stream deals, against the target: the hours' share
    of each language and weight value (``heard/…`` and ``target/…``) and the total-variation
    distance per speaker, language and weight (``heard/speaker_tv`` …), the caches of a mix
    combined by their frame ``shares``."""
    report: dict[str, float] = {}
    for source, pick in enumerate(chosen):
        copies = np.zeros(len(pick.weights))
        for sub in subs:
            if sub.source == source:
                for unit, unit_picks in zip(sub.units, sub.picks, strict=True):
                    np.add.at(copies, unit_picks.rows_of(seed, source, epoch, unit[0]), 1)
        for group, codes in pick.groups.items():
            size = int(codes.max(initial=0)) + 1
            got = np.bincount(codes, copies * pick.frames, size)
            want = np.bincount(codes, pick.weights * pick.frames, size)
            got, want = got / max(got.sum(), 1), want / max(want.sum(), 1)
            key = f"heard/{group}_tv"
            report[key] = report.get(key, 0.0) + shares[source] * 0.5 * float(
                np.abs(got - want).sum()
            )
            for code, name in enumerate(pick.names.get(group, ())):
                for kind, values in (("heard", got), ("target", want)):
                    label = f"{kind}/{group}/{name}"
                    report[label] = report.get(label, 0.0) + shares[source] * float(values[code])
    return {"heard_epoch": float(epoch), **{k: round(v, 5) for k, v in report.items()}}
