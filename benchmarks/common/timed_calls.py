"""Time the calls a real code path makes, without changing it: wrap module functions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def timing(module: Any, names: list[str]) -> Iterator[dict[str, float]]:
    """Inside the ``with``, each function ``names`` of ``module`` adds its wall time to the
    dict yielded (under its name); the functions are restored after it."""
    spent = dict.fromkeys(names, 0.0)
    originals = {name: getattr(module, name) for name in names}

    def timed(name: str, function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started

        return call

    for name, function in originals.items():
        setattr(module, name, timed(name, function))
    try:
        yield spent
    finally:
        for name, function in originals.items():
            setattr(module, name, function)
