"""Where a cache's files live: a local folder, or a URL prefix webdataset's ``gopen`` opens
(``http://host/cache``, ``pipe:aws s3 cp s3://bucket/cache``, …); a file's location is the
prefix, a slash and its name."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from webdataset import gopen

from melcache.bounded import open_regular


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
    stream = gopen(location, "rb")
    try:
        return stream.read()
    finally:
        stream.close()  # a pipe reports its command's exit status only here
