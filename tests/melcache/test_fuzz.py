"""Fuzzing what a downloaded cache can hold: its index and its shards' members.

Every case must end in a one-line ``UserError``/``ShardError`` or a correct read, never a
traceback from inside a library, a hang or a batch holding NaN or infinity. The cache is a
tiny one written here with melcache's own writer, so thousands of cases run in seconds.
"""

from __future__ import annotations

import copy
import io
import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melcache.batch_plans import make_rng, plan_batches, round_up
from melcache.errors import ShardError, UserError
from melcache.features import FeatureConfig
from melcache.format import (
    FORMAT_VERSION,
    INDEX_NAME,
    REJECTED_NAME,
    STATS_NAME,
    encode_sample,
    finite_mel,
    shard_name,
)
from melcache.index import read_index, write_index, write_stats
from melcache.loader import DataConfig, make_loader
from melcache.loader.batch import collate, utf8_tokens
from melcache.reader import ShardCheck, read_shard
from melcache.tar.writer import open_tar_writer
from preprocess.check.inspect import summarize
from preprocess.check.verify import verify
from tests.support.helpers import recorded

N_MELS = FeatureConfig().n_mels
# Values a hostile or broken index or metadata might hold, beside the honest ones.
ODD_VALUES: list[Any] = [
    None, -1, 0, 1, 7, 2**63, 10**30, 1.5, -0.0, math.nan, math.inf, True, "", "12",
    "\ud800", "../b00-000000.tar", "/etc/passwd", "http://host/x.tar", [], [1], {}, {"a": 1},
]  # fmt: skip


def tar_bytes(samples: list[dict[str, Any]]) -> bytes:
    buffer = io.BytesIO()
    with open_tar_writer(buffer) as writer:
        for sample in samples:
            writer.write(sample)
    return buffer.getvalue()


def tiny_samples(bucket: int, frames: list[int], rng: np.random.Generator) -> list[tuple]:
    """``(key, mel, meta)`` of one shard's utterances."""
    out = []
    for i, n in enumerate(frames):
        key = f"b{bucket}_utt{i}"
        mel = rng.normal(-4, 2, size=(n, N_MELS)).clip(min=-11.5).astype(np.float16)  # ≥ log floor
        meta = {"text": f"utterance {i}", "speaker": "s1", "seconds": n * 256 / 24000,
                "frames": n, "sample_rate": 24000, "source": f"{key}.wav", "bucket": bucket}  # fmt: skip
        out.append((key, mel, meta))
    return out


def write_tiny_cache(folder: Path) -> Path:
    """A complete two-shard cache laid out as ``preprocess build`` lays it out."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lengths = {0: [5, 6, 8], 1: [20, 23, 30]}
    shards, buckets, all_mels = [], [], []
    for bucket, frames in lengths.items():
        samples = tiny_samples(bucket, frames, rng)
        data = tar_bytes([encode_sample(k, m, meta) for k, m, meta in samples])
        name = shard_name(bucket, bucket)
        (folder / name).write_bytes(data)
        shards.append({"name": name, "bucket": bucket, "samples": len(frames),
                       "frames": sum(frames), "min_frames": min(frames), "max_frames": max(frames),
                       **recorded(data)})  # fmt: skip
        buckets.append({"bucket": bucket, "min_seconds": 0.3, "max_seconds": 30.0,
                        "min_frames": min(frames), "max_frames": max(frames)})  # fmt: skip
        all_mels += [m.astype(np.float32) for _, m, _ in samples]
    stacked = np.concatenate(all_mels)
    write_stats(folder, stacked.mean(axis=0), stacked.std(axis=0), len(stacked))
    (folder / REJECTED_NAME).write_text("")
    features = FeatureConfig()
    utterances, frames = sum(s["samples"] for s in shards), len(stacked)
    write_index(folder, {
        "format_version": FORMAT_VERSION, "features": features.to_dict(),
        "features_digest": features.digest(), "build": {}, "plan_digest": "0" * 16,
        "keep_audio": False, "buckets": buckets, "shards": shards,
        "totals": {"discovered": utterances, "utterances": utterances, "seconds": 1.0,
                   "hours": 0.0003, "frames": frames, "shards": 2, "rejected": 0,
                   "rejected_by_reason": {}},
        "stats": STATS_NAME,
    })  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = write_tiny_cache(tmp_path_factory.mktemp("tiny") / "cache")
    assert verify(cache) == []  # the fuzz starts from a sound cache
    return cache


def expect_clean(case: str, action: Callable[[], Any]) -> Any:
    """Run ``action``: a result, or ``None`` after a one-line melcache error; anything else
    fails the test naming the case."""
    try:
        return action()
    except (UserError, ShardError) as exc:
        assert "\n" not in str(exc), f"{case}: a multi-line error: {exc}"
        assert str(exc), f"{case}: an empty error"
        return None


# ---- the index -------------------------------------------------------------------------


def leaf_paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every key path into a JSON tree (containers included)."""
    paths = [path] if path else []
    if isinstance(node, dict):
        for key, value in node.items():
            paths += leaf_paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            paths += leaf_paths(value, (*path, i))
    return paths


def mutate_index(index: dict, rng: random.Random) -> tuple[dict, str]:
    """A copy of ``index`` with one field deleted or set to an odd value."""
    index = copy.deepcopy(index)
    path = rng.choice(leaf_paths(index))
    parent = index
    for part in path[:-1]:
        parent = parent[part]
    if rng.random() < 0.25:
        del parent[path[-1]]
        return index, f"del {path}"
    value = rng.choice(ODD_VALUES)
    parent[path[-1]] = value
    return index, f"{path} = {value!r}"


def test_fuzzed_index_gives_one_line_errors_or_a_sound_read(tiny_cache: Path, tmp_path: Path):
    cache = Path(shutil.copytree(tiny_cache, tmp_path / "cache"))
    honest = json.loads((tiny_cache / INDEX_NAME).read_text())
    rng = random.Random(0)
    accepted = 0
    for _ in range(1500):
        index, case = mutate_index(honest, rng)
        (cache / INDEX_NAME).write_text(json.dumps(index))
        if expect_clean(case, lambda: read_index(cache)) is None:
            continue
        accepted += 1
        # What the index let through must not trip any of its readers.
        expect_clean(case, lambda: summarize(cache))
        expect_clean(case, lambda: verify(cache))
        data = DataConfig(num_workers=0, batch_frames=400)
        loader = expect_clean(case, lambda: make_loader(cache, data))  # noqa: B023
        if loader is not None:
            batch = expect_clean(case, lambda: next(iter(loader)))  # noqa: B023
            loader.close()
            assert batch is None or finite_mel(batch.mel.numpy()), case
    assert 100 < accepted < 1400  # both paths were exercised


# ---- shard members ---------------------------------------------------------------------


def mutate_shard(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Damaged bytes of a shard: flipped bytes, a cut, a random span, or a sample rewritten
    with odd metadata or a mel holding NaN, of another shape or dtype."""
    kind = rng.choice(["flip", "cut", "span", "meta", "mel"])
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out), kind
    if kind == "cut":
        end = rng.randrange(len(data))
        return data[:end], f"cut at {end}"
    if kind == "span":
        start = rng.randrange(len(data))
        span = bytes(rng.randrange(256) for _ in range(rng.randint(1, 600)))
        return data[:start] + span + data[start + len(span) :], f"span at {start}"
    samples = tiny_samples(0, [5, 6, 8], np.random.default_rng(rng.randrange(1000)))
    victim = rng.randrange(len(samples))
    key, mel, meta = samples[victim]
    if kind == "meta":
        field = rng.choice(["frames", "text", "speaker", "bucket"])
        meta = {**meta, field: rng.choice(ODD_VALUES)}
        case = f"meta {field} = {meta[field]!r}"
    else:
        change = rng.choice(["nan", "inf", "shape", "dtype"])
        mel = mel.copy()
        if change in ("nan", "inf"):
            mel[rng.randrange(len(mel)), rng.randrange(N_MELS)] = (
                np.nan if change == "nan" else -np.inf
            )
        elif change == "shape":
            mel = mel[:, : rng.randrange(N_MELS)]
        case = f"mel {change}"
        if change == "dtype":
            buffer = io.BytesIO()
            np.save(buffer, mel.astype(np.float32))
            rows = [encode_sample(k, m, md) for k, m, md in samples]
            rows[victim]["mel.npy"] = buffer.getvalue()
            return tar_bytes(rows), case
    rows = [encode_sample(k, m, md) for k, m, md in samples[:victim]]
    odd = encode_sample(key, mel, {})
    odd["json"] = json.dumps(meta).encode()  # ASCII escapes: "\ud800" is valid JSON
    rows += [odd] + [encode_sample(k, m, md) for k, m, md in samples[victim + 1 :]]
    return tar_bytes(rows), case


def load_and_collate(path: Path, entry: dict, case: str) -> int:
    """What a loader worker does with one shard: read, plan, decode and pad every batch;
    return how many batches came out, each checked to be finite."""
    samples = expect_clean(case, lambda: read_shard(str(path), entry, ShardCheck()))
    if samples is None:
        return 0
    budget = round_up(entry["max_frames"], 8) * 2
    plan = plan_batches([s.frames for s in samples], rng=make_rng(0, 2), batch_frames=budget,
                        max_batch_size=4, pad_multiple=8)  # fmt: skip
    for made, indices in enumerate(plan):
        buffers: list[np.ndarray] = []

        def mel_out(shape: tuple[int, int, int], into: list = buffers) -> np.ndarray:
            into.append(np.empty(shape, np.float16))
            return into[-1]

        packed = expect_clean(case, lambda: collate(
            [samples[i] for i in indices], seq=0, mel_out=mel_out, n_mels=N_MELS,  # noqa: B023
            pad_multiple=8, pad_value=math.log(1e-5), tokenizer=utf8_tokens, where=str(path), bucket=0,
        ))  # fmt: skip
        if packed is None:
            return made
        assert finite_mel(buffers[0]), f"{case}: a batch holds NaN or infinity"
    return len(plan)


def test_fuzzed_shards_give_one_line_errors_or_finite_batches(tiny_cache: Path, tmp_path: Path):
    index = read_index(tiny_cache)
    honest_entry = index["shards"][0]
    honest = (tiny_cache / honest_entry["name"]).read_bytes()
    rng = random.Random(1)
    path = tmp_path / honest_entry["name"]
    batches = refused = 0
    for number in range(2000):
        data, case = mutate_shard(honest, rng)
        path.write_bytes(data)
        entry = dict(honest_entry)
        if number % 2:  # the index was rewritten along with the shard: the parser must cope
            entry.update(recorded(data))
        made = load_and_collate(path, entry, f"case {number}: {case}")
        batches += made
        refused += made == 0
    assert batches > 0 and refused > 500  # both outcomes were exercised


# ---- checkpoints -------------------------------------------------------------------------


def fuzzed_bytes(real: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Random bytes, a cut, or flipped bytes of a real checkpoint file."""
    roll = rng.random()
    if roll < 0.3:
        size = rng.choice([0, 1, 7, 64, 1000, len(real)])
        return rng.randbytes(size), f"{size} random bytes"
    if roll < 0.7:
        cut = rng.randrange(len(real))
        return real[:cut], f"cut at {cut}"
    data = bytearray(real)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data), "flipped bytes"


def test_fuzzed_checkpoint_files_give_one_line_errors_or_a_load(tmp_path: Path) -> None:
    import torch

    from train.parallel.env import Env
    from train.run.checkpoint import MARKER, SHARED, Checkpointer, rank_file

    cpu = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    ckpt = Checkpointer(tmp_path, cpu, keep=2, async_save=False)
    model = torch.nn.Linear(8, 4)
    ckpt.save(1, {"step": 1, "model": model.state_dict(), "config": {"a": [1]}}, {"rng": {}})
    folder = tmp_path / "step-00000001"
    originals = {name: (folder / name).read_bytes() for name in (SHARED, rank_file(0), MARKER)}
    rng = random.Random(24)
    for case in range(150):
        name = rng.choice(list(originals))
        data, how = fuzzed_bytes(originals[name], rng)
        (folder / name).write_bytes(data)
        expect_clean(f"case {case}, {name}: {how}", ckpt.restore)
        (folder / name).write_bytes(originals[name])
