"""One shard, read and checked against its index entry: the reader the loader and ``verify``
both use.

The shard is read whole (memory-mapped when local), its size and (optionally) sha256 are
checked against the index before any sample is parsed, and each sample's metadata is
checked for type. The mel stays undecoded bytes in a :class:`RawSample`, so a loader that
skips a sample never parses an array; :func:`melcache.codec.decode_mel_into` decodes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
from collections.abc import Callable, Iterator
from typing import Any

from melcache.errors import ShardError
from melcache.format import (
    AUDIO_MEMBER,
    META_MEMBER,
    decode_meta,
    group_samples,
    is_unicode,
    tar_members,
)
from melcache.location import read_bytes
from melcache.storage import STORAGE_OF_MEMBER


@dataclasses.dataclass(frozen=True)
class RawSample:
    """One utterance as read from a shard: metadata parsed, mel still its member's bytes."""

    key: str
    mel: bytes | memoryview
    storage: str  # how ``mel`` is stored (melcache.storage), by its member's name
    text: str
    speaker: str | None
    frames: int
    bucket: int | None  # None only in hand-made shards; the build always records it
    audio: bytes | memoryview | None  # the FLAC member of a --keep-audio build


def load_shard(location: str) -> bytes | mmap.mmap:
    """The bytes of the shard at ``location``; :class:`ShardError` when it cannot be read."""
    try:
        return read_bytes(location)
    except OSError as exc:
        raise ShardError(f"{location}: cannot read shard ({exc})") from None


def integrity_problems(
    data: bytes | mmap.mmap, entry: dict[str, Any], location: str, *, check_sha256: bool
) -> list[str]:
    """How the shard's bytes differ from its index entry: size, then sha256 (empty: sound)."""
    problems = []
    if "bytes" in entry and len(data) != entry["bytes"]:  # free, and names the likely cause
        problems.append(
            f"{location}: {len(data)} bytes, the index says {entry['bytes']} (truncated or replaced?)"
        )
    if check_sha256:
        if not entry.get("sha256"):
            problems.append(f"{location}: the index gives no sha256; set check_sha256=False")
        elif hashlib.sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{location}: sha256 differs from the index (corrupt or replaced)")
    return problems


def shard_samples(
    data: bytes | mmap.mmap, location: str, on_unknown: Callable[[str], None] | None = None
) -> Iterator[dict[str, Any]]:
    """The shard's samples as ``{"__key__": key, member: bytes}`` dicts, in tar order; members
    that are not melcache's are skipped unread (reported to ``on_unknown``)."""
    return group_samples(tar_members(data, location, on_unknown), location)


def raw_sample(sample: dict[str, Any], location: str) -> RawSample:
    """Check one sample's members and metadata types; :class:`ShardError` names the sample."""
    key = sample["__key__"]
    where = f"{location}:{key}"
    mels = [member for member in STORAGE_OF_MEMBER if member in sample]
    if len(mels) != 1:
        held = " and ".join(mels) or "no mel.npy or mel.zq5"
        raise ShardError(f"{where}: sample has {held} member{'s' if len(mels) > 1 else ''}")
    if META_MEMBER not in sample:
        raise ShardError(f"{where}: sample has no {META_MEMBER} member")
    meta = decode_meta(bytes(sample[META_MEMBER]), where)
    frames, text, speaker = meta.get("frames"), meta.get("text"), meta.get("speaker")
    bucket = meta.get("bucket")
    if type(frames) is not int or frames <= 0:
        raise ShardError(f"{where}: metadata 'frames' = {frames!r} is not a positive integer")
    if not isinstance(text, str):
        raise ShardError(f"{where}: metadata 'text' = {text!r} is not a string")
    if bucket is not None and type(bucket) is not int:
        raise ShardError(f"{where}: metadata 'bucket' = {bucket!r} is not an integer")
    if speaker is not None and not isinstance(speaker, str):
        speaker = str(speaker)
    for field, value in (("text", text), ("speaker", speaker or "")):
        if not is_unicode(value):  # JSON may escape a lone surrogate that UTF-8 cannot hold
            raise ShardError(f"{where}: metadata '{field}' = {value!r} is not valid Unicode")
    return RawSample(
        key=key,
        mel=sample[mels[0]],
        storage=STORAGE_OF_MEMBER[mels[0]],
        text=text,
        speaker=speaker,
        frames=frames,
        bucket=bucket,
        audio=sample.get(AUDIO_MEMBER),
    )


def read_shard(location: str, entry: dict[str, Any], *, check_sha256: bool) -> list[RawSample]:
    """Every sample of one shard, in tar order, checked against its index entry.

    Raises :class:`ShardError` naming the shard when it is missing, unreadable, not the size
    the index gives, fails its sha256 (unless ``check_sha256`` is off), holds another number
    of samples than the index says, or a sample lacks a member or has bad metadata.
    """
    data = load_shard(location)
    problems = integrity_problems(data, entry, location, check_sha256=check_sha256)
    if problems:
        raise ShardError(problems[0])
    samples = [raw_sample(sample, location) for sample in shard_samples(data, location)]
    low, high = entry["min_frames"], entry["max_frames"]
    for sample in samples:  # batching relies on the index's bounds
        if not low <= sample.frames <= high:
            raise ShardError(
                f"{location}:{sample.key}: {sample.frames} frames, outside the index's "
                f"[{low}, {high}] for this shard"
            )
    if len(samples) != entry["samples"]:
        raise ShardError(
            f"{location}: holds {len(samples)} samples, the index says {entry['samples']} "
            "(truncated?)"
        )
    return samples
