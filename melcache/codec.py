"""Encoding and decoding mels in each storage of :mod:`melcache.storage`.

``fp16`` is ``np.save`` float16 (:mod:`melcache.format` reads it without ``np.load``).
``lz4-q5`` (``mel.q5``) holds integer codes ``round(mel / 2^-5)``. Neighbouring values of
a log-mel are close in time and in frequency, so what is stored is each code minus its left
and upper neighbours plus the diagonal one (the 2-D difference, whose inverse is a prefix
sum along each axis), one signed byte each (the rare ones beyond a byte: 0 there, and their
flat positions and int16 values after the bytes), all in one Blosc buffer, bit-shuffled and
LZ4-compressed (numcodecs, which zarr brings). About 0.94 bytes per value, under half of
fp16's 2. Chosen by measurement (``benchmarks/store/storage_bench.py``; numbers in docs/results.md)
over lilcom (larger), zstd'd fp16 and 1-D deltas (larger), and the same bytes through zstd
(24 MB per hour instead of 32, but the loader then ran at 0.63-0.70x fp16's samples/s).
A 20-byte header leads: magic, frames, n_mels, escapes. Every reader decodes through
:func:`decode_mel_into`, which never unpickles and checks sizes before it inflates.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from functools import cache

import numpy as np
import torch
from numcodecs import blosc

from melcache.errors import ShardError
from melcache.format import MEL_DTYPE, encode_npy, fast_decode_mel
from melcache.storage import FP16, STEP

_MAGIC = b"\x93MEL.Q5\x01"
_HEADER = struct.Struct("<8sIHHI")  # magic, frames, n_mels, unused (0), escapes
_WIDEST = 2**15 - 1  # an escaped residual is an int16
_STEP32 = np.float32(STEP)
_BLOSC_HEADER = 16  # its nbytes at [4:8] and cbytes at [12:16], little-endian
blosc.use_threads = False  # loader workers are processes already
_scratch = threading.local()  # per-thread buffers a decode reuses (see _reused)


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
    if np.abs(residuals).max(initial=0) > _WIDEST:  # only values beyond ±256: not a log-mel
        raise ValueError(f"{storage} cannot hold a mel with values ~1000 log units apart")
    small = residuals.astype(np.int8)
    positions = np.flatnonzero(small != residuals).astype("<u4")
    small.flat[positions] = 0
    escaped = residuals.flat[positions].astype("<i2")
    payload = small.tobytes() + positions.tobytes() + escaped.tobytes()
    # Bit-shuffled, the high bit planes of small residuals are runs that LZ4 removes
    # (33.6 -> 31.8 MB per hour, measured); level 9 packs as tightly as LZ4HC, decodes faster.
    packed = blosc.compress(payload, b"lz4", 9, blosc.BITSHUFFLE, 0)
    return _HEADER.pack(_MAGIC, mel.shape[0], mel.shape[1], 0, len(positions)) + packed


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
    """The float16 mel of a decompressed lz4-q5 payload, into ``out[:frames]``."""
    count = frames * n_mels
    small = raw[:count].view(np.int8).reshape(frames, n_mels)
    tail = bytearray(raw[count:])  # a copy: the escape lists may be unaligned in raw
    positions = np.frombuffer(tail, "<u4", escapes)
    escaped = np.frombuffer(tail, "<i2", escapes, offset=4 * escapes).astype(np.float32)
    values = _reused("values", count, np.float32).reshape(frames, n_mels)
    if _compiled_prefix_sums()(small, positions, escaped, values) != escapes:
        raise ShardError(f"{where}: mel.q5 escape positions are not increasing within the mel")
    torch.from_numpy(out[:frames]).copy_(torch.from_numpy(values))


@cache
def _compiled_prefix_sums() -> Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]:
    """:func:`_prefix_sums` compiled by numba (which librosa brings), imported only here: a
    process that never decodes lz4-q5 does not pay numba's ~0.6 s import."""
    import numba

    signature = "int64(int8[:, ::1], uint32[::1], float32[::1], float32[:, ::1])"
    return numba.njit(signature, cache=True, nogil=True)(_prefix_sums)


# Hand-written: no library fuses the two prefix sums with the scale, and numpy's and torch's
# one pass each are ~5x slower in all (measured on 100-mel utterances, 2026-12-01).
def _prefix_sums(
    small: np.ndarray, positions: np.ndarray, escaped: np.ndarray, values: np.ndarray
) -> int:
    """Undo the 2-D difference of ``small`` plus ``escaped`` at flat ``positions`` into
    ``values`` times the step; return how many escapes were used, fewer than given when the
    positions do not increase within the array. Float sums of integers are exact here."""
    frames, n_mels = small.shape
    across_frequency = np.zeros(n_mels, np.float32)  # running sum over time, per channel
    used, last = 0, -1
    for frame in range(frames):
        for channel in range(n_mels):  # vectorised: the channels are independent
            across_frequency[channel] += small[frame, channel]
        row_end = (frame + 1) * n_mels
        while used < len(positions) and positions[used] < row_end:
            if positions[used] <= last:
                return used
            last = positions[used]
            across_frequency[last - frame * n_mels] += escaped[used]
            used += 1
        code = np.float32(0)
        for channel in range(n_mels):
            code += across_frequency[channel]
            values[frame, channel] = code * _STEP32
    return used


def _reused(name: str, size: int, dtype: type[np.generic]) -> np.ndarray:
    """This thread's scratch array ``name``, its first ``size`` items: fresh arrays would cost
    a mel ~40 µs of page faults, a third of its decode (measured)."""
    buffer = getattr(_scratch, name, None)
    if buffer is None or len(buffer) < size:
        buffer = np.empty(size, dtype)
        setattr(_scratch, name, buffer)
    return buffer[:size]


def _header(data: bytes | memoryview, n_mels: int, where: str) -> tuple[int, int]:
    if len(data) < _HEADER.size + _BLOSC_HEADER:
        raise ShardError(f"{where}: mel.q5 is {len(data)} bytes, too short to be one")
    magic, frames, channels, _, escapes = _HEADER.unpack_from(data)
    if magic != _MAGIC or channels != n_mels or frames == 0:
        raise ShardError(
            f"{where}: mel.q5 header is not an lz4-q5 mel of {n_mels} channels "
            f"(magic {bytes(magic)!r}, {frames} frames × {channels})"
        )
    if escapes > frames * n_mels:
        raise ShardError(f"{where}: mel.q5 header gives more escapes than values")
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
    size = frames * n_mels + 6 * escapes
    # Blosc's own header gives both sizes: checked here, so a forged one can neither make
    # the decompressor allocate nor leave bytes of the output unwritten.
    nbytes = int.from_bytes(packed[4:8], "little")
    cbytes = int.from_bytes(packed[12:16], "little")
    if nbytes != size or cbytes != len(packed):
        raise ShardError(
            f"{where}: mel.q5 holds {nbytes} bytes in {cbytes}, expected {size} in {len(packed)}"
        )
    raw = _reused("raw", size, np.uint8)
    try:
        blosc.decompress(packed, raw)
    except (RuntimeError, ValueError) as exc:
        raise ShardError(f"{where}: mel.q5 does not decompress ({exc})") from None
    return frames, escapes, raw
