"""``preprocess verify`` finds every kind of damage and never unpickles a planted member."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from melcache.format import INDEX_NAME
from tests.support.helpers import run_preprocess

pytestmark = pytest.mark.slow  # `preprocess verify` as a subprocess per case: the full tier


@pytest.fixture
def cache(tmp_path: Path, sample_cache: Path) -> Path:
    """A private copy of the sample cache, free to damage."""
    return Path(shutil.copytree(sample_cache, tmp_path / "cache"))


def first_shard(cache: Path) -> Path:
    return cache / json.loads((cache / INDEX_NAME).read_text())["shards"][0]["name"]


def problems(cache: Path) -> str:
    done = run_preprocess("verify", str(cache), "--workers", "1", check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def test_truncated_shard(cache: Path) -> None:
    shard = first_shard(cache)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2 + 100])
    report = problems(cache)
    assert f"{shard.name}: sha256 differs" in report and f"{shard.name}: " in report


def test_flipped_byte(cache: Path) -> None:
    shard = first_shard(cache)
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))
    report = problems(cache)
    assert f"{shard.name}: sha256 differs from the index" in report
    assert "utterances.table" not in report  # the table was sound: following it cured nothing


def test_deleted_shard(cache: Path) -> None:
    shard = first_shard(cache)
    shard.unlink()
    assert f"{shard.name}: shard missing" in problems(cache)


def test_extra_shard(cache: Path) -> None:
    shutil.copy(first_shard(cache), cache / "b00-999999.tar")
    assert "b00-999999.tar: shard not listed in index.json" in problems(cache)


class Payload:
    """Unpickling this writes a marker file: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_planted_pickle_is_never_unpickled(cache: Path, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled.txt"
    shard = first_shard(cache)
    with tarfile.open(shard, "a") as tar:  # append members a hostile shard could carry
        for name, data in [
            ("evil.pickle", pickle.dumps(Payload(marker))),
            ("evil.pyd", pickle.dumps(Payload(marker))),
            ("objects.mel.npy", _object_npy(Payload(marker))),
            ("objects.json", b"{}"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    report = problems(cache)
    assert "foreign member 'evil.pickle' (never read)" in report
    assert "objects: mel.npy is not a plain numpy array" in report
    assert not marker.exists()


def _object_npy(obj: object) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.array([obj], dtype=object), allow_pickle=True)
    return buffer.getvalue()
