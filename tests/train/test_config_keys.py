"""Config keys as a class: the ``[train]`` sub-tables and the old flat names they replace
(``train/config/renamed.py``), and one numeric check for every key (``melcache.sections``):
its type, finite, and inside the range stated beside it. The fuzzers feed every numeric key of
every table values of every kind and accept only a working config or a one-line UserError."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from melcache.errors import UserError
from melcache.features import FeatureConfig
from melcache.loader import DataConfig
from melcache.sections import make_section
from preprocess.config import BuildConfig
from train.config.renamed import RENAMED, new_name
from train.config.tables import Config, ModelConfig, OptimConfig, TrainDataConfig, load_config
from train.config.train_table import TrainConfig


def _tables(kind: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """Every config dataclass reachable from ``kind``, with its dotted table name."""
    out = [(prefix, kind)] if prefix else []
    for field in dataclasses.fields(kind):
        factory = field.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            out += _tables(factory, f"{prefix}.{field.name}".lstrip("."))
    return out


TABLES = _tables()
BUILD_TABLES = [("features", FeatureConfig), ("build", BuildConfig)]  # the build's preset
NUMERIC = [
    (f"{table}.{field.name}", kind, field)
    for table, kind in TABLES + BUILD_TABLES
    for field in dataclasses.fields(kind)
    if str(field.type) in ("int", "float")
]


def test_the_tables_are_the_rooms_of_the_trainer() -> None:
    names = [table for table, _ in TABLES]
    assert names == [
        "model",
        "data",
        "optim",
        "train",
        "train.parallel",
        "train.checkpoint",
        "train.validation",
        "train.adapt",
        "train.memory",
        "train.amp",
    ]
    assert len(NUMERIC) > 40


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_flat_key_still_works_with_one_line_naming_the_new_one(
    old: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    group, name = RENAMED[old]
    value = _another_valid_value(group, name)
    toml = str(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')
    path = tmp_path / "old.toml"
    path.write_text(f"[train]\n{old} = {toml}\n")
    with caplog.at_level(logging.WARNING):
        cfg = load_config(path)
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: config key train.{old} is deprecated; use {new_name('train.' + old)}"
    ]
    assert getattr(getattr(cfg.train, group), name) == value
    with caplog.at_level(logging.WARNING):  # the same key as an override
        assert load_config(None, [f"train.{old}={toml}"]) == cfg


def _another_valid_value(group: str, name: str) -> Any:
    """A value for ``train.group.name`` other than its default, valid alone (a bool or string
    keeps its default: flipping one alone is refused by the checks across keys)."""
    default = getattr(getattr(Config().train, group), name)
    if isinstance(default, (bool, str)):
        return default
    for value in (default + 1, default * 0.5, default * 2):
        try:
            Config.from_dict({"train": {group: {name: type(default)(value)}}})
        except UserError:
            continue
        return type(default)(value)
    raise AssertionError(f"no valid value for train.{group}.{name}")


def test_both_names_in_one_file_are_refused_and_a_later_new_name_wins(tmp_path: Path) -> None:
    both = tmp_path / "both.toml"
    both.write_text("[train]\nckpt_every = 7\n[train.checkpoint]\nevery = 9\n")
    with pytest.raises(UserError, match=r"train\.ckpt_every and train\.checkpoint\.every"):
        load_config(both)
    old = tmp_path / "old.toml"
    old.write_text("[train]\nckpt_every = 7\nspike_window = 64\n")
    cfg = load_config(old, ["train.checkpoint.every=9"])
    assert (cfg.train.checkpoint.every, cfg.train.adapt.spike_window) == (9, 64)
    new = tmp_path / "new.toml"
    new.write_text("[train.checkpoint]\nevery = 11\n")
    assert load_config([old, new]).train.checkpoint.every == 11
    with pytest.raises(UserError, match=r"\[train\.parallel\] must be a table"):
        load_config(None, ["train.parallel=3"])
    with pytest.raises(UserError, match=r"unknown key train\.adapt\.spike_windw"):
        load_config(None, ["train.adapt.spike_windw=3"])


def test_a_saved_config_round_trips_in_the_new_shape() -> None:
    cfg = load_config(None, ["train.parallel.bucket_cap_mb=2", "train.adapt.skip_spikes=true"])
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg and again.to_dict()["train"]["parallel"]["bucket_cap_mb"] == 2.0


@pytest.mark.parametrize(("key", "kind", "field"), NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_every_numeric_key_states_its_range(key: str, kind: type, field: Any) -> None:
    bounds = field.metadata.get("bounds")
    assert bounds is not None, f"{key} has no range beside it: declare it with bounded(...)"
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    assert bounds.holds(default), f"{key}'s default is outside its own range"


# The eleven reproductions of issue #37 that were config keys: each refused by name, or working.
REFUSED = [
    "data.mix_temperature=100000000",  # an int: was hours ** 100000000 in big integers
    "data.mix_temperature=300.5",
    "data.mix_temperature=inf",
    "data.mix.a=inf",
    "data.mix.a=nan",
    "optim.lr=inf",
    "optim.weight_decay=inf",
    "train.adapt.spike_window=1000000000000",
    "optim.autoclip_window=1000000000000",
    "train.parallel.bucket_cap_mb=inf",
    "train.max_steps=true",
    "optim.betas=[0.9, inf]",
    'optim.betas=[0.9, "x"]',
]


@pytest.mark.parametrize("override", REFUSED)
def test_a_bad_number_is_one_line_naming_its_key(override: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(UserError, match=rf"config key {key.replace('.', '[.]')} = .* expected"):
        load_config(None, [override])


def test_an_int_given_for_a_float_key_is_a_float() -> None:
    cfg = load_config(None, ["data.mix_temperature=2", "data.mix.a=3", "optim.lr=1"])
    assert type(cfg.data.mix_temperature) is float and cfg.data.mix == {"a": 3.0}
    assert type(cfg.optim.lr) is float and type(cfg.data.mix["a"]) is float
    assert type(DataConfig(mix_temperature=2).mix_temperature) is float  # from Python too


_VALUES: list[Any] = [
    0, 1, 2, -1, 7, 10**6, 10**12, 10**13, 2**63, 2**70, 10**400,
    0.0, 0.5, 0.999, 1.0, 1.5, -0.5, 1e-300, 1e300, math.inf, -math.inf, math.nan,
    True, False, "1", "x", None, [1], {"a": 1},
]  # fmt: skip


def _kinds() -> dict[str, type]:
    return {table: kind for table, kind in TABLES}


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_every_numeric_key_ends_in_a_config_or_a_user_error(seed: int) -> None:
    """Each numeric key alone gets each value: the config it makes holds a finite number of the
    key's type inside its range, or the refusal is a UserError naming that key."""
    rng = random.Random(seed)
    for key, kind, field in NUMERIC:
        table = key.rpartition(".")[0]
        for value in rng.sample(_VALUES, 12):
            nested: dict[str, Any] = {field.name: value}
            for part in reversed(table.split(".")):
                nested = {part: nested}
            try:
                if table in dict(BUILD_TABLES):
                    cfg = SimpleNamespace(**{table: make_section(kind, nested[table], table, "")})
                else:
                    cfg = Config.from_dict(nested)
            except UserError as exc:
                assert f"config key {key} = " in str(exc) or key.split(".")[0] in str(exc), exc
                assert "\n" not in str(exc)
                continue
            got = cfg
            for part in key.split("."):
                got = getattr(got, part)
            assert type(got) is (int if str(field.type) == "int" else float), (key, value)
            assert math.isfinite(got) and field.metadata["bounds"].holds(got), (key, value)


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_mix_specs_end_in_a_config_or_a_user_error(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        mix = {f"c{n}": rng.choice(_VALUES) for n in range(rng.randint(0, 3))}
        temperature = rng.choice(_VALUES)
        try:
            data = TrainDataConfig(mix=mix, mix_temperature=temperature)
        except UserError as exc:
            assert "config key data.mix" in str(exc), exc
            continue
        assert all(type(w) is float and 0 < w < math.inf for w in data.mix.values())
        assert type(data.mix_temperature) is float and 0 <= data.mix_temperature <= 100


def test_the_sub_tables_are_checked_from_python_too() -> None:
    with pytest.raises(UserError, match=r"train\.adapt\.batch_max_accum"):
        Config.from_dict({"train": {"grad_accum": 8, "adapt": {"batch_max_accum": 4}}})
    with pytest.raises(UserError, match=r"train\.parallel\.comm_hook"):
        TrainConfig(parallel=_kinds()["train.parallel"](comm_hook="bf16", strategy="fsdp2"))
    assert ModelConfig(n_mels=80).n_mels == 80 and OptimConfig(lr=1).lr == 1.0
