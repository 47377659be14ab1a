"""The on-disk format of a melcache cache: the one module that knows member names and dtypes.

A cache folder holds ``index.json`` (written last: its presence means the cache is
complete), ``rejected.jsonl``, ``stats.zarr`` and tar shards named ``bNN-NNNNNN.tar``.
Each shard holds utterances of one length bucket, one WebDataset sample per utterance:

- ``<key>.mel.npy``: float16 ``[frames, n_mels]`` natural-log mel, ``np.save`` format, or
  ``<key>.mel.q5`` in a cache built with the compact storage (:mod:`melcache.storage`);
- ``<key>.json``: UTF-8 metadata (text, speaker, seconds, frames, sample_rate, source, bucket,
  and ``extras`` in a cache built with ``[build] extras``: :mod:`melcache.extras`);
- ``<key>.flac``: the resampled mono audio, only when built with ``--keep-audio``.

Readers decode only these members, ``np.load(..., allow_pickle=False)`` for the mel, and
ignore anything else, so a planted ``.pickle`` member is never deserialised.

The tar layer under it is :mod:`melcache.tar`: the writer of these samples and the shard
readers. :func:`decode_mel_npy` (``np.load``) reads any ``.npy``; it costs ~130 µs a sample,
so :func:`fast_decode_mel` reads the one header ``np.save`` writes for ``MEL_DTYPE`` and hands
any other to it, so their rules are one set.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import numpy as np

from melcache.bounded import loads_json
from melcache.errors import ShardError
from melcache.storage import FP16, MEL_MEMBERS

FORMAT_VERSION = 1
INDEX_NAME = "index.json"
REJECTED_NAME = "rejected.jsonl"
STATS_NAME = "stats.zarr"
MEL_MEMBER = MEL_MEMBERS[FP16]
META_MEMBER = "json"
AUDIO_MEMBER = "flac"
KNOWN_MEMBERS = (*MEL_MEMBERS.values(), META_MEMBER, AUDIO_MEMBER)
MEL_DTYPE = np.dtype("<f2")
SHARD_PATTERN = re.compile(r"^b(\d{2})-(\d{6})\.tar$")

# This machine as temporary file names and build markers name it.
HOST_TAG = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"
_TEMP_NAME = re.compile(r"\.(?:(?P<host>[A-Za-z0-9_]+)-)?(?P<pid>\d+)\.tmp$")
_FP16_EXPONENT = 0x7C00
# The exact header np.save writes for a C-ordered 2-D MEL_DTYPE array (format 1.0).
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_NPY_HEADER = re.compile(
    rb"\{'descr': '%s', 'fortran_order': False, 'shape': \((\d+), (\d+)\), \} *\n"
    % MEL_DTYPE.str.encode()
)


def shard_name(bucket: int, number: int) -> str:
    """File name of shard ``number`` (global in the build plan) of length bucket ``bucket``."""
    return f"b{bucket:02d}-{number:06d}.tar"


def encode_sample(
    key: str,
    mel: np.ndarray | bytes,
    meta: dict[str, Any],
    flac: bytes | None = None,
    mel_member: str = MEL_MEMBER,
) -> dict[str, Any]:
    """Serialise one utterance into the tar members of a WebDataset sample: ``mel`` is a
    float16 array (stored as ``mel.npy``) or the bytes of ``mel_member`` already encoded."""
    sample: dict[str, Any] = {
        "__key__": key,
        mel_member: mel if isinstance(mel, bytes) else encode_npy(mel),
        META_MEMBER: json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8"),
    }
    if flac is not None:
        sample[AUDIO_MEMBER] = flac
    return sample


def encode_npy(mel: np.ndarray) -> bytes:
    """A mel as ``mel.npy`` bytes: ``MEL_DTYPE`` in ``np.save`` format (its 1.0 header, then
    the array's bytes; ``np.save`` copied them three times through its buffered iterator)."""
    mel = np.ascontiguousarray(mel, dtype=MEL_DTYPE)
    return _npy_header(mel.shape) + mel.tobytes()


@functools.lru_cache(maxsize=4096)  # one per frame count
def _npy_header(shape: tuple[int, ...]) -> bytes:
    header = {"descr": MEL_DTYPE.str, "fortran_order": False, "shape": shape}
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def decode_mel_npy(data: bytes, n_mels: int, where: str) -> np.ndarray:
    """Parse a ``mel.npy`` member without unpickling; check dtype and shape."""
    try:
        mel = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:  # a garbled header reaches ast/tokenize: any of their errors
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever raised
        raise ShardError(f"{where}: mel.npy is not a plain numpy array ({detail})") from None
    if mel.dtype != MEL_DTYPE or mel.ndim != 2 or mel.shape[1] != n_mels:
        raise ShardError(
            f"{where}: mel.npy has dtype {mel.dtype} shape {mel.shape}, "
            f"expected float16 [frames, {n_mels}]"
        )
    return mel


def finite_mel(mel: np.ndarray) -> bool:
    """True when a ``MEL_DTYPE`` array holds no NaN or infinity: a float16 whose exponent bits
    are all ones is one of them (6× faster than ``np.isfinite`` on float16)."""
    if mel.size == 0:
        return True
    exponents = np.bitwise_and(mel.view(np.uint16), _FP16_EXPONENT)
    return int(exponents.max()) != _FP16_EXPONENT


def is_unicode(text: str) -> bool:
    """Whether ``text`` can be stored as UTF-8: no lone surrogate, such as the ones Python
    gives a file name's undecodable bytes or JSON's ``"\\ud800"``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode_meta(data: bytes, where: str) -> dict[str, Any]:
    """Parse a ``json`` member."""
    try:
        meta = loads_json(data.decode("utf-8"))
    except ValueError as exc:  # also UnicodeDecodeError, and nesting too deep
        raise ShardError(f"{where}: json member is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ShardError(f"{where}: json member is not an object")
    return meta


def temp_path(path: Path) -> Path:
    """A temporary name beside ``path`` that says who writes it, ``NAME.HOST-PID.tmp``: builds
    on several machines (or twice on one) share a folder, and a sweep may only remove the
    temporary files of writers that are gone (:func:`temp_owner`)."""
    return path.with_name(f"{path.name}.{HOST_TAG}-{os.getpid()}.tmp")


def temp_owner(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of the writer of a temporary file named by :func:`temp_path` (host ""
    for the older ``NAME.PID.tmp``); ``None`` when ``name`` is no such file."""
    match = _TEMP_NAME.search(name)
    if match is None:
        return None
    return match["host"] or "", int(match["pid"])


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, then rename: never half a file."""
    temp = temp_path(path)
    try:
        temp.write_bytes(data)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)  # gone after the rename; a failed write leaves nothing


def fast_decode_mel(data: bytes | memoryview, n_mels: int, where: str) -> np.ndarray:
    """:func:`decode_mel_npy` without its ~130 µs ``np.load`` for the header the build
    writes: a read-only array viewing ``data``. Never unpickles; anything else goes to
    ``decode_mel_npy`` (which checks it and raises :class:`ShardError`)."""
    if data[:8] == _NPY_MAGIC:
        end = 10 + int.from_bytes(data[8:10], "little")
        match = _NPY_HEADER.fullmatch(data[10:end])
        if match and int(match[2]) == n_mels:
            count = int(match[1]) * n_mels
            if len(data) == end + count * MEL_DTYPE.itemsize:
                return np.frombuffer(data, MEL_DTYPE, count, end).reshape(-1, n_mels)
    return decode_mel_npy(data, n_mels, where)
