"""The padded training batch and how raw samples become one.

Conventions the model relies on:

- ``mel`` and ``text`` are padded to a multiple of ``pad_multiple`` (8 by default) frames
  and tokens, so the model's sequence and attention mask are aligned for fast kernels.
- ``mel`` stays float16 on the host (half the bytes to copy); padded frames hold
  ``ln(log_floor)`` of the cache's features, the value of silence in log space, not 0.0
  (which is a loud mel). Mask by ``mel_lengths`` anyway.
- ``text`` holds the ids of ``[data] tokenizer``, padded with :data:`PAD_ID` = 0; the rule
  and the tokenizers are in ``train/model/tokenizers.py`` (default: UTF-8 bytes + 1, vocabulary 257).
- ``extras`` holds the per-utterance fields asked for (``data.extras``, or a model's
  ``melcache_contract["extras"]``): a stored field (``melcache/extras.py``) as a list of ``B``
  values (``None`` where the row had none), and ``"reference"`` as int64 ``[B]``: for each
  utterance the row of the next utterance of the same speaker in this batch (cyclically, in
  row order), ``-1`` when it has no speaker or is its speaker's only one in the batch; the
  reference's mel is then ``mel[r, : mel_lengths[r]]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from melcache.batch_plans import round_up
from melcache.codec import decode_mel_into
from melcache.errors import ShardError, UserError
from melcache.extras import REFERENCE
from melcache.format import finite_mel
from melcache.reader import RawSample

PAD_ID = 0
BYTE_VOCAB_SIZE = 257

Tokenizer = Callable[[str], Sequence[int]]


def token_ids(
    tokenizer: Tokenizer, text: str, name: str | None = None, vocab_size: int | None = None
) -> np.ndarray:
    """``tokenizer(text)`` as int64 ids in ``1 .. vocab_size - 1`` (``vocab_size``: the given
    one, else the tokenizer's attribute, else no upper bound), else a :class:`UserError` naming
    the tokenizer, what it returned and the text: a str, ``None``, nested lists, floats (1.9
    would silently become id 1) or ids past 64 bits must not reach the embedding."""
    out = tokenizer(text)
    if getattr(tokenizer, "gives_checked_ids", False):  # train's Checked: checked already
        return out
    if vocab_size is None:
        vocab_size = getattr(tokenizer, "vocab_size", None)
    ids = _as_ids(out)
    who = name or getattr(tokenizer, "__qualname__", None) or type(tokenizer).__qualname__
    if ids is None:
        shown = repr(out) if len(repr(out)) < 60 else f"{repr(out)[:57]}..."
        raise UserError(
            f"tokenizer {who} returned {type(out).__name__} {shown} for {text[:40]!r}: a "
            "tokenizer returns a flat list or 1-D array of int ids"
        )
    bounded = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
    if ids.size and (ids.min() <= PAD_ID or (bounded and ids.max() >= vocab_size)):
        top = f"{vocab_size - 1} (vocab_size {vocab_size})" if bounded else "..."
        raise UserError(
            f"tokenizer {who} gave ids {ids.min()}..{ids.max()} for {text[:40]!r}: ids must be "
            f"in 1..{top}; 0 is padding"
        )
    return ids


def _as_ids(out: object) -> np.ndarray | None:
    """``out`` as a 1-D int64 array, or ``None`` when it is not a flat sequence of integers
    that fit 64 bits."""
    if out is None or isinstance(out, (str, bytes, bytearray, Mapping)):
        return None
    try:
        ids = np.asarray(out)
    except (ValueError, TypeError, OverflowError):  # ragged lists, odd objects
        return None
    if ids.ndim != 1:
        return None
    if ids.size == 0:
        return np.zeros(0, np.int64)
    if ids.dtype.kind not in "iu":  # floats, bools, objects (ints past 64 bits)
        return None
    if ids.dtype.kind == "u" and ids.max() > np.iinfo(np.int64).max:
        return None
    return ids.astype(np.int64, copy=False)


def utf8_tokens(text: str) -> np.ndarray:
    """Default tokenizer: the UTF-8 bytes of ``text`` plus one (0 is the padding id)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + 1


@dataclasses.dataclass
class Batch:
    """A padded batch of ``B`` utterances; tensors are on the host until :meth:`to`."""

    mel: torch.Tensor  # float16 [B, T, n_mels], T a multiple of pad_multiple
    mel_lengths: torch.Tensor  # int64 [B], true frame counts
    text: torch.Tensor  # int64 [B, L] token ids, 0-padded
    text_lengths: torch.Tensor  # int64 [B]
    keys: list[str]
    speaker: list[str | None]
    bucket: int  # the length bucket of the shard it comes from (-1: not from a cache)
    source: str = ""  # the cache (location, as given to make_loader) it comes from
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)  # fields asked for
    # Derived fields asked for (data.fields): [B, T_field, *shape] zero-padded, integers as
    # int64, floats as float32; and their true lengths, int64 [B] (melcache/fields/format.py).
    fields: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    field_lengths: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        return dataclasses.replace(
            self,
            mel=fn(self.mel),
            mel_lengths=fn(self.mel_lengths),
            text=fn(self.text),
            text_lengths=fn(self.text_lengths),
            extras={k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()},
            fields={k: fn(v) for k, v in self.fields.items()},
            field_lengths={k: fn(v) for k, v in self.field_lengths.items()},
        )

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        """Copy the tensors to ``device``; asynchronous when they are in pinned memory."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Page-locked copy, called by DataLoader's pin-memory thread."""
        return self._map(lambda t: t.pin_memory())


@dataclasses.dataclass
class PackedBatch:
    """A batch as it leaves a worker: the mel is already in a shared ring slot (see
    ``melcache/loader/transport.py``), the rest travels as small arrays."""

    seq: int  # ring item number
    mel_shape: tuple[int, int, int]
    mel_lengths: np.ndarray
    text: np.ndarray
    text_lengths: np.ndarray
    keys: list[str]
    speaker: list[str | None]
    bucket: int
    source: str
    extras: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    fields: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    field_lengths: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def unpack(self, mel: torch.Tensor, pin_memory: bool) -> Batch:
        """The :class:`Batch`, given the mel copied out of the ring."""
        small = [torch.from_numpy(a) for a in (self.mel_lengths, self.text, self.text_lengths)]
        extras: dict[str, Any] = dict(self.extras)
        if REFERENCE in extras:
            extras[REFERENCE] = torch.tensor(extras[REFERENCE], dtype=torch.int64)
        fields = {k: torch.from_numpy(v) for k, v in self.fields.items()}
        lengths = {k: torch.from_numpy(v) for k, v in self.field_lengths.items()}
        if pin_memory:
            small = [t.pin_memory() for t in small]
            fields = {k: v.pin_memory() for k, v in fields.items()}
            lengths = {k: v.pin_memory() for k, v in lengths.items()}
            extras = {
                k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in extras.items()
            }
        return Batch(
            mel, *small, keys=self.keys, speaker=self.speaker, bucket=self.bucket,
            source=self.source, extras=extras, fields=fields, field_lengths=lengths,
        )  # fmt: skip


def collate(
    samples: Sequence[RawSample],
    *,
    seq: int,
    mel_out: Callable[[tuple[int, int, int]], np.ndarray],
    n_mels: int,
    pad_multiple: int,
    pad_value: float,
    tokenizer: Tokenizer,
    where: str,
    bucket: int,
    source: str = "",
    extras: Sequence[str] = (),
) -> PackedBatch:
    """Decode the mels (never unpickling) and pad them into ``mel_out(shape)``, the rest
    into a :class:`PackedBatch` with the ``extras`` fields asked for."""
    shape = (len(samples), round_up(max(s.frames for s in samples), pad_multiple), n_mels)
    out = mel_out(shape)
    for row, sample in enumerate(samples):
        name = f"{where}:{sample.key}"
        if not n_mels:  # a model that reads fields alone: no mel was read (data.read_mel)
            continue
        frames = decode_mel_into(sample.mel, sample.storage, n_mels, name, out[row])
        if frames != sample.frames:
            raise ShardError(f"{name}: the mel has {frames} frames, metadata says {sample.frames}")
        out[row, frames:] = pad_value
    if not finite_mel(out):  # the build never writes one: a forged or hand-made shard
        row = next(row for row in range(len(samples)) if not finite_mel(out[row]))
        raise ShardError(f"{where}:{samples[row].key}: the mel holds NaN or infinite values")
    tokens = [token_ids(tokenizer, s.text) for s in samples]
    # Text padded like the mel: text + mel then stays a multiple of pad_multiple, so SDPA's
    # efficient kernels take the [B, 1, S, S] mask as it is instead of padding a copy per layer.
    width = round_up(max(1, *(len(t) for t in tokens)), pad_multiple)
    text = np.full((len(samples), width), PAD_ID, dtype=np.int64)
    for row, ids in enumerate(tokens):
        text[row, : len(ids)] = ids
    return PackedBatch(
        seq=seq,
        mel_shape=shape,
        mel_lengths=np.array([s.frames for s in samples], dtype=np.int64),
        text=text,
        text_lengths=np.array([len(t) for t in tokens], dtype=np.int64),
        keys=[s.key for s in samples],
        speaker=[s.speaker for s in samples],
        bucket=bucket,
        source=source,
        extras={name: batch_extra(samples, name, where) for name in extras},
    )


def batch_extra(samples: Sequence[RawSample], name: str, where: str) -> list[Any]:
    """One extras field of a batch's samples (:data:`REFERENCE`: derived from the speakers)."""
    if name == REFERENCE:
        return reference_rows([s.speaker for s in samples])
    missing = next((s.key for s in samples if name not in s.extras), None)
    if missing is not None:
        raise ShardError(f"{where}:{missing}: metadata has no extras field {name!r}")
    return [s.extras[name] for s in samples]


def reference_rows(speakers: Sequence[str | None]) -> list[int]:
    """Per row, the next row (cyclically) of the same speaker, or -1 (no speaker, or alone)."""
    rows: dict[str, list[int]] = {}
    for row, speaker in enumerate(speakers):
        if speaker is not None:
            rows.setdefault(speaker, []).append(row)
    out = [-1] * len(speakers)
    for same in rows.values():
        if len(same) > 1:
            for k, row in enumerate(same):
                out[row] = same[(k + 1) % len(same)]
    return out


def extras_rows(extras: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``start:stop`` of a batch's extras (a batch cut into pieces): references are
    renumbered within the piece, and one to a row outside it becomes -1."""
    out = {}
    for name, values in extras.items():
        if name == REFERENCE:
            rows = values[start:stop]
            inside = (rows >= start) & (rows < stop)
            out[name] = torch.where(inside, rows - start, torch.full_like(rows, -1))
        else:
            out[name] = values[start:stop]
    return out


def stand_in_extras(names: Sequence[str], size: int) -> dict[str, Any]:
    """Extras for a made-up batch of ``size`` rows (a stand-in pass, ``train tune``'s worst
    batch): stored fields ``None``, and each row's reference the next row, as much as a model
    can be asked to do."""
    following = torch.roll(torch.arange(size), -1) if size > 1 else torch.full((size,), -1)
    return {name: following if name == REFERENCE else [None] * size for name in names}
