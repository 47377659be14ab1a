"""Derived fields: per-utterance arrays a model made from the cached mels, stored beside them.

``python -m preprocess derive CACHE --field NAME --encoder MOD:FACTORY`` runs an encoder over
every mel and stores its output without touching a mel shard. Layout (one version folder per
provenance, so a ``--replace`` never overwrites the field readers are using)::

    fields/NAME/DIGEST/bNN-NNNNNN.tar   one field shard per mel shard, same name, same keys
    fields/NAME/DIGEST/rows.npy         uint64 [rows, 4]: offset, size, frames, digest
    fields/NAME/DIGEST/values.npy       [rows] of the field's dtype: a scalar field's values

A field shard is a plain tar (mtime 0, as mel shards): first ``.mel.json`` (key ``""``, which
no utterance has) binding it to its mel shard (name and sha256) and to the field, then one
``<key>.NAME.npy`` per utterance in the mel shard's order: ``[frames, *shape]`` of the field's
dtype, ``np.save`` format (no pickle), beside ``<key>.json``, the mel sample's metadata
verbatim (so a model that reads fields alone reads no mel shard). ``rows.npy`` has one row per utterance in the cache
table's row order: where that member's data starts in its field shard and its length, its
frames, and the low 32 bits of the data's xxh3_64 (checked before a random read is parsed).
A field is per frame (``[frames, *shape]``), or, where its encoder says ``per_utterance``, one
value per utterance (stored as ``[1, *shape]``). A per-utterance field of one number (``shape``
``()``: a quality score) also gets ``values.npy``, every utterance's value in table row order,
so ``data.where`` and ``data.balance.weight`` read it before any shard is read.
``index.json`` lists each field under ``fields`` with its provenance and every shard's bytes,
sha256 and xxh3_128, so ``verify`` and the loader check field shards like mel shards.

The encoder protocol (:class:`FieldEncoder`) is what ``--encoder package.module:factory``
returns: ``factory(checkpoint=PATH_OR_NONE, device=DEVICE)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import tarfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from melcache.bounded import loads_json
from melcache.errors import ShardError, UserError
from melcache.format import META_MEMBER
from melcache.index import check_shard_entry
from melcache.tar.reader import plain_tar_entries

FIELDS_KEY = "fields"  # in index.json
FIELDS_DIR = "fields"
ROWS_NAME = "rows.npy"
VALUES_NAME = "values.npy"
BOUND_NAME = ".mel.json"  # the key "" and member "mel.json": no utterance key is empty
FIELD_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # a member suffix: no dots, no paths
DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "float16", "float32")
ROW_COLUMNS = ("offset", "size", "frames", "digest")
_DIGEST = re.compile(r"^[0-9a-f]{16}$")


@dataclasses.dataclass(frozen=True)
class FieldEncoder:
    """What an ``--encoder`` factory returns.

    ``module`` maps a float32 mel batch ``[B, T, n_mels]`` (every row of one length ``T``, a
    multiple of ``mel_multiple``, padded with the cache's log floor, i.e. silence) to ``[B,
    T * frame_rate, *shape]``; derive casts the result to ``dtype`` (an integer field must
    come out integral). ``config`` (JSON) is the encoder's own configuration, ``weights`` the
    file its weights came from (hashed into the provenance), ``features`` the mel feature keys
    it expects (every one must equal the cache's). ``bf16``: CUDA may run it under bfloat16
    autocast (``False`` for encoders whose rounding would move). ``per_utterance``: the
    module gives ``[B, *shape]``, one value per utterance (a quality score), not per frame;
    with ``shape`` ``()`` the field is a number ``data.where`` can select on.
    """

    module: Callable[[Any], Any]
    config: Mapping[str, Any]
    dtype: str
    shape: tuple[int, ...]
    frame_rate: float = 1.0
    mel_multiple: int = 1
    weights: Path | None = None
    features: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    bf16: bool = True
    per_utterance: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UserError(f"encoder dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if not all(isinstance(n, int) and n > 0 for n in self.shape):
            raise UserError(f"encoder shape {self.shape!r}: expected positive integers")
        if not 0 < self.frame_rate <= 64 or self.mel_multiple < 1:
            raise UserError(
                f"encoder frame_rate {self.frame_rate!r} / mel_multiple {self.mel_multiple!r}: "
                "expected a rate in (0, 64] and a multiple ≥ 1"
            )

    @property
    def scalar(self) -> bool:
        """One number per utterance (what ``data.where`` can select on; :func:`is_scalar` of
        its index entry)."""
        return self.per_utterance and self.shape == ()

    def field_frames(self, mel_frames: int) -> int:
        """Frames of the field for a mel of ``mel_frames`` (padded to ``mel_multiple``)."""
        if self.per_utterance:
            return 1
        padded = -(-mel_frames // self.mel_multiple) * self.mel_multiple
        return round(padded * self.frame_rate)


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a field (``None``: it can)."""
    if not isinstance(name, str) or not FIELD_NAME.match(name):
        return "a lowercase name of letters, digits and _ (at most 32, starting with a letter)"
    return None


def provenance_digest(provenance: Mapping[str, Any]) -> str:
    """16 hex digits over what makes a field's values (not where its checkpoint lay)."""
    made = {k: v for k, v in provenance.items() if k != "checkpoint"}
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16]


def field_folder(name: str, digest: str) -> str:
    """Where the version ``digest`` of field ``name`` lives, relative to the cache."""
    return f"{FIELDS_DIR}/{name}/{digest}"


def encode_field(values: np.ndarray) -> bytes:
    """One utterance's field as ``np.save`` bytes (little-endian, C order, no pickle)."""
    buffer = io.BytesIO()
    array = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def bound_member(mel_shard: Mapping[str, Any], name: str, digest: str) -> bytes:
    """The first member of a field shard: which mel shard (by sha256) and field it belongs to."""
    bound = {"mel_shard": mel_shard["name"], "mel_sha256": mel_shard["sha256"], "field": name}
    return json.dumps({**bound, "provenance_digest": digest}, sort_keys=True).encode()


def cache_fields(index: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The index's fields, each entry checked (names, folder, shards aligned with the mel
    shards); :class:`UserError` naming the first bad one."""
    fields = index.get(FIELDS_KEY, {})
    if not isinstance(fields, dict):
        raise UserError(f"{where}: index.fields = {fields!r} is not an object")
    mel = [s["name"] for s in index["shards"]]
    for name, entry in fields.items():
        at = f"{where}: fields.{name}"
        problem = name_problem(name)
        if problem or not isinstance(entry, dict):
            raise UserError(f"{at}: expected {problem or 'an object'}")
        digest = entry.get("provenance_digest")
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise UserError(f"{at}.provenance_digest = {digest!r} is not 16 hex digits")
        if entry.get("folder") != field_folder(name, digest):  # a name, never a path to follow
            raise UserError(f"{at}.folder = {entry.get('folder')!r}, expected its own")
        if entry.get("dtype") not in DTYPES:
            raise UserError(f"{at}.dtype = {entry.get('dtype')!r}: one of {', '.join(DTYPES)}")
        _check_layout(entry, at)
        shards = entry["shards"]
        for number, shard in enumerate(shards):
            check_shard_entry(shard, f"{at}.shards[{number}]")
        if [s["name"] for s in shards] != mel:
            raise UserError(f"{at}.shards do not name the cache's {len(mel)} mel shards in order")
    return fields


def _check_layout(entry: Mapping[str, Any], at: str) -> None:
    """The types of a field entry's other keys, before any is used."""
    shape, rate, rows = entry.get("shape"), entry.get("frame_rate"), entry.get("rows")
    if not isinstance(shape, list) or not all(type(n) is int and n > 0 for n in shape):
        raise UserError(f"{at}.shape = {shape!r}: expected a list of positive integers")
    if type(rate) not in (int, float) or not 0 < rate <= 64:
        raise UserError(f"{at}.frame_rate = {rate!r}: expected a number in (0, 64]")
    if not isinstance(entry.get("provenance"), dict) or not isinstance(entry.get("shards"), list):
        raise UserError(f"{at}: provenance and shards must be an object and a list")
    if not isinstance(rows, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(rows.get("sha256"))):
        raise UserError(f"{at}.rows = {rows!r}: expected its sha256")
    if entry.get("per_utterance", False) not in (False, True):
        raise UserError(f"{at}.per_utterance = {entry['per_utterance']!r}: expected true")
    values = entry.get("values")
    if values is not None and not (
        is_scalar(entry)
        and isinstance(values, dict)
        and re.fullmatch(r"[0-9a-f]{64}", str(values.get("sha256")))
    ):
        raise UserError(f"{at}.values = {values!r}: expected the sha256 of a scalar field's")


def is_scalar(entry: Mapping[str, Any]) -> bool:
    """Whether a field entry holds one number per utterance (what ``data.where`` reads)."""
    return entry.get("per_utterance") is True and entry.get("shape") == []


def entry_frames(entry: Mapping[str, Any], mel_frames: int) -> int:
    """Frames of field ``entry`` for a mel of ``mel_frames``: :meth:`FieldEncoder.field_frames`
    from the index's record of it."""
    if entry.get("per_utterance"):
        return 1
    multiple = entry["provenance"].get("mel_multiple", 1)
    return round(-(-mel_frames // multiple) * multiple * entry["frame_rate"])


def missing_field(where: str, fields: Mapping[str, Any], name: str, by: str) -> UserError:
    """The one line for a field ``by`` asks for that cache ``where`` lacks."""
    held = ", ".join(fields) or "none"
    return UserError(
        f"cache {where} has no derived field {name!r}, asked for by {by} (it has {held}): "
        f"python -m preprocess derive {where} --field {name} --encoder MODULE:FACTORY"
    )


def provenance_problem(
    where: str, name: str, entry: Mapping[str, Any], wanted: Mapping[str, Any], by: str
) -> str | None:
    """Why the field's provenance is not what ``by`` declares (``None``: it is)."""
    have = entry.get("provenance", {})
    for key, value in wanted.items():
        if have.get(key) != value:
            return (
                f"cache {where} field {name!r} has {key} = {have.get(key)!r} but {by} declares "
                f"{key} = {value!r}: derive it again with the declared encoder "
                "(python -m preprocess derive ... --replace) or change the declaration"
            )
    return None


HEAD_BYTES = 2048  # the first tar header and the binding member after it, with room


def read_bound(data: bytes | memoryview, location: str) -> dict[str, Any]:
    """The binding member of a field shard (its first), checked to be one: ``data`` is the
    shard, or its first :data:`HEAD_BYTES` (what a random read fetches once per shard)."""
    try:
        info = tarfile.TarInfo.frombuf(bytes(data[:512]), "utf-8", "surrogateescape")
    except tarfile.TarError:
        info = None
    if info is None or info.name != BOUND_NAME or 512 + info.size > len(data):
        raise ShardError(f"{location}: not a field shard (no {BOUND_NAME} first)")
    start, size = 512, info.size
    try:
        bound = loads_json(bytes(data[start : start + size]).decode("utf-8"))
    except ValueError as exc:
        raise ShardError(f"{location}: {BOUND_NAME} is not JSON ({exc})") from None
    if not isinstance(bound, dict):
        raise ShardError(f"{location}: {BOUND_NAME} is not an object")
    return bound


def binding_problem(
    bound: Mapping[str, Any], mel_shard: Mapping[str, Any], location: str
) -> str | None:
    """Why the field shard was not derived from this cache's mel shard (``None``: it was)."""
    if bound.get("mel_sha256") != mel_shard.get("sha256"):
        return (
            f"{location}: a field shard of another cache: derived from a mel shard with sha256 "
            f"{str(bound.get('mel_sha256'))[:12]}…, this cache's {mel_shard['name']} has "
            f"{str(mel_shard.get('sha256'))[:12]}…"
        )
    return None


# The header np.save writes for a C-ordered little-endian array (format 1.0): read by hand,
# since np.load's header parse (~100 µs) costs more than the rest of a field's read.
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<|][iuf][1248])', 'fortran_order': False, 'shape': \((\d+),((?: \d+,?)*)\), \} *\n"
)


def _fast_npy(data: bytes | memoryview) -> np.ndarray | None:
    """The array of a plain ``.npy`` as derive writes it, viewing ``data``; ``None`` else."""
    if bytes(data[:8]) != _NPY_MAGIC:
        return None
    end = 10 + int.from_bytes(data[8:10], "little")
    match = _NPY_HEADER.fullmatch(bytes(data[10:end]))
    if match is None:
        return None
    dtype = np.dtype(match[1].decode())
    shape = (int(match[2]), *(int(n) for n in match[3].replace(b",", b" ").split()))
    if len(data) != end + dtype.itemsize * int(np.prod(shape)):
        return None
    return np.frombuffer(data, dtype, offset=end).reshape(shape)


def decode_field(data: bytes | memoryview, entry: Mapping[str, Any], where: str) -> np.ndarray:
    """One utterance's field from its ``.npy`` bytes, checked for dtype and per-frame shape."""
    array = _fast_npy(data)
    try:
        if array is None:  # anything unusual: numpy's own reader (never unpickling)
            array = np.load(io.BytesIO(bytes(data)), allow_pickle=False)
    except Exception as exc:  # a garbled header reaches ast/tokenize: any of their errors
        raise ShardError(f"{where}: not a plain numpy array ({type(exc).__name__})") from None
    shape = tuple(entry.get("shape", ()))
    if array.dtype != np.dtype(entry["dtype"]) or array.shape[1:] != shape or array.ndim < 1:
        raise ShardError(
            f"{where}: {array.dtype} {array.shape}, the index says {entry['dtype']} [T, "
            f"{', '.join(map(str, shape))}]"
        )
    if array.dtype.kind == "f" and not np.isfinite(array).all():  # written by an older derive
        raise ShardError(f"{where}: non-finite values (NaN or infinity) in a float field")
    return array


def field_samples(
    data: bytes | memoryview, name: str, entry: Mapping[str, Any], location: str
) -> list[tuple[str, np.ndarray]]:
    """``(key, values)`` of every utterance in a field shard, in order (binding skipped)."""
    entries = plain_tar_entries(data)  # type: ignore[arg-type]
    if entries is None:
        raise ShardError(f"{location}: not a plain tar as derive writes them")
    suffix, out = f".{name}.npy", []
    for member, start, size in entries[1:]:
        if member.endswith(f".{META_MEMBER}") and "/" not in member:
            continue  # the mel sample's metadata, for readers of fields alone
        if not member.endswith(suffix) or "/" in member:
            raise ShardError(f"{location}: unexpected member {member!r}")
        key = member[: -len(suffix)]
        out.append(
            (key, decode_field(memoryview(data)[start : start + size], entry, f"{location}:{key}"))
        )
    return out


def rows_array(rows: Sequence[tuple[int, int, int, int]]) -> bytes:
    """``rows.npy`` bytes from ``(offset, size, frames, digest)`` per utterance."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(rows, dtype="<u8").reshape(-1, len(ROW_COLUMNS)), allow_pickle=False)
    return buffer.getvalue()


def values_array(values: Sequence[float | int], dtype: str) -> bytes:
    """``values.npy`` bytes: a scalar field's value per utterance, in table row order."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<")), allow_pickle=False)
    return buffer.getvalue()


def pad_fields(values: Sequence[np.ndarray], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A batch of one field: zero-padded ``[B, T_max, *shape]`` (integers widened to int64,
    floats to float32) and the lengths ``[B]`` int64."""
    wide = np.int64 if np.dtype(dtype).kind in "iu" else np.float32
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    out = np.zeros((len(values), int(lengths.max(initial=0)), *values[0].shape[1:]), dtype=wide)
    for row, v in enumerate(values):
        out[row, : len(v)] = v
    return out, lengths
