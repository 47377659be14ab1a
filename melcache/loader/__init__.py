"""The streaming loader, beside the format it reads: imports only ``melcache``, never a trainer.

    from melcache.loader import DataConfig, make_loader

    loader = make_loader("shards/", DataConfig(batch_frames=20_000), rank=rank, world_size=world)

Modules, in the order a batch is made: ``data_config`` (the keys), ``mix`` (open the caches,
weigh them, check their layout), ``schedule`` (the sub-streams and their order),
``batching`` (the pure shard dealing and batch plans, which ``inspect`` shares),
``units`` (shards grouped into the units slots share), ``stream`` (one slot's batches from
its cursor), ``workers`` (worker processes and their shared memory), ``transport`` (the
fixed-size slots batches cross processes in), ``batch`` (collation into :class:`Batch`),
``prefetch`` (host-to-device copies ahead of the step) and ``make`` (``make_loader``, the
loader's state and resume).
"""

from melcache.loader.batch import BYTE_VOCAB_SIZE, PAD_ID, Batch, utf8_tokens
from melcache.loader.data_config import DataConfig
from melcache.loader.make import BatchIterator, LoaderClosed, StreamLoader, make_loader
from melcache.loader.mix import bucket_lengths

__all__ = [
    "BYTE_VOCAB_SIZE",
    "PAD_ID",
    "Batch",
    "BatchIterator",
    "DataConfig",
    "LoaderClosed",
    "StreamLoader",
    "bucket_lengths",
    "make_loader",
    "utf8_tokens",
]
