"""One shard, read and checked against its index entry: the reader the loader and ``verify``
both use.

The shard is read whole (memory-mapped when local); its size and a digest are checked
against the index before any sample is parsed (:class:`ShardCheck`), and each sample's
metadata is checked for type. The mel stays undecoded bytes in a :class:`RawSample`, so a
loader that skips a sample never parses an array; :func:`melcache.codec.decode_mel_into`
decodes it.

The build records two digests of each shard: ``sha256`` (cryptographic: no one can make other
bytes that match it) and ``xxh3_128`` (xxHash, ~16× faster here but not cryptographic: any
accidental change is caught, a collision made on purpose is not). ``verify`` checks both; the
loader's default checks ``xxh3_128`` on every read (see :class:`ShardCheck`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import xxhash

from melcache.errors import ShardError
from melcache.extras import sample_extras
from melcache.format import AUDIO_MEMBER, META_MEMBER, decode_meta, is_unicode
from melcache.location import read_bytes
from melcache.storage import STORAGE_OF_MEMBER
from melcache.tar.reader import group_samples, tar_members

if TYPE_CHECKING:
    from melcache.remote.disk_cache import DiskCache


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
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)  # melcache/extras.py
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)  # read with the sample


def load_shard(location: str) -> bytes | mmap.mmap:
    """The bytes of the shard at ``location``; :class:`ShardError` when it cannot be read."""
    try:
        return read_bytes(location)
    except OSError as exc:
        raise ShardError(f"{location}: cannot read shard ({exc})") from None


# The digests an index entry records, by field name; each maps a shard's bytes to its hex.
DIGESTS: dict[str, Callable[[bytes | mmap.mmap], str]] = {
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
    "xxh3_128": xxhash.xxh3_128_hexdigest,
}
SHARD_CHECKS = ("fast", "sha256", "off")


def size_problems(data: bytes | mmap.mmap, entry: dict[str, Any], location: str) -> list[str]:
    """The shard's size against the index's ``bytes`` (free, and names the likely cause)."""
    if "bytes" in entry and len(data) != entry["bytes"]:
        return [
            f"{location}: {len(data)} bytes, the index says {entry['bytes']} (truncated or replaced?)"
        ]
    return []


def digest_problems(
    data: bytes | mmap.mmap, entry: dict[str, Any], location: str, field: str
) -> list[str]:
    """The shard's ``field`` digest (a :data:`DIGESTS` name) against the index's."""
    if not entry.get(field):
        return [f"{location}: the index gives no {field}; data.shard_check = 'off' skips it"]
    if DIGESTS[field](data) != entry[field]:
        return [f"{location}: {field} differs from the index (corrupt or replaced)"]
    return []


def integrity_problems(data: bytes | mmap.mmap, entry: dict[str, Any], location: str) -> list[str]:
    """Everything ``verify`` checks of the bytes: size, sha256, and xxh3_128 where recorded."""
    problems = size_problems(data, entry, location) + digest_problems(
        data, entry, location, "sha256"
    )
    if "xxh3_128" in entry:  # absent in caches of the previous release
        problems += digest_problems(data, entry, location, "xxh3_128")
    return problems


class ShardCheck:
    """How one reader (a loader worker) checks every shard it reads: ``mode`` is one of
    :data:`SHARD_CHECKS`.

    - ``"fast"``: size, then the index's ``xxh3_128``, on every read. An index without it
      (built before it was recorded) gets sha256 the first time this reader meets a shard, and
      from then on the xxh3_128 of the bytes that passed: a later change is caught the same.
    - ``"sha256"``: size and sha256 on every read (the loader's slowest setting).
    - ``"off"``: size only.
    """

    def __init__(self, mode: str = "fast") -> None:
        if mode not in SHARD_CHECKS:
            raise ValueError(f"shard check {mode!r}: expected one of {', '.join(SHARD_CHECKS)}")
        self.mode = mode
        self._passed: dict[str, str] = {}  # sha256 checked here -> xxh3_128 of those bytes

    def problems(self, data: bytes | mmap.mmap, entry: dict[str, Any], location: str) -> list[str]:
        """How the shard's bytes differ from its index entry (empty: sound)."""
        problems = size_problems(data, entry, location)
        if problems or self.mode == "off":
            return problems
        if self.mode == "sha256":
            return digest_problems(data, entry, location, "sha256")
        if "xxh3_128" in entry:
            return digest_problems(data, entry, location, "xxh3_128")
        return self._sha256_once(data, entry, location)

    def _sha256_once(
        self, data: bytes | mmap.mmap, entry: dict[str, Any], location: str
    ) -> list[str]:
        """An index without xxh3_128: sha256 at this reader's first read of the shard, then
        the xxh3_128 of the bytes that passed."""
        passed = self._passed.get(entry.get("sha256", ""))
        if passed is None:
            problems = digest_problems(data, entry, location, "sha256")
            if not problems:
                self._passed[entry["sha256"]] = DIGESTS["xxh3_128"](data)
            return problems
        if DIGESTS["xxh3_128"](data) != passed:
            return [f"{location}: changed since its sha256 was checked (corrupt or replaced)"]
        return []


def shard_samples(
    data: bytes | mmap.mmap | memoryview,
    location: str,
    on_unknown: Callable[[str], None] | None = None,
    *,
    complete: bool = True,
) -> Iterator[dict[str, Any]]:
    """The shard's samples as ``{"__key__": key, member: bytes}`` dicts, in tar order; members
    that are not melcache's are skipped unread (reported to ``on_unknown``). ``complete=False``:
    ``data`` is a run of whole samples cut from a shard, with no end-of-archive block."""
    return group_samples(tar_members(data, location, on_unknown, complete=complete), location)


def raw_sample(sample: dict[str, Any], location: str) -> RawSample:
    """Check one sample's members and metadata types; :class:`ShardError` names the sample."""
    key = sample["__key__"]
    where = f"{location}:{key}"
    mels = [member for member in STORAGE_OF_MEMBER if member in sample]
    if len(mels) != 1:
        held = " and ".join(mels) or "no mel.npy or mel.q5"
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
        extras=sample_extras(meta, where),
    )


def read_shard(
    location: str, entry: dict[str, Any], check: ShardCheck, disk: DiskCache | None = None
) -> list[RawSample]:
    """Every sample of one shard, in tar order, checked against its index entry (read through
    ``disk``'s local copies when given: :mod:`melcache.remote.disk_cache`).

    Raises :class:`ShardError` naming the shard when it is missing, unreadable, not the size
    the index gives, fails its digest (as ``check`` says), holds another number of samples
    than the index says, or a sample lacks a member or has bad metadata.
    """
    if disk is not None and entry.get("sha256"):  # a remote cache read through a local copy
        data = disk.read(location, entry, lambda d: check.problems(d, entry, location))
    else:
        data = load_shard(location)
        problems = check.problems(data, entry, location)
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
