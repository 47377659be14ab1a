"""Deprecated address of :class:`Batch`, kept for one release: use ``melcache.loader.Batch``."""

from melcache.loader.batch import BYTE_VOCAB_SIZE, PAD_ID, Batch, utf8_tokens

__all__ = ["BYTE_VOCAB_SIZE", "PAD_ID", "Batch", "utf8_tokens"]
