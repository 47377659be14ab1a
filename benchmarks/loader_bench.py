"""Training-loader throughput: mel computed on the fly, against melcache's streaming loader.

    python -m benchmarks.loader_bench [--hours 1] [--workers 2] [--data /tmp/melcache-bench]

Makes (or reuses) espeak-ng speech with ``benchmarks.speech``, builds (or reuses) its cache
with the real ``preprocess build``, and beside it the same cache as the previous release
wrote it (the shards hard-linked, the index without ``xxh3_128``). Then, in this one process
tree, with the same number of DataLoader workers each:

1. the baseline a seed script writes: a map-style Dataset that decodes, resamples (soxr HQ)
   and computes the same log-mel (``preprocess.write.extractor.MelExtractor``) in ``__getitem__``;
   random batches of 32, ``pin_memory`` (with CUDA), ``persistent_workers``,
   ``prefetch_factor=2``, a collate that sorts by length and pads;
2. ``melcache.loader.make_loader`` over each cache with its default shard check
   (``shard_check="fast"``) and with none (``"off"``), and over this release's cache with
   ``"sha256"`` (sha256 on every read, the previous default).

The baseline is measured warm: one full pass first, then one more. The melcache loaders are
all started, each taken through one pass on its own (saving states at 1 % and 90 % of it, to
time the first batch after a restore); then they take turns of ``--turn-seconds`` each, in
rounds whose order flips every round, until every one has run ``--min-seconds``: a change in
the machine's load falls on all of them alike (a waiting loader's workers only top up their
few prefetched batches, a few % of a turn). Each setting also runs as a fresh one-process
loader (``num_workers=0``) timed in CPU time, steady on shared cores, over its first pass
(every shard read and checked for the first time: sha256 on a previous-release cache) and
its second, in ``--cpu-rounds`` rounds.

Prints one JSON line per loader: warm samples/s, audio seconds/s, padding fraction (padded
frames ÷ all frames of the mel tensors), the ratio to the baseline and the one-process
rates; then one line of the checked-over-unchecked ratios, each the median over rounds of
the ratio within a round, which a burst of load on a shared machine moves less than it
moves the totals.

The cache is built with the default build config, whose shards are cut from length-sorted
buckets: the loader batches within a shard, so that is what keeps padding low.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
from melcache.batch_plans import padding_fraction
from melcache.features import FeatureConfig, features_from_dict
from melcache.index import read_index, write_index
from melcache.loader import DataConfig, make_loader
from melcache.loader.batch import utf8_tokens
from preprocess.write.extractor import MelExtractor


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


def measure(
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]], samples: int = 0, seconds: float = 0.0
) -> dict:
    """Consume batches (mel, mel_lengths) until ``samples`` samples and ``seconds`` seconds
    are both reached; return the counts and the wall time."""
    count = frames = padded = 0
    started = time.perf_counter()
    while count < samples or time.perf_counter() - started < seconds:
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


# (cache, shard_check) of each melcache loader: the default check and none, on a cache of
# this release and of the previous one, and sha256 on every read (the previous default).
MELCACHE_RUNS = (
    ("current", "fast"),
    ("current", "off"),
    ("previous", "fast"),
    ("previous", "off"),
    ("current", "sha256"),
)


class MelcacheRun:
    """One melcache loader, started and taken through its first pass, then measured in turns."""

    def __init__(self, cache: Path, args: argparse.Namespace, shard_check: str) -> None:
        self.data = DataConfig(
            num_workers=args.workers, batch_frames=args.batch_frames, shard_check=shard_check
        )
        self.cache, self.loader = cache, make_loader(cache, self.data)
        self.batches = mel_batches(iter(self.loader))
        self.totals = {"samples": 0, "frames": 0, "padded": 0, "wall": 0.0}
        self.rates: list[float] = []  # samples/s of each turn

    def warm_up(self, utterances: int) -> None:
        """One pass, saving the states at 1 % and 90 % of it."""
        measure(self.batches, utterances // 100)
        self.state_1 = self.loader.state_dict()
        measure(self.batches, utterances * 89 // 100)
        self.state_90 = self.loader.state_dict()
        measure(self.batches, utterances // 10)

    def turn(self, seconds: float) -> None:
        one = measure(self.batches, seconds=seconds)
        self.totals = {key: self.totals[key] + one[key] for key in self.totals}
        self.rates.append(one["samples"] / one["wall"])

    def resume_seconds(self) -> dict[str, float]:
        """Time to the first batch of a fresh loader restored at 1 % and at 90 %."""
        resume = {}
        for label, state in (("1%", self.state_1), ("90%", self.state_90)):
            started = time.perf_counter()
            restored = make_loader(self.cache, self.data)
            restored.load_state_dict(state)
            next(iter(restored))
            resume[label] = round(time.perf_counter() - started, 3)
            restored.close()
        return resume


def one_process_cpu(
    cache: Path, args: argparse.Namespace, shard_check: str, samples: int
) -> tuple[float, float]:
    """Samples per CPU second of a fresh loader reading in this process (``num_workers=0``):
    its first pass, where every shard is read and checked for the first time, and its second.
    CPU time of one process is the steady measure on shared cores."""
    data = DataConfig(num_workers=0, batch_frames=args.batch_frames, shard_check=shard_check)
    loader = make_loader(cache, data)
    batches = mel_batches(loader)
    rates = []
    for _ in range(2):
        started = time.process_time()
        stats = measure(batches, samples)
        rates.append(stats["samples"] / (time.process_time() - started))
    loader.close()
    return rates[0], rates[1]


def run_melcache(
    caches: dict[str, Path],
    args: argparse.Namespace,
    utterances: int,
    features: FeatureConfig,
    baseline: dict,
) -> tuple[list[dict], dict]:
    """Every loader of :data:`MELCACHE_RUNS`: warm-ups one after another, then rounds of
    turns; then rounds of one-process first passes. Returns a line per loader and the
    checked-over-unchecked ratios, each the median of the ratios within a round."""
    runs = {key: MelcacheRun(caches[key[0]], args, key[1]) for key in MELCACHE_RUNS}
    for run in runs.values():
        run.warm_up(utterances)
    order = list(runs)
    while min(run.totals["wall"] for run in runs.values()) < args.min_seconds:
        for key in order:
            runs[key].turn(args.turn_seconds)
        order.reverse()  # neighbours take turns in both orders: a drift in load cancels
    for run in runs.values():
        run.loader.close()
    first: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    second: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for _ in range(args.cpu_rounds):
        for key in order:
            one, two = one_process_cpu(caches[key[0]], args, key[1], utterances)
            first[key].append(one)
            second[key].append(two)
        order.reverse()
    lines = [
        {
            **report("melcache", run.totals, features, baseline),
            "cache": cache,
            "shard_check": check,
            "passes": round(run.totals["samples"] / utterances, 1),
            "turns": len(run.rates),
            "one_process_samples_per_cpu_s": {
                "first_pass": round(statistics.median(first[cache, check]), 1),
                "second_pass": round(statistics.median(second[cache, check]), 1),
                "rounds": args.cpu_rounds,
            },
            "resume_first_batch_s": run.resume_seconds(),
        }
        for (cache, check), run in runs.items()
    ]
    ratios = {"row": "checked over unchecked, median of the rounds"}
    for cache, check in runs:
        if check != "off":
            ratios[f"{cache}_{check}"] = median_ratio(
                runs[cache, check].rates, runs[cache, "off"].rates
            )
            for name, rates in (("first", first), ("second", second)):
                ratios[f"{cache}_{check}_one_process_{name}_pass"] = median_ratio(
                    rates[cache, check], rates[cache, "off"]
                )
    return lines, ratios


def median_ratio(checked: list[float], unchecked: list[float]) -> float:
    """The median over rounds of the checked rate over the unchecked one of the same round."""
    return round(statistics.median(a / b for a, b in zip(checked, unchecked, strict=True)), 3)


def previous_release(cache: Path, dest: Path) -> Path:
    """``cache`` as the previous release wrote it, made afresh: the same shards (hard links,
    so one page cache serves both), an index without ``xxh3_128``."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(cache, dest, copy_function=os.link)
    index = read_index(dest)
    for entry in index["shards"]:
        del entry["xxh3_128"]
    write_index(dest, index)  # a new file in place of the hard link to the current index
    return dest


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    corpus = make_corpus(args.data / f"speech-{args.hours:g}h", args.hours, seed=0)
    cache = args.data / f"cache-{args.hours:g}h"
    index = cache / "index.json"
    if index.exists() and "xxh3_128" not in json.loads(index.read_text())["shards"][0]:
        shutil.rmtree(cache)  # built by the previous release: not this release's cache
    if not index.exists():
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
        "--min-seconds", type=float, default=20.0, help="measure each melcache loader this long"
    )
    parser.add_argument(
        "--turn-seconds", type=float, default=0.5, help="one melcache loader's turn (default 0.5)"
    )
    parser.add_argument(
        "--cpu-rounds", type=int, default=3, help="one-process loaders per setting (default 3)"
    )
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-bench"))
    args = parser.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    corpus, cache = prepare(args)
    caches = {
        "current": cache,
        "previous": previous_release(cache, cache.with_name(cache.name + "-previous")),
    }
    index = read_index(cache)
    features, utterances = features_from_dict(index["features"]), index["totals"]["utterances"]

    base = report(
        "on-the-fly baseline", run_baseline(corpus, features, args.workers), features, None
    )
    print(json.dumps({**base, "batch_size": 32, "workers": args.workers}), flush=True)
    lines, ratios = run_melcache(caches, args, utterances, features, base)
    for line in lines:
        extra = {"batch_frames": args.batch_frames, "workers": args.workers}
        print(json.dumps({**line, **extra}), flush=True)
    print(json.dumps(ratios), flush=True)


if __name__ == "__main__":
    main()
