"""Training-loader throughput: mel computed on the fly, against melcache's streaming loader.

    python -m benchmarks.loader_bench [--hours 1] [--workers 2] [--data /tmp/melcache-bench]

Makes (or reuses) espeak-ng speech with ``benchmarks.speech``, builds (or reuses) its cache
with the real ``preprocess build``, then runs in this one process tree, with the same number
of DataLoader workers each:

1. the baseline a seed script writes: a map-style Dataset that decodes, resamples (soxr HQ)
   and computes the same log-mel (``preprocess.features.MelExtractor``) in ``__getitem__``;
   random batches of 32, ``pin_memory`` (with CUDA), ``persistent_workers``,
   ``prefetch_factor=2``, a collate that sorts by length and pads;
2. ``train.data.make_loader`` over the cache, with its default per-shard sha256 check and
   again without it.

Both are measured warm: one full pass first, then whole passes over the corpus (the
baseline one, melcache as many as fit in ``--min-seconds``). Prints one JSON line per loader:
samples/s, audio seconds/s, padding fraction (padded frames ÷ all frames of the mel
tensors) and the ratio to the baseline; the melcache lines add the time to the first batch
after restoring a state saved at 1 % and at 90 % of an epoch.

The cache is built with the default build config, whose shards are cut from length-sorted
buckets: the loader batches within a shard, so that is what keeps padding low.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.speech import make_corpus
from melcache.batching import padding_fraction
from melcache.features import FeatureConfig, features_from_dict
from preprocess.features import MelExtractor
from train.collate import utf8_tokens
from train.data import DataConfig, make_loader


class OnTheFlyMels(Dataset):
    """The baseline: every item decodes, resamples and featurises one audio file."""

    def __init__(self, corpus: Path, features: FeatureConfig) -> None:
        self.files = sorted(corpus.glob("*/*.wav"))
        self.features = features
        self.extractor: MelExtractor | None = None  # built lazily, once per worker

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.extractor is None:
            self.extractor = MelExtractor(self.features)
        audio, rate = sf.read(self.files[i], dtype="float32", always_2d=True)
        audio = audio.mean(axis=1)
        if rate != self.features.sample_rate:
            audio = soxr.resample(audio, rate, self.features.sample_rate, quality="HQ")
        with torch.inference_mode():
            mel = self.extractor(torch.from_numpy(np.ascontiguousarray(audio)))
        text = self.files[i].with_suffix(".txt").read_text(encoding="utf-8").strip()
        return mel, torch.from_numpy(utf8_tokens(text))


def sort_and_pad(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The seed collate: longest first, zero-padded, with lengths."""
    items = sorted(items, key=lambda item: -item[0].shape[0])
    mel = torch.nn.utils.rnn.pad_sequence([m for m, _ in items], batch_first=True)
    text = torch.nn.utils.rnn.pad_sequence([t for _, t in items], batch_first=True)
    return {
        "mel": mel,
        "mel_lengths": torch.tensor([m.shape[0] for m, _ in items]),
        "text": text,
        "text_lengths": torch.tensor([len(t) for _, t in items]),
    }


def measure(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], samples: int) -> dict:
    """Consume batches (mel, mel_lengths) until ``samples`` samples; return the rates."""
    count = frames = padded = 0
    started = time.perf_counter()
    while count < samples:
        mel, lengths = next(batches)
        count += len(lengths)
        frames += int(lengths.sum())
        padded += mel.shape[0] * mel.shape[1]
    return {
        "samples": count,
        "frames": frames,
        "padded": padded,
        "wall": time.perf_counter() - started,
    }


def report(name: str, stats: dict, features: FeatureConfig, baseline: dict | None) -> dict:
    rate = stats["samples"] / stats["wall"]
    line = {
        "loader": name,
        "warm": True,
        "samples": stats["samples"],
        "seconds": round(stats["wall"], 2),
        "samples_per_s": round(rate, 1),
        "audio_seconds_per_s": round(
            stats["frames"] / features.frames_per_second / stats["wall"], 1
        ),
        "padding_fraction": round(padding_fraction(stats["frames"], stats["padded"]), 4),
        "ratio": round(rate / baseline["samples_per_s"], 1) if baseline else 1.0,
    }
    return line


def run_baseline(corpus: Path, features: FeatureConfig, workers: int) -> dict:
    dataset = OnTheFlyMels(corpus, features)
    loader = DataLoader(
        dataset,
        batch_size=32,
        shuffle=True,
        num_workers=workers,
        collate_fn=sort_and_pad,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=True,
        prefetch_factor=2,
        generator=torch.Generator().manual_seed(0),
    )

    def epoch() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return ((b["mel"], b["mel_lengths"]) for b in loader)

    measure(epoch(), len(dataset))  # warm-up pass: workers started, files in the page cache
    return measure(epoch(), len(dataset))


def mel_batches(stream: Iterable) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    return ((b.mel, b.mel_lengths) for b in stream)


def run_melcache(
    cache: Path, args: argparse.Namespace, utterances: int, check_sha256: bool
) -> tuple[dict, dict]:
    data = DataConfig(
        num_workers=args.workers, batch_frames=args.batch_frames, check_sha256=check_sha256
    )
    loader = make_loader(cache, data)
    stream = iter(loader)
    measure(mel_batches(stream), utterances // 100)
    state_1 = loader.state_dict()
    measure(mel_batches(stream), utterances * 89 // 100)
    state_90 = loader.state_dict()
    measure(mel_batches(stream), utterances // 10)  # the rest of the warm-up pass
    passes, stats = 0, {"samples": 0, "frames": 0, "padded": 0, "wall": 0.0}
    while passes == 0 or stats["wall"] < args.min_seconds:
        one = measure(mel_batches(stream), utterances)
        stats = {key: stats[key] + one[key] for key in stats}
        passes += 1
    loader.close()
    resume = {}
    for label, state in (("1%", state_1), ("90%", state_90)):
        started = time.perf_counter()
        restored = make_loader(cache, data)
        restored.load_state_dict(state)
        next(iter(restored))
        resume[label] = round(time.perf_counter() - started, 3)
        restored.close()
    return stats, {"passes": passes, "resume_first_batch_s": resume}


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    corpus = make_corpus(args.data / f"speech-{args.hours:g}h", args.hours, seed=0)
    cache = args.data / f"cache-{args.hours:g}h"
    if not (cache / "index.json").exists():
        command = [sys.executable, "-m", "preprocess", "build", "--src", str(corpus)]
        command += ["--out", str(cache)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return corpus, cache


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hours", type=float, default=1.0, help="corpus size (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument(
        "--batch-frames", type=int, default=8000, help="melcache frame budget (default 8000)"
    )
    parser.add_argument(
        "--min-seconds", type=float, default=10.0, help="measure melcache at least this long"
    )
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-bench"))
    args = parser.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    corpus, cache = prepare(args)
    index = json.loads((cache / "index.json").read_text())
    features, utterances = features_from_dict(index["features"]), index["totals"]["utterances"]

    base = report(
        "on-the-fly baseline", run_baseline(corpus, features, args.workers), features, None
    )
    print(json.dumps({**base, "batch_size": 32, "workers": args.workers}), flush=True)
    for check_sha256 in (True, False):  # the default, then without its sha256 check
        stats, extra = run_melcache(cache, args, utterances, check_sha256)
        ours = report("melcache", stats, features, base)
        line = {**ours, "batch_frames": args.batch_frames, "workers": args.workers}
        print(json.dumps({**line, "check_sha256": check_sha256, **extra}), flush=True)


if __name__ == "__main__":
    main()
