"""Per-utterance metadata a cache carries beyond text and speaker: its *extras*.

``[build] extras = ["language", ...]`` names fields of a manifest row, a tar sample's
``.json`` or a Parquet row. Each sample's ``json`` then holds ``"extras": {name: value}`` with
every named field (``null`` where the row lacks it), a value being a JSON string, number, bool
or null; the index records the names in ``build.extras``; ``preprocess verify`` checks every
sample against them; the loader hands the fields a model asks for to it in ``batch.extras``.

:data:`REFERENCE` is not stored: the loader derives it per batch (``melcache/loader/batch.py``).
"""

from __future__ import annotations

import math
from typing import Any

from melcache.errors import ShardError

REFERENCE = "reference"  # per utterance, the row of another utterance of its speaker, or -1
META_FIELD = "extras"  # the member of a sample's json that holds them


def extras_problem(names: tuple[str, ...]) -> str | None:
    """Why ``names`` cannot be a cache's extras (``None``: they can)."""
    if any(not isinstance(n, str) or not n for n in names):
        return "non-empty field names"
    if len(set(names)) != len(names):
        return "field names, each once"
    if REFERENCE in names:
        return f"field names other than {REFERENCE!r} (the loader derives that one per batch)"
    return None


def value_problem(value: Any) -> str | None:
    """Why ``value`` cannot be stored as an extra (``None``: it can)."""
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else "is not a finite number"
    return f"is {type(value).__name__}, not a string, number, bool or null"


def cache_extras(index: dict[str, Any]) -> tuple[str, ...]:
    """The extras a cache's index records (none in caches built without them; checked by
    :func:`melcache.index.read_index`)."""
    return tuple(index["build"].get(META_FIELD, ()))


def sample_extras(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """A sample's extras from its parsed json; :class:`ShardError` naming ``where`` when they
    are not an object of storable values."""
    extras = meta.get(META_FIELD, {})
    if not isinstance(extras, dict):
        raise ShardError(f"{where}: metadata 'extras' = {extras!r} is not an object")
    for name, value in extras.items():
        problem = value_problem(value)
        if problem:
            raise ShardError(f"{where}: metadata extras[{name!r}] {problem}")
    return extras
