"""melcache: the shard contract (what a cache is, how it is read and checked) and the
streaming loader that reads it (:mod:`melcache.loader`). The build (``preprocess``) and the
trainer (``train``) both stand on this package and never import each other.

``melcache.open(cache)`` looks utterances up by key or row; docs/layout.md lists the modules.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Imported on first use: ``import melcache`` stays free of torch (the CLIs' --help).
    if name == "open":
        from melcache.access import open_cache

        return open_cache
    raise AttributeError(f"module 'melcache' has no attribute {name!r}")
