"""Hostile inputs to the readers (issue 37): keys that are not strings, a table changed under
an open cache, mix weights and temperatures, one cache mixed with itself. Every case ends in
a one-line error naming what is wrong, or works; never SIGBUS, a hang or a library traceback."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import melcache
from melcache.access import BadKey, UnknownKey
from melcache.dataset import CacheDataset
from melcache.errors import UserError
from melcache.loader import DataConfig, make_loader
from melcache.loader.schedule import mix_weights
from melcache.table import TABLE_NAME, TableChanged
from tests.support.helpers import REPO, run_preprocess


def copied(cache: Path, tmp_path: Path, name: str = "cache") -> Path:
    return Path(shutil.copytree(cache, tmp_path / name))


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


# --- item 7: keys that are not strings, rows that are not integers -------------------------


def test_lookups_by_what_is_neither_key_nor_row_are_type_errors(sample_cache: Path) -> None:
    with melcache.open(sample_cache) as cache:
        key = cache.keys()[3]
        for bad in (5, 2.9, None, b"KEY", [key]):
            with pytest.raises(BadKey) as error:
                cache.get(bad)  # type: ignore[arg-type]
            assert isinstance(error.value, TypeError) and "a key is a str" in one_line(error.value)
        for bad in ([0, 1], [key, 7]):
            with pytest.raises(BadKey, match="a key is a str, not int"):
                cache.get_many(bad)  # type: ignore[arg-type]
        for bad in (key, b"KEY", 5, None):  # a bare str must not be read char by char
            with pytest.raises(BadKey, match="get_many takes a list of keys") as error:
                cache.get_many(bad)  # type: ignore[arg-type]
            one_line(error.value)
        assert [u.key for u in cache.get_many(k for k in [key])] == [key]
        for bad in (2.9, True, None, [1]):
            with pytest.raises(BadKey, match=r"look up a key \(str\) or a row"):
                cache[bad]  # type: ignore[index]
    dataset = CacheDataset(sample_cache)
    with pytest.raises(BadKey, match=r"not float 2\.9"):
        dataset[2.9]  # type: ignore[index]
    assert dataset[key]["key"] == key == dataset[3]["key"]  # a key, as cache[key] takes
    with pytest.raises(UnknownKey):
        dataset["KEY"]
    with pytest.raises(BadKey, match=r"look up a row \(int\), not str"):
        dataset.get_frame_len("KEY")  # type: ignore[arg-type]
    for bad in (5, None, ["a"]):
        with pytest.raises(UserError, match="expected a folder or URL prefix"):
            melcache.open(bad)  # type: ignore[arg-type]


def test_make_loader_is_typed_at_its_door(sample_cache: Path) -> None:
    data = DataConfig(batch_frames=20_000, num_workers=0)
    where = str(sample_cache)
    for kwargs, key in (
        ({"rank": "0"}, "loader rank"),
        ({"world_size": 1.5}, "loader world_size"),
        ({"seed": None}, "loader seed"),
        ({"tokenizer": "bytes"}, "loader tokenizer"),
    ):
        with pytest.raises(UserError, match=key):
            make_loader(where, data, **kwargs)
    with pytest.raises(UserError, match="loader data"):
        make_loader(where, {"batch_frames": 20_000})  # type: ignore[arg-type]
    for bad in (None, 5, [], [5]):
        with pytest.raises(UserError, match="loader cache"):
            make_loader(bad, data)  # type: ignore[arg-type]


# --- item 3: utterances.table changed in place while open ----------------------------------

# Run in a child: on the old code a cut table is SIGBUS, which would kill pytest itself.
_CHANGED = r"""
import json, shutil, sys
from pathlib import Path
import torch
import melcache
from melcache.dataset import CacheDataset

mode, cache, other = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
table = cache / "utterances.table"
opened = CacheDataset(cache) if mode == "loader" else melcache.open(cache)
keys = (opened.cache if mode == "loader" else opened).keys()
lengths = opened.lengths
size = table.stat().st_size
if mode in ("empty", "loader", "lengths"):
    table.write_bytes(b"")
elif mode == "short":
    table.write_bytes(table.read_bytes()[:100])
elif mode == "zeroed":
    table.write_bytes(bytes(size))
elif mode == "other":
    shutil.copyfile(other / "utterances.table", table)
try:
    if mode == "loader":
        loader = torch.utils.data.DataLoader(opened, batch_size=2, num_workers=2, collate_fn=list)
        got = [item["key"] for batch in loader for item in batch]
    elif mode == "lengths":  # a copy: samplers keep it for a run, a view would be SIGBUS
        assert int(lengths.sum()) > 0
        got = [opened[keys[2]].key]
    else:
        got = [u.key for u in opened.get_many(keys[5:8])]
    print(json.dumps({"ok": got}))
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "line": str(exc).strip().splitlines()[-1]}))
"""


@pytest.mark.parametrize("mode", ["empty", "short", "zeroed", "other", "loader", "lengths"])
def test_a_table_changed_under_an_open_cache_is_one_line(
    mode: str, sample_cache: Path, train_cache: Path, tmp_path: Path
) -> None:
    cache = copied(sample_cache, tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", _CHANGED, mode, str(cache), str(train_cache)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # -7 is SIGBUS
    outcome = json.loads(run.stdout.splitlines()[-1])
    assert outcome.get("type") == TableChanged.__name__, outcome
    assert f"{cache / TABLE_NAME}: changed on disk while the cache was open" in outcome["line"]
    assert "shard" not in outcome["line"].split("while")[0]  # the table is named, no shard


def test_a_table_touched_but_unchanged_still_reads(sample_cache: Path, tmp_path: Path) -> None:
    cache = copied(sample_cache, tmp_path)
    with melcache.open(cache) as opened:
        key = opened.keys()[4]
        os.utime(cache / TABLE_NAME, ns=(1, 1))  # same bytes: rsync, touch
        assert opened[key].key == key
        data = (cache / TABLE_NAME).read_bytes()
        (cache / TABLE_NAME).write_bytes(data[:-64] + bytes(64))  # same size, other bytes
        with pytest.raises(TableChanged) as error:
            opened[key]
        assert f"{len(data)} bytes then, {len(data)} now" in one_line(error.value)


# --- items 1, 8, 11: mix weights, temperatures, one cache twice ----------------------------


def test_mix_weights_never_overflow_or_divide_by_zero() -> None:
    hours = [3.0, 1.0]
    assert mix_weights(hours, None, 300.5) == pytest.approx([1.0, 0.0])
    assert mix_weights(hours, [1e-200, 1e-200], 2) == pytest.approx([0.5, 0.5])
    assert mix_weights(hours, [1e-200, 2e-200], 2.0) == pytest.approx([0.2, 0.8])
    assert mix_weights([10**400, 10**400], None, 100_000_000) == pytest.approx([0.5, 0.5])
    assert mix_weights(hours, None, 0) == [0.5, 0.5]
    assert mix_weights(hours, None, 1) == pytest.approx([0.75, 0.25])


def test_mix_weights_from_python_are_refused_by_name(sample_cache: Path, train_cache: Path) -> None:
    a, b = str(sample_cache), str(train_cache)
    data = DataConfig(batch_frames=20_000, num_workers=0)
    for bad in ("x", None, [1.0], math.inf, math.nan, 10**400, True, -1.0, 0):
        with pytest.raises(UserError) as error:
            make_loader({a: 1.0, b: bad}, data)  # type: ignore[dict-item]
        assert f"loader mix weight of cache {b} = {bad!r} is invalid" in one_line(error.value)
    loader = make_loader({a: 1, b: 3}, data)  # ints are numbers too
    assert loader.weights == pytest.approx((0.25, 0.75))
    loader.close()


def test_one_cache_mixed_with_itself_is_refused(sample_cache: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(sample_cache)
    data = DataConfig(batch_frames=20_000, num_workers=0)
    here = Path.cwd()
    os.chdir(sample_cache.parent)
    try:
        name = sample_cache.name
        for twin in (f"{sample_cache}/", f"./{name}", str(link), name):
            with pytest.raises(UserError, match="are one cache; give each once") as error:
                make_loader([str(sample_cache), twin], data)
            assert twin in one_line(error.value)
    finally:
        os.chdir(here)
    with pytest.raises(UserError, match="are one cache"):
        make_loader(["http://host/c", "http://host/c/"], data)


def test_a_mix_table_naming_caches_not_read_is_refused(
    sample_cache: Path, train_cache: Path
) -> None:
    a, b = str(sample_cache), str(train_cache)
    with pytest.raises(UserError, match=r"data\.mix names .* \(differs: \[.*train_cache"):
        make_loader(a, DataConfig(batch_frames=20_000, num_workers=0, mix={a: 1.0, b: 2.0}))
    loader = make_loader(  # keyed by another spelling of the same folder: matched
        [a, b], DataConfig(batch_frames=20_000, num_workers=0, mix={f"{a}/": 1.0, b: 3.0})
    )
    assert loader.weights == pytest.approx((0.25, 0.75))
    loader.close()


@pytest.mark.slow  # subprocesses
def test_an_http_cache_that_cannot_be_reached_is_one_line_within_seconds() -> None:
    """webdataset's ``curl`` pipe retried a gone server for over a minute; now a deadline."""
    from benchmarks.common.s3_server import free_port

    location = f"http://127.0.0.1:{free_port()}/cache"
    for command in ("inspect", "verify"):
        began = time.monotonic()
        done = run_preprocess(command, location, check=False)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "cannot be read (" in done.stderr and time.monotonic() - began < 30
