"""The compact mel storage, lz4-q5 (issue #15): within 2^-6 log units of the float32 mel, under
half of fp16's bytes, read by the loader, verify and inspect, refused loudly when damaged,
and rebuilt byte-identical after kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from numcodecs import blosc

from melcache.codec import decode_mel, decode_mel_into, encode_mel
from melcache.errors import ShardError, UserError
from melcache.features import FeatureConfig
from melcache.format import encode_npy
from melcache.index import read_index
from melcache.loader import DataConfig, make_loader
from melcache.storage import COMPACT, FP16, MEL_MEMBERS
from preprocess.check.verify import verify
from preprocess.config import BuildConfig
from preprocess.inputs.audio import load_mono, probe, resampled_length
from preprocess.write.extractor import MelExtractor
from tests.support.helpers import (
    SAMPLE_CORPUS,
    build_cache,
    build_command,
    cache_digests,
    receipts,
    run_preprocess,
    started,
    wait_for,
)

BOUND = 2.0**-6  # the acceptance: no larger an error than Lhotse's lilcom default
FEATURES = FeatureConfig()


@pytest.fixture(scope="module")
def float32_mels() -> dict[str, np.ndarray]:
    """The float32 log-mel of every sample-corpus file, as the build computes it."""
    extractor = MelExtractor(FEATURES)
    mels = {}
    for path in sorted(SAMPLE_CORPUS.rglob("*.wav")):
        count, rate = probe(str(path))
        length = resampled_length(count, rate, FEATURES.sample_rate)
        audio = load_mono(str(path), FEATURES.sample_rate, length, -70.0, FEATURES.hop_length)
        mels[path.name] = extractor(torch.from_numpy(audio)).numpy()
    return mels


def test_compact_mels_are_within_the_bound_at_under_half_the_bytes(float32_mels) -> None:
    compact = fp16 = 0
    decoded = {}
    for name, mel in float32_mels.items():
        data = encode_mel(mel, COMPACT)
        decoded[name] = decode_mel(data, COMPACT, FEATURES.n_mels, name)
        assert decoded[name].dtype == np.float16 and decoded[name].shape == mel.shape
        compact, fp16 = compact + len(data), fp16 + len(encode_mel(mel, FP16))
    assert compact < fp16 / 2
    for name, mel in float32_mels.items():  # checked after all: no decode reuses another's array
        assert np.abs(decoded[name].astype(np.float64) - mel).max() <= BOUND, name


def test_residuals_beyond_a_byte_are_escaped_exactly() -> None:
    rng = np.random.default_rng(0)
    mel = np.full((50, 100), np.log(1e-5), dtype=np.float32)  # silence at the log floor
    mel[10:20] = rng.uniform(-2, 6, size=(10, 100))  # a loud burst: steps of ~300 codes
    mel[30:, ::7] = 9.9
    data = encode_mel(mel, COMPACT)
    escapes = struct.unpack_from("<I", data, 16)[0]
    assert escapes > 100
    out = np.full((64, 100), 123, np.float16)
    assert decode_mel_into(data, COMPACT, 100, "burst", out) == 50
    assert np.abs(out[:50].astype(np.float64) - mel).max() <= BOUND
    assert (out[50:] == 123).all()  # rows past the mel untouched
    edges = np.zeros((2, 4), np.float32)
    edges[0] = np.cumsum([-128, 127, 128, -127]) * 2.0**-5  # residuals at the int8 edges
    assert np.array_equal(decode_mel(encode_mel(edges, COMPACT), COMPACT, 4, "edges"), edges)
    not_a_log_mel = np.array([[300.0, -300.0]], np.float32)  # residual 19200 codes: int16
    assert np.array_equal(
        decode_mel(encode_mel(not_a_log_mel, COMPACT), COMPACT, 2, "x"), [[300, -300]]
    )
    with pytest.raises(ValueError, match="lz4-q5 cannot hold a mel with values ~1000 log units"):
        encode_mel(np.array([[600.0, -600.0]], np.float32), COMPACT)


def test_escape_positions_that_do_not_increase_are_a_shard_error() -> None:
    mel = np.zeros((4, 8), np.float32)
    mel[1, 2], mel[2, 5] = 9.0, -9.0  # two residuals of ~288 codes each, both escaped
    data = encode_mel(mel, COMPACT)
    escapes = struct.unpack_from("<I", data, 16)[0]
    payload = bytearray(blosc.decompress(data[20:]))
    positions = np.frombuffer(payload, "<u4", escapes, offset=mel.size)
    assert escapes > 2 and (np.diff(positions) > 0).all()
    payload[mel.size : mel.size + 4 * escapes] = positions[::-1].tobytes()
    forged = data[:20] + blosc.compress(bytes(payload), b"lz4", 9, blosc.BITSHUFFLE, 0)
    with pytest.raises(ShardError, match=r"^forged: mel\.q5 escape positions are not increasing"):
        decode_mel(forged, COMPACT, 8, "forged")


def damaged(data: bytes, how: str) -> bytes:
    body = bytearray(data)
    if how == "magic":
        body[1] ^= 0xFF
    elif how == "channels":
        struct.pack_into("<H", body, 12, 80)
    elif how == "escapes":
        struct.pack_into("<I", body, 16, 7)
    elif how == "inflated size":  # Blosc's own header claims a bigger output
        struct.pack_into("<I", body, 20 + 4, 1 << 30)
    elif how == "cut":
        del body[len(body) // 2 :]
    elif how == "garbled":
        body[40:80] = bytes(40)
    return bytes(body)


@pytest.mark.parametrize("how", ["magic", "channels", "escapes", "inflated size", "cut", "garbled"])
def test_a_damaged_compact_mel_is_a_shard_error_naming_it(float32_mels, how: str) -> None:
    mel = next(iter(float32_mels.values()))
    data = damaged(encode_mel(mel, COMPACT), how)
    with pytest.raises(ShardError, match=r"^b00-000000.tar:utt: ") as caught:
        decode_mel(data, COMPACT, FEATURES.n_mels, "b00-000000.tar:utt")
    assert "\n" not in str(caught.value)


def test_a_mel_longer_than_its_metadata_says_is_refused(float32_mels) -> None:
    mel = next(iter(float32_mels.values()))
    for storage in (FP16, COMPACT):
        out = np.empty((len(mel) - 1, FEATURES.n_mels), np.float16)
        with pytest.raises(ShardError, match="more than the metadata says"):
            decode_mel_into(encode_mel(mel, storage), storage, FEATURES.n_mels, "x", out)


def test_storage_names_are_checked_where_they_are_read(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"build.storage = 'lilcom' is invalid: expected 'fp16'"):
        BuildConfig(storage="lilcom")
    assert "storage" not in BuildConfig().to_dict()  # fp16 caches keep their plan digests
    assert BuildConfig(storage=COMPACT).to_dict()["storage"] == COMPACT
    assert encode_mel(np.zeros((2, 3), np.float32), FP16) == encode_npy(np.zeros((2, 3)))


# ---- caches built with it ------------------------------------------------------------------
@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory, small_shards_config: Path) -> dict[str, Path]:
    """The sample corpus built with each storage."""
    root = tmp_path_factory.mktemp("storage")
    return {
        FP16: build_cache(root / FP16, small_shards_config),
        COMPACT: build_cache(root / COMPACT, small_shards_config, "--storage", COMPACT),
    }


def loaded(cache: Path) -> dict[str, np.ndarray]:
    """Every mel the loader yields from ``cache``, by key, float32."""
    found = {}
    loader = make_loader(cache, DataConfig(batch_frames=4000), rank=0, world_size=1)
    for batch in loader:
        for key, mel, frames in zip(batch.keys, batch.mel, batch.mel_lengths, strict=True):
            found[key] = mel[:frames].float().numpy()
        if len(found) == 30:
            break
    return found


@pytest.mark.slow
def test_a_compact_cache_loads_verifies_and_is_under_half_the_size(caches) -> None:
    index = read_index(caches[COMPACT])
    assert (
        index["build"]["storage"] == COMPACT and "storage" not in read_index(caches[FP16])["build"]
    )
    names = set()
    for shard in caches[COMPACT].glob("*.tar"):
        with tarfile.open(shard) as tar:
            names |= {member.name.split(".", 1)[1] for member in tar}
    assert names == {MEL_MEMBERS[COMPACT], "json"}
    assert verify(caches[COMPACT]) == []
    sizes = {k: sum(s["bytes"] for s in read_index(c)["shards"]) for k, c in caches.items()}
    assert sizes[COMPACT] < sizes[FP16] / 2
    compact, fp16 = loaded(caches[COMPACT]), loaded(caches[FP16])
    assert compact.keys() == fp16.keys() and len(compact) == 30
    for key, mel in compact.items():  # fp16 is within 2^-8 of the float32 mel here
        assert np.abs(mel - fp16[key]).max() <= BOUND + 2.0**-8, key
    summary = run_preprocess("inspect", str(caches[COMPACT])).stdout
    assert "(mels stored as lz4-q5)" in summary


@pytest.mark.slow
def test_a_damaged_compact_cache_is_refused_by_verify_and_the_loader(caches, tmp_path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(caches[COMPACT], cache)
    shard = sorted(cache.glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        member = next(m for m in tar if m.name.endswith(".q5"))
    data = bytearray(shard.read_bytes())
    data[member.offset_data + 1] ^= 0xFF  # the magic: only the member's own checks tell
    shard.write_bytes(bytes(data))
    problems = verify(cache)
    assert any("sha256 differs" in p for p in problems)
    assert any("mel.q5 header is not an lz4-q5 mel" in p for p in problems)
    with pytest.raises(ShardError, match=shard.name):
        loaded(cache)
    index = json.loads((cache / "index.json").read_text())
    index["build"]["storage"] = "lz4-q9"
    (cache / "index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"build\.storage = 'lz4-q9' is not one this melcache"):
        read_index(cache)


@pytest.mark.slow
def test_a_killed_compact_build_resumes_byte_identical(caches, tmp_path, small_shards_config):
    out = tmp_path / "out"
    command = build_command(
        SAMPLE_CORPUS, out, "--config", str(small_shards_config), "--workers", "1"
    )
    with started([*command, "--storage", COMPACT], tmp_path / "log") as proc:
        assert wait_for(lambda: out.exists() and receipts(out) > 0, proc, 120)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "index.json").exists()
    run_preprocess(*command[3:], "--storage", COMPACT)
    assert cache_digests(out) == cache_digests(caches[COMPACT])
