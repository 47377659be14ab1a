"""The shard contract (``melcache/``): layering, format round trips, the index's checks, the
shard reader, the stats file and config sections. In-process and quick."""

from __future__ import annotations

import ast
import copy
import dataclasses
import io
import json
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from melcache.batch_plans import padding_fraction
from melcache.errors import ShardError, UserError
from melcache.features import FeatureConfig
from melcache.format import INDEX_NAME, decode_meta, encode_sample, fast_decode_mel
from melcache.index import read_index, read_stats, write_stats
from melcache.reader import DIGESTS, ShardCheck, integrity_problems, read_shard
from melcache.sections import make_section
from melcache.tar.reader import group_samples, iter_members, tar_members
from preprocess.check.verify import verify
from preprocess.config import BuildConfig
from tests.support.helpers import REPO
from tests.support.tars import shard_bytes

# Which top-level packages each may import: the two stages meet only in melcache.
ALLOWED = {"melcache": set(), "preprocess": {"melcache"}, "train": {"melcache"}}


def imported_packages(package: str) -> dict[str, set[str]]:
    """For each module of ``package``, the project packages it imports (absolute imports)."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO))] = names & set(ALLOWED)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_stages_meet_only_in_the_contract_package(package: str) -> None:
    modules = imported_packages(package)
    assert modules, f"{package} has no modules"
    wrong = {m: sorted(p - ALLOWED[package] - {package}) for m, p in modules.items()}
    assert not {m: p for m, p in wrong.items() if p}


def test_format_round_trip_through_both_readers() -> None:
    rng = np.random.default_rng(0)
    mels = {f"utt{i}": rng.normal(size=(5 + i, 7)).astype(np.float16) for i in range(3)}
    metas = {k: {"text": f"héllo {k}", "frames": len(m), "bucket": 0} for k, m in mels.items()}
    data = shard_bytes([encode_sample(k, mels[k], metas[k]) for k in mels])
    assert shard_bytes([encode_sample(k, mels[k], metas[k]) for k in mels]) == data  # reproducible
    fast = [(k, m, bytes(d)) for k, m, d in tar_members(data, "s")]
    assert fast == list(iter_members(io.BytesIO(data), "s"))
    samples = list(group_samples(iter(fast), "s"))
    assert [s["__key__"] for s in samples] == list(mels)
    for sample in samples:
        key = sample["__key__"]
        assert np.array_equal(fast_decode_mel(sample["mel.npy"], 7, key), mels[key])
        assert decode_meta(sample["json"], key) == metas[key]
    with pytest.raises(ShardError, match="dtype"):
        fast_decode_mel(samples[0]["mel.npy"], 8, "s:utt0")  # another n_mels is refused


def test_unknown_members_are_reported_by_both_tar_readers() -> None:
    sample = encode_sample("a", np.zeros((2, 3)), {"frames": 2})
    data = shard_bytes([{**sample, "pickle": b"\x80\x04."}])
    for read in (lambda seen: tar_members(data, "s", seen.append),
                 lambda seen: iter_members(io.BytesIO(data), "s", seen.append)):  # fmt: skip
        seen: list[str] = []
        assert [m for _, m, _ in read(seen)] == ["json", "mel.npy"]
        assert seen == ["a.pickle"]


def with_index(cache: Path, index: dict) -> Path:
    (cache / INDEX_NAME).write_text(json.dumps(index))
    return cache


HOSTILE_NAMES = [
    "../b00-000000.tar",
    "/etc/passwd",
    "http://host/b00-000000.tar",
    "x/b00-000000.tar",
]
BAD_VALUES = [None, "12", 1.5, True, [], -1]


@pytest.mark.parametrize(
    "field", ["bucket", "samples", "frames", "min_frames", "max_frames", "bytes"]
)
def test_index_counts_are_checked_by_name(cache_copy: Path, field: str) -> None:
    index = read_index(cache_copy)
    for value in BAD_VALUES:
        bad = copy.deepcopy(index)
        bad["shards"][1][field] = value
        with pytest.raises(UserError, match=rf"shards\[1\]\.{field} = "):
            read_index(with_index(cache_copy, bad))
    if field != "bytes":  # bytes may be absent from a hand-made index
        del bad["shards"][1][field]
        with pytest.raises(UserError, match=rf"shards\[1\]\.{field} = None"):
            read_index(with_index(cache_copy, bad))


def test_index_names_must_be_shard_names(cache_copy: Path) -> None:
    index = read_index(cache_copy)
    for name in [*HOSTILE_NAMES, 7, None]:
        index["shards"][0]["name"] = name
        with pytest.raises(UserError, match=r"shards\[0\]\.name = .* is not a shard name"):
            read_index(with_index(cache_copy, index))


def test_index_top_level_is_checked(cache_copy: Path) -> None:
    index = read_index(cache_copy)
    cases = {
        "format_version": (2, "format_version 2"),
        "features": ({**index["features"], "n_mels": "100"}, "features.n_mels"),
        "shards": ({}, r"index\.shards = \{\} is not a list"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(UserError, match=message):
            read_index(with_index(cache_copy, {**index, key: value}))
    for field, digits in (("sha256", 64), ("xxh3_128", 32)):
        bad = copy.deepcopy(index)
        bad["shards"][0][field] = "0" * (digits - 1)
        with pytest.raises(UserError, match=rf"{field} = '0+' is not {digits} lowercase hex"):
            read_index(with_index(cache_copy, bad))
    (cache_copy / INDEX_NAME).write_text("[1, 2")
    with pytest.raises(UserError, match="cannot read the cache index"):
        read_index(cache_copy)


def test_reader_and_verify_agree_on_a_sound_and_a_damaged_shard(cache_copy: Path) -> None:
    index = read_index(cache_copy)
    entry = max(index["shards"], key=lambda s: s["bytes"])
    location = str(cache_copy / entry["name"])
    samples = read_shard(location, entry, ShardCheck())
    assert len(samples) == entry["samples"]
    assert sum(s.frames for s in samples) == entry["frames"]
    assert {s.bucket for s in samples} == {entry["bucket"]}
    assert verify(cache_copy) == []
    data = bytearray((cache_copy / entry["name"]).read_bytes())
    data[2000] ^= 0xFF  # inside the first mel: still a readable tar
    (cache_copy / entry["name"]).write_bytes(bytes(data))
    messages = [
        f"{location}: {field} differs from the index (corrupt or replaced)"
        for field in ("sha256", "xxh3_128")
    ]
    assert integrity_problems(data, entry, location) == messages  # verify: every digest
    with pytest.raises(ShardError, match="xxh3_128 differs"):  # the loader's default
        read_shard(location, entry, ShardCheck())
    with pytest.raises(ShardError, match="sha256 differs"):
        read_shard(location, entry, ShardCheck("sha256"))
    assert len(read_shard(location, entry, ShardCheck("off"))) == entry["samples"]
    report = verify(cache_copy)
    assert all(m.replace(location, entry["name"]) in report for m in messages)


def test_fast_check_of_an_index_without_xxh3_remembers_what_passed_sha256(
    cache_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache of the previous release (no xxh3_128): sha256 once per reader and shard, then
    the xxh3_128 of the bytes that passed, so a change after the first read is caught too."""
    entry = max(read_index(cache_copy)["shards"], key=lambda s: s["bytes"])
    del entry["xxh3_128"]
    location, shard = str(cache_copy / entry["name"]), cache_copy / entry["name"]
    hashed: list[str] = []
    sha256 = DIGESTS["sha256"]
    monkeypatch.setitem(DIGESTS, "sha256", lambda data: hashed.append("sha256") or sha256(data))
    check = ShardCheck()
    for _ in range(3):
        assert len(read_shard(location, entry, check)) == entry["samples"]
    assert hashed == ["sha256"]  # later reads: xxh3_128 only
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"{location}: changed since its sha256 was checked"):
        read_shard(location, entry, check)
    with pytest.raises(ShardError, match=f"{location}: sha256 differs"):  # another reader
        read_shard(location, entry, ShardCheck())
    with pytest.raises(ValueError, match="'fastest'"):
        ShardCheck("fastest")


def test_stats_round_trip_and_shape_check(tmp_path: Path) -> None:
    mean, std = np.linspace(-5, 1, 4), np.linspace(0.5, 2, 4)
    write_stats(tmp_path, mean, std, frames=10)
    got_mean, got_std = read_stats(tmp_path, 4)
    assert (
        got_mean.dtype == np.float32 and np.allclose(got_mean, mean) and np.allclose(got_std, std)
    )
    with pytest.raises(UserError, match="not \\[5\\]"):
        read_stats(tmp_path, 5)
    with pytest.raises(UserError, match="not found"):
        read_stats(tmp_path / "nowhere", 4)


def test_config_sections_check_keys_and_types() -> None:
    build = make_section(BuildConfig, {"bucket_edges_seconds": [1.0, 2.0]}, "build", "t.toml")
    assert build.bucket_edges_seconds == (1.0, 2.0)  # TOML arrays become tuples
    with pytest.raises(UserError, match=r"unknown key build\.edges"):
        make_section(BuildConfig, {"edges": [1.0]}, "build", "t.toml")
    with pytest.raises(UserError, match=r"features\.sample_rate = '24000'"):
        make_section(FeatureConfig, {"sample_rate": "24000"}, "features", "t.toml")
    with pytest.raises(UserError, match=r"features\.center = 1"):
        make_section(FeatureConfig, {"center": 1}, "features", "t.toml")
    with pytest.raises(UserError, match=r"\[build\] must be a table"):
        make_section(BuildConfig, 3, "build", "t.toml")
    fields = {f.name for f in dataclasses.fields(FeatureConfig)}
    assert make_section(FeatureConfig, {}, "features", "t.toml").to_dict().keys() == fields


def test_padding_fraction() -> None:
    assert padding_fraction(75, 100) == 0.25
    assert padding_fraction(0, 0) == 0.0


def test_pyproject_claims_ranges_the_suite_runs_on() -> None:
    """Python and every dependency: the installed version satisfies the claim, and each claim
    is a tested range, a floor and a ceiling (or one exact pin), never open-ended."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    python = ".".join(map(str, sys.version_info[:3]))
    assert SpecifierSet(project["requires-python"]).contains(python)
    optional = project["optional-dependencies"]
    claims = [*project["dependencies"], *optional["test"], *optional["plot"], *optional["parquet"],
              *optional["s3"]]  # fmt: skip
    for requirement in map(Requirement, claims):
        installed = Version(metadata.version(requirement.name))
        assert requirement.specifier.contains(installed), f"{requirement} but {installed}"
        operators = sorted(spec.operator for spec in requirement.specifier)
        assert operators in (["<", ">="], ["=="]), f"{requirement} is not a tested range"
