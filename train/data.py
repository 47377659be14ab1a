"""Deprecated address of the streaming loader, kept for one release: use ``melcache.loader``.

``from train.data import make_loader, DataConfig`` still works; the loader now lives beside
the format it reads (``melcache/loader/``), and nothing in this repository imports it here.
"""

from melcache.errors import ShardError
from melcache.loader import (
    BYTE_VOCAB_SIZE,
    PAD_ID,
    Batch,
    BatchIterator,
    DataConfig,
    LoaderClosed,
    StreamLoader,
    bucket_lengths,
    make_loader,
    utf8_tokens,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PAD_ID",
    "Batch",
    "BatchIterator",
    "DataConfig",
    "LoaderClosed",
    "ShardError",
    "StreamLoader",
    "bucket_lengths",
    "make_loader",
    "utf8_tokens",
]
