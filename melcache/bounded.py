"""Bounded reads of untrusted files: regular files only, a size cap, a depth cap for JSON.

Every file the project opens on a user's word (a config, a manifest, an index, a checkpoint
marker, a shard) may be a FIFO that blocks ``open()`` forever, ``/dev/zero`` that never
ends, or JSON nested deep enough to exhaust the interpreter's stack. These helpers turn each
of those into an ``OSError`` or ``ValueError`` whose message the caller can put on one line.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, Any

# Config files, manifests' lines, markers and indexes are far below this; a larger one is
# not what the user meant to hand us.
SMALL_FILE_LIMIT = 64 * 2**20


def open_regular(path: str | Path) -> IO[bytes]:
    """Open ``path`` for reading in binary mode, refusing anything but a regular file.

    The open itself does not block: a FIFO opened with ``O_NONBLOCK`` returns at once, and
    is then refused by its type. Raises ``OSError`` naming the path and what it is.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"{path} is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_limited(path: str | Path, limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The whole content of regular file ``path``; ``OSError`` when larger than ``limit``."""
    with open_regular(path) as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise OSError(f"{path} is {size} bytes, more than the {limit} this file may have")
        return file.read(limit + 1)[:limit]


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` that reports nesting too deep for the parser as a ``ValueError``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_json(path: str | Path, limit: int = SMALL_FILE_LIMIT) -> Any:
    """The JSON in regular file ``path`` of at most ``limit`` bytes: ``OSError`` or
    ``ValueError`` (not UTF-8, not JSON, too deep) otherwise."""
    return loads_json(read_limited(path, limit))


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"
