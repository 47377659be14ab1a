"""A node's local copies of a remote cache's shards (``data.cache_dir``, ``data.cache_bytes``),
for jobs that read a cache in a store (``s3://``, ``http(s)://``) more than once per node.

- **Content-addressed**: a copy is named by the shard's sha256 from the index
  (``<sha256>.tar``), so it can never be stale: another cache, or the same cache rebuilt, names
  other copies. Every copy is checked on each read exactly as a store read is (``ShardCheck``);
  one that fails is dropped and the store read again.
- **Bounded by bytes**: after each copy is written, the least recently read copies (mtime,
  touched on every hit) are deleted until the folder holds at most ``cache_bytes``. The bound
  must hold the shards a job keeps open (:func:`check_bound`), or every read would miss.
- **Never the only copy**: only files this module wrote (``<sha256>.tar``) in a folder it made
  (holding :data:`MARKER`) are ever deleted, each a copy of an object the store still holds;
  a folder with other files, or a cache folder, is refused.
- Workers share the folder: copies are written under a temporary name and renamed, and a copy
  deleted while another process has it mapped stays readable to that process (POSIX).

Hits and misses are counted per process and travel with each batch to the loader
(``loader.disk_cache``), which the trainer writes into ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from melcache.errors import ShardError, UserError
from melcache.format import INDEX_NAME, write_atomic
from melcache.location import read_bytes

MARKER = ".melcache-disk-cache"  # the folder is this module's to delete copies in
_COPY = re.compile(r"^[0-9a-f]{64}\.tar$")


def check_folder(folder: str) -> Path:
    """``data.cache_dir`` made (or found) and marked as this module's, else one line why not."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if (path / INDEX_NAME).exists():
            raise UserError(f"data.cache_dir = {folder!r} is a cache folder: choose an empty one")
        if not (path / MARKER).exists():
            if any(path.iterdir()):
                raise UserError(
                    f"data.cache_dir = {folder!r} holds files melcache did not write: choose an "
                    "empty folder (copies are deleted from it to keep data.cache_bytes)"
                )
            (path / MARKER).write_text("melcache's copies of remote shards; safe to delete\n")
    except OSError as exc:
        raise UserError(f"data.cache_dir = {folder!r} cannot be used: {exc}") from None
    return path


def check_bound(cache_bytes: int, largest_shard: int, open_shards: int) -> None:
    """One line when ``data.cache_bytes`` cannot hold the ``open_shards`` shards a job keeps
    open at once (each at most ``largest_shard`` bytes)."""
    need = largest_shard * open_shards
    if cache_bytes < need:
        raise UserError(
            f"data.cache_bytes = {cache_bytes} cannot hold the {open_shards} shards this job "
            f"reads at once (up to {largest_shard} bytes each): give at least {need}"
        )


class DiskCache:
    """One process's reader through the folder (made with :func:`check_folder`)."""

    def __init__(self, folder: str, max_bytes: int) -> None:
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.hits = self.misses = 0

    def read(
        self, location: str, entry: dict[str, Any], problems: Callable[[Any], list[str]]
    ) -> bytes | mmap.mmap:
        """The shard's checked bytes: the local copy when there is a sound one, else the
        store's, kept as a copy. ``problems(data)`` lists how bytes differ from the index."""
        copy = self.folder / f"{entry['sha256']}.tar"
        with contextlib.suppress(OSError):
            data = read_bytes(str(copy))
            if not problems(data):
                self.hits += 1
                with contextlib.suppress(OSError):
                    os.utime(copy)  # recently read: evicted last
                return data
            copy.unlink(missing_ok=True)  # damaged: read the store's again
        try:
            data = read_bytes(location)
        except OSError as exc:
            raise ShardError(f"{location}: cannot read shard ({exc})") from None
        found = problems(data)
        if found:
            raise ShardError(found[0])
        self.misses += 1
        with contextlib.suppress(OSError):  # a full local disk costs the copy, not the read
            write_atomic(copy, data)
            self._evict(keep=copy)
        return data

    def take_counts(self) -> tuple[int, int]:
        """Hits and misses since the last call."""
        counts, self.hits, self.misses = (self.hits, self.misses), 0, 0
        return counts

    def _evict(self, keep: Path) -> None:
        """Delete the least recently read copies until the folder holds ``max_bytes``."""
        copies = []
        for entry in os.scandir(self.folder):
            if _COPY.match(entry.name):
                with contextlib.suppress(OSError):
                    stat = entry.stat()
                    copies.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        total = sum(size for _, size, _ in copies)
        for _, size, path in sorted(copies):
            if total <= self.max_bytes:
                break
            if path != keep:
                path.unlink(missing_ok=True)  # another process's delete of it is as good
                total -= size


_PER_PROCESS: dict[tuple[int, str], DiskCache] = {}


def for_process(folder: str, max_bytes: int) -> DiskCache:
    """This process's :class:`DiskCache` of ``folder`` (a forked worker gets its own, counting
    from zero)."""
    key = (os.getpid(), folder)
    if key not in _PER_PROCESS:
        _PER_PROCESS[key] = DiskCache(folder, max_bytes)
    return _PER_PROCESS[key]
