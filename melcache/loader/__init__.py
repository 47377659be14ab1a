"""The streaming loader, beside the format it reads: imports only ``melcache``, never a trainer.

    from melcache.loader import DataConfig, make_loader

    loader = make_loader("shards/", DataConfig(batch_frames=20_000), rank=rank, world_size=world)

This face is lazy (PEP 562): ``from melcache.loader import DataConfig`` loads the ``[data]``
table alone, not the workers and torch's ``DataLoader``, so ``preprocess inspect`` and the
trainer's config stay light. docs/layout.md lists the loader's modules and what each holds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name → the module that defines it; every name a caller catches is here too.
_WHERE = {
    "BYTE_VOCAB_SIZE": "melcache.loader.batch",
    "PAD_ID": "melcache.loader.batch",
    "Batch": "melcache.loader.batch",
    "utf8_tokens": "melcache.loader.batch",
    "BatchIterator": "melcache.loader.iterator",
    "LoaderClosed": "melcache.loader.iterator",
    "DataConfig": "melcache.loader.data_config",
    "LoaderStateError": "melcache.loader.resume.state",
    "StreamLoader": "melcache.loader.stream_loader",
    "make_loader": "melcache.loader.stream_loader",
    "bucket_lengths": "melcache.loader.mix",
}

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PAD_ID",
    "Batch",
    "BatchIterator",
    "DataConfig",
    "LoaderClosed",
    "LoaderStateError",
    "StreamLoader",
    "bucket_lengths",
    "make_loader",
    "utf8_tokens",
]

if TYPE_CHECKING:  # what a type checker and an editor see; never run
    from melcache.loader.batch import BYTE_VOCAB_SIZE, PAD_ID, Batch, utf8_tokens
    from melcache.loader.data_config import DataConfig
    from melcache.loader.iterator import BatchIterator, LoaderClosed
    from melcache.loader.mix import bucket_lengths
    from melcache.loader.resume.state import LoaderStateError
    from melcache.loader.stream_loader import StreamLoader, make_loader


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use (PEP 562)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'melcache.loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
