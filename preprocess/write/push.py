"""``preprocess push CACHE s3://bucket/prefix``: publish a finished local cache to a store.

Every file of the cache but ``index.json`` is uploaded by a pool of threads, then read back
and compared (size and xxh3_128) with the local file; ``index.json`` goes last, once all of
them passed, so a reader never meets an index whose shards are not all there. Rerunning after
an interruption resumes: an object already there with the local file's size and digest is
kept, anything else is uploaded again. A destination holding another cache's index is refused.
"""

from __future__ import annotations

import concurrent.futures
import logging
from pathlib import Path

import xxhash

from melcache.errors import UserError
from melcache.format import INDEX_NAME, temp_owner
from melcache.index import read_index
from melcache.location import member_location
from melcache.remote import objectstore

log = logging.getLogger(__name__)
PUSH_THREADS = 8  # below objectstore.MAX_REQUESTS: each upload is then read back


def push(cache: Path, destination: str, threads: int = PUSH_THREADS) -> dict[str, int]:
    """Publish ``cache`` at ``destination`` (``s3://…``); how many objects were uploaded and
    kept. :class:`UserError` (one line) when the cache is unfinished, the destination holds
    another cache, or an object cannot be written or does not read back as written."""
    if not objectstore.is_store(destination):
        raise UserError(f"{destination}: push publishes to an object store (s3://bucket/prefix)")
    read_index(cache)  # a finished, sound index, or one line saying why not
    index_bytes = (cache / INDEX_NAME).read_bytes()
    remote_index = remote_bytes(member_location(destination, INDEX_NAME))
    if remote_index is not None and remote_index != index_bytes:
        raise UserError(
            f"{member_location(destination, INDEX_NAME)} exists and is another cache's index; "
            "push to an empty prefix"
        )
    present = listing(destination)

    def publish_file(name: str) -> bool:
        return publish(cache / name, member_location(destination, name), present.get(name))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        uploaded = list(pool.map(publish_file, cache_files(cache)))
    uploaded.append(publish_file(INDEX_NAME))  # the commit marker, once all others read back
    return {"uploaded": sum(uploaded), "kept": len(uploaded) - sum(uploaded)}


def publish(path: Path, location: str, remote_size: int | None) -> bool:
    """Make the object at ``location`` hold ``path``'s bytes, checked by reading it back; False
    when it already did (``remote_size``: its size in the listing, ``None`` when absent)."""
    data = path.read_bytes()
    digest = xxhash.xxh3_128_hexdigest(data)
    if remote_size == len(data) and _digest_at(location) == digest:
        return False
    objectstore.put_object(location, data)
    if _digest_at(location) != digest:
        raise UserError(f"{location}: reads back other bytes than {path} after upload")
    return True


def _digest_at(location: str) -> str | None:
    data = remote_bytes(location)
    return None if data is None else xxhash.xxh3_128_hexdigest(data)


def remote_bytes(location: str) -> bytes | None:
    """The object's bytes, ``None`` when absent; a store that refuses is one line."""
    try:
        return objectstore.read_object(location)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(str(exc)) from None


def listing(destination: str) -> dict[str, int]:
    """Name → size of every object under ``destination``; a store that refuses is one line."""
    try:
        return objectstore.list_sizes(destination)
    except OSError as exc:
        raise UserError(str(exc)) from None


def cache_files(cache: Path) -> list[str]:
    """The cache's files to publish, relative to it, in order: all but ``index.json``, the
    build's own state (``.build/``, lock files) and another writer's temporary files."""
    names = []
    for path in sorted(cache.rglob("*")):
        relative = path.relative_to(cache).as_posix()
        hidden = any(part.startswith(".") for part in path.relative_to(cache).parts)
        if path.is_file() and not hidden and relative != INDEX_NAME and not temp_owner(path.name):
            names.append(relative)
    return names
