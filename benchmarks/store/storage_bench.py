"""Mel storage kinds side by side: bytes per hour, error, build speed and loader speed.

    python -m benchmarks.store.storage_bench [--hours 1] [--workers 2] [--rounds 2] [--data DIR]

Makes (or reuses) the espeak-ng speech corpus of ``benchmarks.loader.loader_bench``, builds it once
per storage kind (``fp16``, ``lz4-q5``) with the real command, alternating, ``--rounds``
times each (the best real-time factor counts), then for each cache reports:

- MB per hour of audio: of the mel members alone (what a feature store holds, comparable to
  Lhotse's) and of the whole shards (tar headers, metadata json);
- the max and mean absolute error of every stored mel against the float32 mel the build
  computes from the same audio;
- loader samples/s (``melcache.loader.make_loader``, ``--workers`` processes, its default
  integrity check), warm, alternating between the caches ``--rounds`` times.

When ``lhotse`` is installed (it is not a dependency), the same float32 mels go through its
``LilcomChunkyWriter`` (lilcom, ``tick_power=-5``, its default) for the size and error of the
nearest peer. One JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.caches import timed_build
from benchmarks.common.speech import make_corpus
from benchmarks.common.throughput import consume, mel_batches
from melcache.codec import decode_mel
from melcache.features import FeatureConfig, features_from_dict
from melcache.index import read_index
from melcache.loader import DataConfig, make_loader
from melcache.storage import STORAGE_OF_MEMBER, STORAGES
from preprocess.inputs.audio import load_mono, probe, resampled_length
from preprocess.write.extractor import MelExtractor


def float32_mels(corpus: Path, sources: list[str], features: FeatureConfig) -> Iterator[np.ndarray]:
    """The float32 log-mel the build computes for each source, in order."""
    extractor = MelExtractor(features)
    for source in sources:
        path = str(corpus / source)
        count, rate = probe(path)
        length = resampled_length(count, rate, features.sample_rate)
        audio = load_mono(path, features.sample_rate, length, -70.0, features.hop_length)
        with torch.inference_mode():
            yield extractor(torch.from_numpy(audio)).numpy()


def stored_mels(cache: Path, n_mels: int) -> Iterator[tuple[str, np.ndarray, int]]:
    """``(source, mel as float16, member bytes)`` of every sample of a cache."""
    for shard in sorted(cache.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
        for name, data in members.items():
            key, _, member = name.partition(".")
            if member in STORAGE_OF_MEMBER:
                meta = json.loads(members[f"{key}.json"])
                storage = STORAGE_OF_MEMBER[member]
                yield meta["source"], decode_mel(data, storage, n_mels, name), len(data)


def storage_rows(corpus: Path, cache: Path) -> dict[str, float]:
    """Size and error of one cache against the float32 mels of its corpus."""
    index = read_index(cache)
    features = features_from_dict(index["features"])
    stored = list(stored_mels(cache, features.n_mels))
    hours = index["totals"]["seconds"] / 3600
    references = float32_mels(corpus, [source for source, _, _ in stored], features)
    return {
        "mel_mb_per_hour": round(sum(size for _, _, size in stored) / 1e6 / hours, 2),
        "shard_mb_per_hour": round(sum(s["bytes"] for s in index["shards"]) / 1e6 / hours, 2),
        **errors(zip((mel for _, mel, _ in stored), references, strict=True)),
    }


def errors(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Max and mean absolute difference over ``(stored, float32 reference)`` pairs."""
    worst, total, values = 0.0, 0.0, 0
    for stored, reference in pairs:
        error = np.abs(stored.astype(np.float64) - reference)
        worst, total, values = (
            max(worst, float(error.max())),
            total + error.sum(),
            values + error.size,
        )
    return {"max_abs_error": round(worst, 6), "mean_abs_error": round(total / values, 6)}


def loader_rate(cache: Path, workers: int, min_seconds: float) -> float:
    """Warm loader samples/s over whole passes, at least ``min_seconds`` of them."""
    utterances = read_index(cache)["totals"]["utterances"]
    loader = make_loader(cache, DataConfig(num_workers=workers, batch_frames=8000))
    stream = iter(loader)
    consume(mel_batches(stream), utterances)  # warm-up pass
    samples, wall = 0, 0.0
    while wall < min_seconds:
        one = consume(mel_batches(stream), utterances)
        samples, wall = samples + one["samples"], wall + one["wall"]
    loader.close()
    return samples / wall


def lhotse_row(corpus: Path, cache: Path) -> dict[str, object] | None:
    """Lhotse's lilcom storage of the same float32 mels, when lhotse is installed."""
    try:
        from lhotse import LilcomChunkyWriter, __version__
        from lhotse.features.io import LilcomChunkyReader
    except ImportError:
        return None
    index = read_index(cache)
    features = features_from_dict(index["features"])
    sources = [source for source, _, _ in stored_mels(cache, features.n_mels)]
    references = list(float32_mels(corpus, sources, features))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "feats.lca"
        with LilcomChunkyWriter(path) as writer:
            keys = [writer.write(str(i), mel) for i, mel in enumerate(references)]
        reader = LilcomChunkyReader(path)
        measured = errors(zip((reader.read(key) for key in keys), references, strict=True))
        size = path.stat().st_size
    hours = index["totals"]["seconds"] / 3600
    return {
        "row": f"lhotse {__version__} LilcomChunkyWriter",
        "mel_mb_per_hour": round(size / 1e6 / hours, 2),
        **measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=5.0, help="loader time per round")
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-bench"))
    args = parser.parse_args()
    corpus = make_corpus(args.data / f"speech-{args.hours:g}h", args.hours, seed=0)
    caches = {name: args.data / f"storage-{name}-{args.hours:g}h" for name in STORAGES}
    build = dict.fromkeys(STORAGES, 0.0)
    loader = dict.fromkeys(STORAGES, 0.0)
    for _ in range(args.rounds):  # alternating, so both see the same machine load
        for name, cache in caches.items():
            wall, seconds, _ = timed_build(corpus, cache, args.workers, "--storage", name)
            build[name] = max(build[name], seconds / wall)
    for _ in range(args.rounds):
        for name, cache in caches.items():
            loader[name] = max(loader[name], loader_rate(cache, args.workers, args.min_seconds))
    for name, cache in caches.items():
        row = {"row": name, **storage_rows(corpus, cache), "workers": args.workers}
        row |= {
            "build_real_time_x": round(build[name]),
            "loader_samples_per_s": round(loader[name]),
        }
        print(json.dumps(row), flush=True)
    compact, fp16 = STORAGES[1], STORAGES[0]
    ratios = {
        "loader_compact_over_fp16": round(loader[compact] / loader[fp16], 2),
        "build_compact_over_fp16": round(build[compact] / build[fp16], 2),
    }
    print(json.dumps({"row": "ratio", **ratios}), flush=True)
    peer = lhotse_row(corpus, caches[compact])
    if peer is not None:
        print(json.dumps(peer), flush=True)


if __name__ == "__main__":
    main()
