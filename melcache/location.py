"""Where a cache's files live: a local folder, an object-store prefix (``s3://bucket/cache``,
:mod:`melcache.remote.objectstore`) or a URL prefix webdataset's ``gopen`` opens (``http://host/cache``,
``pipe:…``); a file's location is the prefix, a slash and its name. Local files, ``http(s)://``
and ``s3://`` also answer ranged reads (:func:`read_range`)."""

from __future__ import annotations

import mmap
import os
import urllib.error
import urllib.request
from pathlib import Path

from webdataset import gopen

from melcache.bounded import open_regular
from melcache.errors import ShardError
from melcache.remote import objectstore

HTTP_TIMEOUT_S = 30  # connect and each read of an http(s):// file
RANGED_SCHEMES = ("http://", "https://", *objectstore.SCHEMES)


def is_url(cache: str | Path) -> bool:
    """True when ``cache`` names a URL prefix rather than a local folder."""
    return isinstance(cache, str) and ("://" in cache or cache.startswith("pipe:"))


def member_location(cache: str | Path, name: str) -> str:
    """Where file ``name`` of the cache lives: a path, or the URL prefix plus ``/name``."""
    if is_url(cache):
        return f"{str(cache).rstrip('/')}/{name}"
    return str(Path(cache) / name)


def read_bytes(location: str) -> bytes | mmap.mmap:
    """The whole content of a local regular file (memory-mapped: no copy, no fresh pages to
    fault in) or URL; ``OSError`` when it cannot be read, or is a FIFO, a device or a folder
    (never waited on). Shards are immutable once indexed."""
    if not is_url(location):
        with open_regular(location) as file:
            if os.fstat(file.fileno()).st_size == 0:
                return b""  # mmap refuses empty files
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_WILLNEED"):  # start reading a cold shard ahead of the parser
            mapped.madvise(mmap.MADV_WILLNEED)
        return mapped
    if objectstore.is_store(location):
        return objectstore.read_object(location)
    if location.startswith(("http://", "https://")):
        return _http_get(location)
    stream = gopen(location, "rb")  # pipe: and the other schemes webdataset opens
    try:
        return stream.read()
    finally:
        stream.close()  # a pipe reports its command's exit status only here


def _http_get(location: str) -> bytes:
    """A whole file over HTTP with a deadline (webdataset's ``curl`` pipe retries for minutes
    on a server that is gone); ``FileNotFoundError`` for a 404, else ``OSError`` naming it."""
    try:
        with urllib.request.urlopen(location, timeout=HTTP_TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        error = FileNotFoundError if exc.code == 404 else OSError
        raise error(f"{location}: the server answered {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OSError(f"{location}: cannot be read ({reason})") from None


def reads_ranges(cache: str | Path) -> bool:
    """Whether a cache's files answer ranged reads: a local folder, ``http(s)://``, ``s3://``."""
    return not is_url(cache) or str(cache).startswith(RANGED_SCHEMES)


def read_range(location: str, offset: int, length: int) -> bytes:
    """``length`` bytes of the remote file at ``location`` from ``offset`` (an HTTP ``Range``
    request, or a ranged GET); :class:`ShardError` naming it when it cannot be read."""
    if objectstore.is_store(location):
        try:
            return objectstore.read_range(location, offset, length)
        except OSError as exc:
            raise ShardError(f"cannot read bytes {offset}+{length} ({exc})") from None
    request = urllib.request.Request(
        location, headers={"Range": f"bytes={offset}-{offset + length - 1}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            if response.status != 206:
                raise ShardError(
                    f"{location}: the server ignores range requests (status {response.status})"
                )
            return response.read(length + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise ShardError(f"{location}: cannot read bytes {offset}+{length} ({exc})") from None
