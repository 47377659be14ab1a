"""melcache's shard contract: what a cache is, shared by the build (``preprocess``) and the
trainer (``train``), which import this package and never each other.

- :mod:`melcache.errors`: the two exceptions a command turns into one clear line;
- :mod:`melcache.sections`: TOML loading and validated frozen config sections;
- :mod:`melcache.features`: the exact mel extractor a cache was built with;
- :mod:`melcache.format`: file and member names, dtypes, the tar writer and fast readers;
- :mod:`melcache.location`: where a cache's files live (a folder or a URL prefix);
- :mod:`melcache.remote.objectstore`: ``s3://`` caches, read by retried ranged GETs;
- :mod:`melcache.index`: ``index.json`` (strictly checked) and ``stats.zarr``;
- :mod:`melcache.reader`: one shard read and checked against its index entry;
- :mod:`melcache.table`: the per-utterance table, ``utterances.table``;
- :mod:`melcache.access`: ``melcache.open(cache)``, lookups by key or row in one read;
- :mod:`melcache.dataset`: a map-style ``torch.utils.data.Dataset`` over a cache.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Imported on first use: ``import melcache`` stays free of torch (the CLIs' --help).
    if name == "open":
        from melcache.access import open_cache

        return open_cache
    raise AttributeError(f"module 'melcache' has no attribute {name!r}")
