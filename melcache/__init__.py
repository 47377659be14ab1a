"""melcache's shard contract: what a cache is, shared by the build (``preprocess``) and the
trainer (``train``), which import this package and never each other.

- :mod:`melcache.errors`: the two exceptions a command turns into one clear line;
- :mod:`melcache.config`: TOML loading and validated frozen config sections;
- :mod:`melcache.features`: the exact mel extractor a cache was built with;
- :mod:`melcache.format`: file and member names, dtypes, the tar writer and fast readers;
- :mod:`melcache.location`: where a cache's files live (a folder or a URL prefix);
- :mod:`melcache.index`: ``index.json`` (strictly checked) and ``stats.zarr``;
- :mod:`melcache.reader`: one shard read and checked against its index entry;
- :mod:`melcache.batching`: the pure shard dealing and batch planning of the loader.
"""
