"""Deprecated address of the streaming loader, kept for one release: use ``melcache.loader``.

``from train.data import make_loader, DataConfig`` still works; the loader now lives beside
the format it reads (``melcache/loader/``), and nothing in this repository imports it here.
"""

import melcache.loader
from melcache.errors import ShardError
from melcache.loader import *  # noqa: F403 (every public name of the loader, as before)

__all__ = [*melcache.loader.__all__, "ShardError"]
