"""Encoding and decoding mels in each storage of :mod:`melcache.storage`.

``fp16`` is ``np.save`` float16 (:mod:`melcache.format` reads it without ``np.load``).
``zstd-q5`` (``mel.zq5``) holds integer codes ``round(mel / 2^-5)``. Neighbouring values of
a log-mel are close in time and in frequency, so what is stored is each code minus its left
and upper neighbours plus the diagonal one (the 2-D difference, whose inverse is a prefix
sum along each axis: vectorised, unlike a per-value predictor), one signed byte each, the
rare ones beyond ±127 escaped to an int16 list, and those bytes compressed with Blosc's zstd
(numcodecs, which zarr brings). About 0.7 bytes per value, a third of fp16's 2; chosen by
measurement (``benchmarks/storage_bench.py``) over lilcom, zstd'd fp16 and 1-D time
deltas. A 20-byte header leads: magic, frames, n_mels, escapes. Every reader decodes through
:func:`decode_mel_into`, which never unpickles and checks sizes before it inflates.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from numcodecs import blosc

from melcache.errors import ShardError
from melcache.format import MEL_DTYPE, encode_npy, fast_decode_mel
from melcache.storage import FP16, STEP

_MAGIC = b"\x93MELZQ5\x01"
_HEADER = struct.Struct("<8sIHHI")  # magic, frames, n_mels, unused (0), escapes
_ESCAPE = -128  # a residual byte meaning "the next value of the int16 list"
_BLOSC_HEADER = 16  # its nbytes at [4:8] and cbytes at [12:16], little-endian
blosc.use_threads = False  # loader workers are processes already


def encode_mel(mel: np.ndarray, storage: str) -> bytes:
    """A float32 log-mel ``[frames, n_mels]`` as the bytes of its ``storage`` member."""
    if storage == FP16:
        return encode_npy(np.ascontiguousarray(mel, dtype=MEL_DTYPE))
    codes = np.rint(mel * np.float32(1 / STEP)).astype(np.int32)  # exact: a power-of-two scale
    across_time = np.empty_like(codes)
    across_time[0] = codes[0]
    np.subtract(codes[1:], codes[:-1], out=across_time[1:])
    residuals = np.empty_like(codes)
    residuals[:, 0] = across_time[:, 0]
    np.subtract(across_time[:, 1:], across_time[:, :-1], out=residuals[:, 1:])
    small = residuals.astype(np.int8)
    wide = (small != residuals) | (small == _ESCAPE)
    small[wide] = _ESCAPE
    escapes = residuals[wide].astype("<i2")  # |residual| ≤ 4 · 2^11 for any fp16-range mel
    # zstd level 1: as small as level 3 on mels (measured) at a quarter of the time.
    packed = blosc.compress(small.tobytes() + escapes.tobytes(), b"zstd", 1, blosc.NOSHUFFLE, 0)
    return _HEADER.pack(_MAGIC, mel.shape[0], mel.shape[1], 0, len(escapes)) + packed


def decode_mel_into(
    data: bytes | memoryview, storage: str, n_mels: int, where: str, out: np.ndarray
) -> int:
    """Decode a mel member into the first rows of ``out`` (float16 ``[rows, n_mels]``) and
    return its frame count; :class:`ShardError` naming ``where`` when the member is not a
    well-formed mel of ``n_mels`` channels that fits in ``out``."""
    if storage == FP16:
        mel = fast_decode_mel(data, n_mels, where)
        if len(mel) > len(out):
            raise ShardError(f"{where}: mel has {len(mel)} frames, more than the metadata says")
        out[: len(mel)] = mel
        return len(mel)
    frames, escapes, raw = _unpack(data, n_mels, where, len(out))
    _undo_differences(raw, frames, escapes, n_mels, where, out)
    return frames


def decode_mel(data: bytes | memoryview, storage: str, n_mels: int, where: str) -> np.ndarray:
    """A mel member as a float16 ``[frames, n_mels]`` array (:func:`decode_mel_into`)."""
    if storage == FP16:
        return fast_decode_mel(data, n_mels, where)
    frames, escapes, raw = _unpack(data, n_mels, where, most_frames=None)
    out = np.empty((frames, n_mels), MEL_DTYPE)
    _undo_differences(raw, frames, escapes, n_mels, where, out)
    return out


def _undo_differences(
    raw: np.ndarray, frames: int, escapes: int, n_mels: int, where: str, out: np.ndarray
) -> None:
    """The float16 mel of a decompressed zstd-q5 payload, into ``out[:frames]``."""
    count = frames * n_mels
    small = raw[:count].view(np.int8).reshape(frames, n_mels)
    codes = torch.from_numpy(small).to(torch.int32).numpy()  # torch's cast: 1.5x numpy's
    marked = np.flatnonzero(small == _ESCAPE)
    if len(marked) != escapes:
        raise ShardError(f"{where}: mel.zq5 marks {len(marked)} escapes, its header {escapes}")
    codes.flat[marked] = raw[count:].view("<i2")
    # The 2-D difference undone, each prefix sum where it is vectorised (measured: numpy's
    # along time, torch's along channels, both on int32; 1.7x faster than torch int16 both).
    np.cumsum(codes, axis=0, out=codes)
    summed = torch.from_numpy(codes).cumsum_(1)
    rows = torch.from_numpy(out[:frames])
    rows.copy_(summed.to(torch.float32).mul_(STEP))  # exact: k · 2^-5 is a float16, |k| < 2^11


def _header(data: bytes | memoryview, n_mels: int, where: str) -> tuple[int, int]:
    if len(data) < _HEADER.size + _BLOSC_HEADER:
        raise ShardError(f"{where}: mel.zq5 is {len(data)} bytes, too short to be one")
    magic, frames, channels, _, escapes = _HEADER.unpack_from(data)
    if magic != _MAGIC or channels != n_mels or frames == 0:
        raise ShardError(
            f"{where}: mel.zq5 header is not a zstd-q5 mel of {n_mels} channels "
            f"(magic {bytes(magic)!r}, {frames} frames × {channels})"
        )
    if escapes > frames * n_mels:
        raise ShardError(f"{where}: mel.zq5 header gives more escapes than values")
    return frames, escapes


def _unpack(
    data: bytes | memoryview, n_mels: int, where: str, most_frames: int | None
) -> tuple[int, int, np.ndarray]:
    """``(frames, escapes, the decompressed bytes)``, every size checked before inflating;
    more than ``most_frames`` frames (when given) is an error."""
    frames, escapes = _header(data, n_mels, where)
    if most_frames is not None and frames > most_frames:
        raise ShardError(f"{where}: mel has {frames} frames, more than the metadata says")
    packed = memoryview(data)[_HEADER.size :]
    size = frames * n_mels + 2 * escapes
    # Blosc's own header gives both sizes: checked here, so a forged one can neither make
    # the decompressor allocate nor leave bytes of the output unwritten.
    nbytes = int.from_bytes(packed[4:8], "little")
    cbytes = int.from_bytes(packed[12:16], "little")
    if nbytes != size or cbytes != len(packed):
        raise ShardError(
            f"{where}: mel.zq5 holds {nbytes} bytes in {cbytes}, expected {size} in {len(packed)}"
        )
    raw = np.empty(size, np.uint8)
    try:
        blosc.decompress(packed, raw)
    except (RuntimeError, ValueError) as exc:
        raise ShardError(f"{where}: mel.zq5 does not decompress ({exc})") from None
    return frames, escapes, raw
