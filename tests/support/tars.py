"""Shards written in memory: the tar bytes of samples, through the shard writer or another."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from melcache.tar.writer import open_tar_writer


def shard_bytes(samples: list[dict], open_writer: Callable[[Any], Any] = open_tar_writer) -> bytes:
    """The tar bytes of ``samples`` as ``open_writer`` (the shard writer by default) writes
    them."""
    buffer = io.BytesIO()
    with open_writer(buffer) as writer:
        for sample in samples:
            writer.write(sample)
    return buffer.getvalue()
