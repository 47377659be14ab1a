"""Config files: one TOML reader and one way to turn a table into a validated frozen section.

Both commands read TOML: the build preset (``[features]``, ``[build]``) and the trainer
config (``[model]``, ``[data]``, ``[optim]``, ``[train]``), given as a path or as the name of
a preset shipped in the package (``melcache/presets/NAME.toml``). Each table becomes a frozen,
keyword-only dataclass whose ``__post_init__`` checks values with :func:`require`; unknown
tables and keys, and values of the wrong TOML type, are refused here by name.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from melcache.bounded import read_limited
from melcache.errors import UserError


def require(ok: bool, key: str, value: Any, expected: str) -> None:
    """Raise a UserError naming the config key, its bad value and what would be valid."""
    if not ok:
        raise UserError(f"config key {key} = {value!r} is invalid: expected {expected}")


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a numeric config key must fall in: ``[low, high]``, either end open."""

    low: float
    high: float
    open_low: bool = False
    open_high: bool = False

    def holds(self, value: float) -> bool:
        """Whether ``value`` is inside the range."""
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def describe(self, kind: str) -> str:
        """``"an int in [2, 1000000]"``: what a refusal says would be valid."""
        left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
        low, high = _number(self.low), _number(self.high)
        return f"{'an int' if kind == 'int' else 'a number'} in {left}{low}, {high}{right}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def bounded(
    default: float, low: float, high: float, *, open_low: bool = False, open_high: bool = False
) -> Any:
    """A numeric config field with its range stated beside it (checked by :func:`check_numbers`)."""
    return dataclasses.field(
        default=default, metadata={"bounds": Bounds(low, high, open_low, open_high)}
    )


def as_float(value: object) -> float:
    """A real number (not a bool) as a float: NaN for anything else, inf for an int past
    float's range, so one ``math.isfinite`` refuses every value that is not a usable number."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_numbers(config: Any, section: str) -> None:
    """Check every ``int`` and ``float`` field of the config dataclass ``config``, named
    ``section.key`` in errors: its type (a bool is not a number; an int given for a float key is
    converted, so it is never computed with as a Python big integer), finite, and within the
    range :func:`bounded` states beside it. Call it first in ``__post_init__``."""
    for field in dataclasses.fields(config):
        kind = str(field.type)
        if kind not in ("int", "float"):
            continue
        key, value = f"{section}.{field.name}", getattr(config, field.name)
        bounds = field.metadata.get("bounds")
        expected = bounds.describe(kind) if bounds else f"a finite {kind}"
        allowed = int if kind == "int" else (int, float)
        require(isinstance(value, allowed) and not isinstance(value, bool), key, value, expected)
        if kind == "float":
            value = as_float(value)
            object.__setattr__(config, field.name, value)  # frozen: set once, at creation
            require(math.isfinite(value), key, value, expected)
        require(bounds is None or bounds.holds(value), key, value, expected)


_PRESETS = resources.files("melcache") / "presets"


def preset_names() -> list[str]:
    """The names ``--config`` accepts besides a path: the presets installed with the package."""
    return sorted(
        f.name.removesuffix(".toml") for f in _PRESETS.iterdir() if f.name.endswith(".toml")
    )


def find_config(path: str | Path) -> Path:
    """``path`` itself when something is there, else the installed preset of that name."""
    if Path(path).exists() or Path(path).is_symlink():
        return Path(path)  # a FIFO or a dangling link is refused by the read, by name
    if str(path) in preset_names():
        return Path(str(_PRESETS.joinpath(f"{path}.toml")))  # installed as plain files
    raise UserError(
        f"config file {path} does not exist and is not a preset name ({', '.join(preset_names())})"
    )


def load_toml(path: str | Path, tables: Mapping[str, type] | None = None) -> dict[str, Any]:
    """Parse the TOML file or preset ``path``; refuse a table not named in ``tables`` (when
    given)."""
    path = find_config(path)
    try:
        data = tomllib.loads(read_limited(path).decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except RecursionError:
        raise UserError(f"config file {path} cannot be read: tables nested too deeply") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"config file {path} cannot be read: {exc}") from None
    if tables is not None:
        check_tables(data, tables, str(path))
    return data


def check_tables(data: Mapping[str, Any], tables: Mapping[str, type], source: str) -> None:
    """Refuse a top-level table that is not one of ``tables``."""
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise UserError(f"{source}: unknown table [{unknown[0]}]; expected {', '.join(tables)}")


def make_section(kind: type, table: Any, section: str, source: str) -> Any:
    """Build the config dataclass ``kind`` from a TOML table, naming any bad key or type."""
    if not isinstance(table, Mapping):
        raise UserError(f"{source}: [{section}] must be a table, got {table!r}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise UserError(
            f"{source}: unknown key {section}.{unknown[0]}; known keys are {', '.join(sorted(known))}"
        )
    values = dict(table)
    for field in dataclasses.fields(kind):
        if field.name not in values:
            continue
        if _is_section(field.default_factory):  # a sub-table: [train.parallel]
            values[field.name] = make_section(
                field.default_factory, values[field.name], f"{section}.{field.name}", source
            )
            continue
        _check_type(values[field.name], field, f"{section}.{field.name}")
        if str(field.type).startswith("tuple") and isinstance(values[field.name], list):
            values[field.name] = tuple(
                values[field.name]
            )  # TOML arrays; frozen configs hold tuples
        elif isinstance(values[field.name], Mapping):
            values[field.name] = dict(values[field.name])
    return kind(**values)


def _is_section(factory: Any) -> bool:
    return isinstance(factory, type) and dataclasses.is_dataclass(factory)


_SCALARS = {"int": int, "float": (int, float), "bool": bool, "str": str}


def _check_type(value: Any, field: dataclasses.Field, key: str) -> None:
    """TOML gives typed values; reject the wrong type here rather than deep inside torch."""
    expected = _SCALARS.get(str(field.type))
    if expected is None:
        return
    wrong_bool = isinstance(value, bool) and field.type != "bool"
    if wrong_bool or not isinstance(value, expected):
        kind = {
            "int": "an integer",
            "float": "a number",
            "bool": "true or false",
            "str": "a string",
        }
        raise UserError(
            f"config key {key} = {value!r} is invalid: expected {kind[str(field.type)]}"
        )
