"""Fuzzing what a caller hands the readers (issue 37): mix weights and temperatures, a
tokenizer's outputs, random-access keys. Every case either works as a user would expect or
ends in the clear error of its door (``UserError``; ``TypeError``/``KeyError``/``IndexError``
for lookups, each naming the cache); never another exception, a hang or an overflow. Fixed
seeds, a few hundred cases each, on the real caches the session builds."""

from __future__ import annotations

import dataclasses
import math
import numbers
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import melcache
from melcache.access import BadKey, UnknownKey
from melcache.dataset import CacheDataset
from melcache.errors import UserError
from melcache.loader import DataConfig
from melcache.loader.batch import token_ids
from melcache.loader.mix import open_mix
from melcache.loader.schedule import mix_weights

CASES = 300


def number(rng: random.Random) -> Any:
    """A value for a weight or a temperature: mostly numbers of every kind and size."""
    pick = rng.randrange(14)
    if pick < 4:
        return 10 ** rng.uniform(-300, 300)  # finite, over the whole float range
    return [
        lambda: rng.randint(0, 10**6),
        lambda: 10 ** rng.randint(300, 500),  # an int past float's range
        lambda: -rng.random(),
        lambda: rng.choice([math.inf, -math.inf, math.nan, 0.0]),
        lambda: rng.choice(["x", "1.0", None, [1.0], {"a": 1}, b"1"]),
        lambda: rng.choice([True, False]),
        lambda: np.float32(rng.uniform(0, 5)),
        lambda: np.int64(rng.randint(-3, 10**9)),
        lambda: Fraction(rng.randint(1, 9), rng.randint(1, 9)),
        lambda: rng.uniform(0, 3),
    ][pick - 4]()


def is_finite_number(value: Any) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def test_mix_weights_are_shares_for_any_finite_weights_and_temperature() -> None:
    rng = random.Random(37)
    for _ in range(2000):
        weights = [10 ** rng.uniform(-300, 300) for _ in range(rng.randint(1, 5))]
        alpha = rng.choice([0, 1, 2, 300.5, 10**8, rng.uniform(0, 1000)])
        shares = mix_weights(weights, None, alpha)
        assert all(0 <= s <= 1 for s in shares) and math.isclose(sum(shares), 1.0), (weights, alpha)


def test_mix_specs_work_or_are_refused_by_name(sample_cache: Path, train_cache: Path) -> None:
    a, b = str(sample_cache), str(train_cache)
    rng = random.Random(11)
    base = DataConfig(batch_frames=20_000, num_workers=0)
    outcomes = {True: 0, False: 0}
    for case in range(CASES):
        weight, alpha = number(rng), (number(rng) if case % 2 else 1.0)
        data = dataclasses.replace(base)
        # As a caller whose config skipped DataConfig's checks (they are tested with it).
        object.__setattr__(data, "mix_temperature", alpha)
        expected = is_finite_number(weight) and float(weight) > 0
        expected &= is_finite_number(alpha) and float(alpha) >= 0
        outcomes[expected] += 1
        try:
            mix = open_mix({a: 1.0, b: weight}, data, None)
        except UserError as exc:
            assert not expected, (weight, alpha, exc)
            assert "\n" not in str(exc) and ("mix weight" in str(exc) or "temperature" in str(exc))
            continue
        assert expected, (weight, alpha)
        assert math.isclose(sum(mix.weights), 1.0) and all(0 <= w <= 1 for w in mix.weights)
    assert min(outcomes.values()) > CASES // 5, outcomes  # both ways, often


def output(rng: random.Random) -> Any:
    """What a tokenizer might return: ids of every type, shape and size."""
    ints = [rng.randint(-2, 120) for _ in range(rng.randint(0, 6))]
    return [
        lambda: ints,
        lambda: tuple(ints),
        lambda: (
            np.array(ints, dtype=rng.choice(["int64", "int32", "uint8", "uint64"]))
            if all(0 <= i < 256 for i in ints)
            else np.array(ints)
        ),
        lambda: [float(i) + rng.choice([0.0, 0.9]) for i in ints],
        lambda: np.array(ints, dtype=rng.choice(["float32", "float16", "bool"])),
        lambda: [*ints, rng.choice([2**63, 2**64 - 1, 2**70, -(2**70)])],
        lambda: [ints, ints[:1]],
        lambda: [ints, ints],
        lambda: rng.choice(["abc", "", b"ab", None, 5, 2.5, {1: 2}, {1, 2}, object()]),
        lambda: [str(i) for i in ints],
        lambda: [True] * len(ints),
        lambda: (i for i in ints),
    ][rng.randrange(12)]()


def valid_ids(out: Any, vocab: int) -> list[int] | None:
    """The ids ``out`` stands for, by the rule a tokenizer must honour, else ``None``."""
    if isinstance(out, np.ndarray):
        if out.ndim != 1 or (out.size and out.dtype.kind not in "iu"):
            return None
        values = [int(v) for v in out]
    elif isinstance(out, (list, tuple)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in out):
            return None
        values = [int(v) for v in out]
    else:
        return None
    return values if all(1 <= v < vocab for v in values) else None


def test_tokenizer_outputs_are_ids_or_one_line(tmp_path: Path) -> None:
    rng = random.Random(5)
    outcomes = {True: 0, False: 0}
    for _ in range(CASES * 3):
        out, vocab = output(rng), rng.choice([100, 257])
        expected = valid_ids(out, vocab)
        outcomes[expected is not None] += 1
        try:
            ids = token_ids(lambda _text, out=out: out, "some text", "fuzz", vocab)
        except UserError as exc:
            assert expected is None, (out, exc)
            assert str(exc).startswith("tokenizer fuzz ") and "\n" not in str(exc)
            continue
        assert expected is not None and ids.dtype == np.int64, out
        assert ids.tolist() == expected
    assert min(outcomes.values()) > CASES // 5, outcomes


def access_key(rng: random.Random, keys: list[str]) -> Any:
    """A lookup: real keys and rows, and every other type a caller might pass."""
    return [
        lambda: rng.choice(keys),
        lambda: rng.randint(-40, 40),
        lambda: rng.choice([2**70, -(2**70)]),
        lambda: np.int64(rng.randint(0, 29)),
        lambda: rng.uniform(-3, 30),
        lambda: rng.choice([True, False, None, b"KEY", object(), math.nan]),
        lambda: "".join(chr(rng.randint(1, 0x10FFFF)) for _ in range(rng.randint(0, 8))),
        lambda: rng.choice(keys)[:-1],
        lambda: [rng.choice(keys), rng.randint(0, 3)],
        lambda: {rng.choice(keys): 1},
    ][rng.randrange(10)]()


CLEAR = (BadKey, UnknownKey, IndexError)


def test_random_access_keys_are_read_or_refused_clearly(sample_cache: Path) -> None:
    rng = random.Random(3)
    dataset = CacheDataset(sample_cache)
    with melcache.open(sample_cache) as cache:
        keys = cache.keys()
        doors: list[tuple[str, Callable[[Any], Any]]] = [
            ("cache[]", cache.__getitem__),
            ("get", cache.get),
            ("get_many", cache.get_many),
            ("dataset[]", dataset.__getitem__),
            ("get_frame_len", dataset.get_frame_len),
        ]
        read = 0
        for _ in range(CASES):
            key = access_key(rng, keys)
            name, door = rng.choice(doors)
            try:
                found = door(key)
                read += 1
            except CLEAR as exc:
                assert str(exc) and "\n" not in str(exc), (name, key, exc)
                assert str(sample_cache) in str(exc), (name, key, exc)
                continue
            assert not isinstance(key, (bool, float)), (name, key)  # never truncated to a row
            if name == "get_many":
                assert [u.key for u in found] == list(key)
            elif isinstance(key, str) and name != "get_frame_len":
                assert (found.key if name != "dataset[]" else found["key"]) == key
        assert CASES // 10 < read < CASES // 2, read


@pytest.mark.parametrize("bad", [None, 5, 2.5, ["x"], b"x"])
def test_opening_what_is_not_a_location_is_refused(bad: Any) -> None:
    for door in (melcache.open, CacheDataset):
        with pytest.raises(UserError, match="expected a folder or URL prefix"):
            door(bad)
