"""Build throughput: ``preprocess build`` against a naive one-file-at-a-time librosa loop.

    python -m benchmarks.build.build_bench [--hours 3] [--workers N] [--data bench-data]

Makes (or reuses) ≥ 3 h of espeak-ng speech, builds it and a tiny corpus with the real
command, and reports the steady-state real-time factor, (big − tiny audio) ÷ (big − tiny
wall), so start-up is not counted. The same is done for a copy of both corpora resampled
to 24 kHz beforehand (what a build of a 24 kHz corpus costs: no resampling step). The naive
loop (librosa.load with soxr, melspectrogram, np.save) runs on a slice of the same corpus in
the same run, and decode, resample and mel are timed alone on one core, melcache's and the
stock ones, for the bound they set. One JSON line per row.

The build against its bound is measured in ``--rounds`` rounds, each timing the three
steps alone just before and just after its pair of builds, and reported as the median of
the per-round ratios with their interquartile range: on shared cores the load moves between
one measurement and the next. It is reported in CPU time too (the three steps' CPU seconds
per audio second alone, over the build's, all its processes together), which the load
moves less. Each round also times the three steps in ``--workers`` processes at once, as
the build's workers run them (sharing caches and memory bandwidth): the concurrent bound,
the nearest ceiling a build of that many workers can reach, reported beside the first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import librosa
import numpy as np
import soundfile as sf
import soxr
import torch
import torchaudio

from benchmarks.common.caches import build_cpu_seconds, timed_build
from benchmarks.common.speech import make_corpus
from melcache.features import FeatureConfig
from preprocess.inputs.audio import read_float32
from preprocess.write.extractor import MelExtractor


def steady_build(big: Path, tiny: Path, data: Path, workers: int) -> dict[str, float]:
    """Build both corpora; the big build's wall, audio and bytes, the tiny build's wall, the
    steady real-time factor (big − tiny audio) ÷ (big − tiny wall) and the steady CPU seconds
    per audio second (big − tiny CPU) ÷ (big − tiny audio)."""
    tiny_wall, tiny_audio, _ = timed_build(tiny, data / "cache-tiny", workers)
    big_wall, big_audio, big_bytes = timed_build(big, data / "cache-big", workers)
    cpu = build_cpu_seconds(data / "cache-big") - build_cpu_seconds(data / "cache-tiny")
    return {
        "big_wall": big_wall,
        "big_audio": big_audio,
        "big_bytes": big_bytes,
        "tiny_wall": tiny_wall,
        "steady": (big_audio - tiny_audio) / (big_wall - tiny_wall),
        "cpu_per_audio": cpu / (big_audio - tiny_audio),
    }


def against_bound(
    big: Path, tiny: Path, data: Path, workers: int, rounds: int
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """``rounds`` steady builds, each between two timings of the three steps alone (melcache's
    only, ~3 s each) and two in ``workers`` processes at once; per round, the build's steady
    rate over the bound (per-core rate of the three steps × ``workers``) and over the
    concurrent bound, in wall time and in CPU time. Also the component rates of the whole
    run (stock ones included), timed once at the end for 20 s."""
    per_round = []
    for _ in range(rounds):
        before = [component_rates(big, 3, stock=False), concurrent_rates(big, 3, workers)]
        build = steady_build(big, tiny, data, workers)
        after = [concurrent_rates(big, 3, workers), component_rates(big, 3, stock=False)]
        for name, rates in (("", (before[0], after[1])), ("_concurrent", (before[1], after[0]))):
            wall = statistics.mean(r["all_three_per_core"] for r in rates) * workers
            cpu = statistics.mean(r["all_three_per_core_cpu"] for r in rates)
            build[f"of_bound{name}"] = build["steady"] / wall
            build[f"of_bound{name}_cpu"] = 1 / (cpu * build["cpu_per_audio"])
        for unit in ("", "_cpu"):  # the concurrent bound over the bound alone
            build[f"concurrent{unit}"] = (
                build[f"of_bound{unit}"] / build[f"of_bound_concurrent{unit}"]
            )
        per_round.append(build)
    return per_round, component_rates(big, budget_seconds=20)


def concurrent_rates(src: Path, budget_seconds: float, workers: int) -> dict[str, float]:
    """:func:`component_rates` (melcache's steps) in ``workers`` processes at once, forked as
    the build's workers are; each rate is their mean, a per-process (per-core) figure."""
    context = multiprocessing.get_context("fork")
    with context.Pool(workers) as pool:
        jobs = [(src, budget_seconds, False)] * workers
        results = pool.starmap(component_rates, jobs, chunksize=1)
    return {key: statistics.mean(r[key] for r in results) for key in results[0]}


def resampled_copy(src: Path, out: Path, rate: int) -> Path:
    """``src`` resampled once to ``rate`` (soxr HQ, 16-bit wav) with its transcripts; reused."""
    done = out / ".complete"
    if not done.exists():
        for wav in sorted(src.rglob("*.wav")):
            target = out / wav.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            audio, source_rate = sf.read(wav, dtype="float32")
            sf.write(target, soxr.resample(audio, source_rate, rate, "HQ"), rate, "PCM_16")
            shutil.copy(wav.with_suffix(".txt"), target.with_suffix(".txt"))
        done.touch()
    return out


def naive_librosa(src: Path, budget_seconds: float) -> tuple[float, float]:
    """The loop a seed script writes: one file at a time, librosa for everything."""
    files = sorted(src.rglob("*.wav"))
    audio_seconds, started = 0.0, time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        for i, path in enumerate(files):
            y, _ = librosa.load(path, sr=24000, res_type="soxr_hq")
            mel = librosa.feature.melspectrogram(
                y=y,
                sr=24000,
                n_fft=1024,
                hop_length=256,
                n_mels=100,
                fmax=12000,
                power=1.0,
                htk=True,
                norm=None,
            )
            np.save(Path(out) / f"{i}.npy", np.log(np.maximum(mel, 1e-5)).T.astype(np.float16))
            audio_seconds += len(y) / 24000
            if time.perf_counter() - started > budget_seconds:
                break
    return time.perf_counter() - started, audio_seconds


def component_rates(src: Path, budget_seconds: float, stock: bool = True) -> dict[str, float]:
    """Real-time factors of each step alone on one core, melcache's and (with ``stock``) the
    stock ones.

    Stock is the issue's reference recipe: libsndfile's own float decode and
    ``torchaudio.transforms.MelSpectrogram`` + log. The harmonic sum of decode, resample and
    mel is the per-core bound any build of those three steps can reach here
    (``all_three_per_core``; ``all_three_per_core_cpu`` in CPU time).
    """
    torch.set_num_threads(1)
    extractor = MelExtractor(FeatureConfig())
    stock_mel = torchaudio.transforms.MelSpectrogram(
        sample_rate=24000, n_fft=1024, hop_length=256, n_mels=100, power=1.0
    )
    decoders: dict[str, Callable[..., Any]] = {"decode": read_float32}
    mels: dict[str, Callable[..., Any]] = {"mel": extractor.compute}
    if stock:
        decoders["decode_stock"] = lambda path: sf.read(path, dtype="float32", always_2d=True)
        mels["mel_stock"] = lambda audio: torch.log(
            torch.clamp(stock_mel(torch.from_numpy(audio)), min=1e-5)
        ).half()
    spent = dict.fromkeys([*decoders, "resample", *mels, *_CPU], 0.0)

    def one_file(path: Path, order: int, into: dict[str, float]) -> float:
        """Every step on one file, adding times to ``into``; the file's audio seconds."""
        for name, decode in list(decoders.items())[::order]:
            audio, rate = _timed(into, name, decode, str(path))
        audio = _timed(into, "resample", soxr.resample, audio[:, 0], rate, 24000, "HQ")
        for name, mel in list(mels.items())[::order]:
            _timed(into, name, mel, audio)
        return len(audio) / 24000  # the corpus is mono

    files = sorted(src.rglob("*.wav"))
    audio_seconds = 0.0
    with torch.inference_mode():
        one_file(files[0], 1, dict.fromkeys(spent, 0.0))  # untimed warm-up: FFT plans etc.
        started = time.perf_counter()
        for i, path in enumerate(files):
            # Ours and stock take turns to go first, so neither always meets caches the other warmed.
            audio_seconds += one_file(path, 1 if i % 2 else -1, spent)
            if time.perf_counter() - started > budget_seconds:
                break
    rates = {k: audio_seconds / v for k, v in spent.items() if k not in _CPU}
    rates["all_three_per_core"] = audio_seconds / (
        spent["decode"] + spent["resample"] + spent["mel"]
    )
    rates["all_three_per_core_cpu"] = audio_seconds / sum(spent[k] for k in _CPU)
    if stock:
        rates["all_three_stock_per_core"] = audio_seconds / (
            spent["decode_stock"] + spent["resample"] + spent["mel_stock"]
        )
    return rates


_CPU = ("decode_cpu", "resample_cpu", "mel_cpu")  # CPU seconds of melcache's three steps


def _timed(spent: dict[str, float], name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, adding its wall time to ``spent[name]`` (and its CPU time to
    ``spent[name + "_cpu"]`` if that is kept)."""
    started, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    spent[name] += time.perf_counter() - started
    if f"{name}_cpu" in spent:
        spent[f"{name}_cpu"] += time.process_time() - cpu
    return result


def _median_iqr(key: str, values: list[float]) -> dict[str, Any]:
    """The median of ``values`` under ``key``, and their interquartile range under
    ``key_iqr`` (with four values or more): the noise of the machine."""
    out: dict[str, Any] = {key: round(statistics.median(values), 3)}
    if len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4)
        out[f"{key}_iqr"] = [round(q1, 3), round(q3, 3)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--hours", type=float, default=3.0, help="size of the big corpus (default 3)"
    )
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--data", type=Path, default=Path("bench-data"), help="where corpora and caches go"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="builds timed against the bound (default 5)"
    )
    args = parser.parse_args()
    big = make_corpus(args.data / f"speech-{args.hours:g}h", args.hours)
    tiny = make_corpus(args.data / "speech-tiny", 0.02)
    per_round, components = against_bound(big, tiny, args.data, args.workers, args.rounds)
    steady = statistics.median(r["steady"] for r in per_round)
    big_wall = statistics.median(r["big_wall"] for r in per_round)
    big_audio, big_bytes = per_round[0]["big_audio"], per_round[0]["big_bytes"]
    # The same speech already at 24 kHz, as LibriTTS or Emilia ship it: no resampling step.
    native = [resampled_copy(c, Path(f"{c}-24k"), 24000) for c in (big, tiny)]
    native_steady = steady_build(*native, args.data, args.workers)["steady"]
    naive_wall, naive_audio = naive_librosa(big, budget_seconds=30)
    bound = components["all_three_per_core"] * args.workers
    naive = naive_audio / naive_wall
    rows = [
        {
            "row": "preprocess build",
            "workers": args.workers,
            "audio_hours": round(big_audio / 3600, 3),
            "wall_s": round(big_wall, 2),
            "real_time_x": round(big_audio / big_wall),
            "steady_real_time_x": round(steady),
            "startup_s": round(statistics.median(r["tiny_wall"] for r in per_round), 2),
            "wall_s_per_audio_hour": round(3600 / steady, 2),
            "cpu_s_per_audio_hour": round(
                3600 * statistics.median(r["cpu_per_audio"] for r in per_round), 2
            ),
            "cache_mb_per_audio_hour": round(big_bytes / 1e6 / (big_audio / 3600), 1),
        },
        {
            "row": "preprocess build, sources already 24 kHz",
            "workers": args.workers,
            "steady_real_time_x": round(native_steady),
        },
        {
            "row": "naive librosa loop",
            "workers": 1,
            "audio_hours": round(naive_audio / 3600, 3),
            "wall_s": round(naive_wall, 2),
            "real_time_x": round(naive),
        },
        {
            "row": "components, one core",
            **{f"{k}_real_time_x": round(v) for k, v in components.items()},
            f"bound_{args.workers}_workers_x": round(bound),
            f"stock_bound_{args.workers}_workers_x": round(
                components["all_three_stock_per_core"] * args.workers
            ),
        },
        {
            "row": "ratio",
            "build_steady_over_naive": round(steady / naive, 1),
            "rounds": args.rounds,
            **_median_iqr("build_steady_over_component_bound", [r["of_bound"] for r in per_round]),
            **_median_iqr("build_cpu_over_component_bound", [r["of_bound_cpu"] for r in per_round]),
            **_median_iqr(
                "build_steady_over_concurrent_bound", [r["of_bound_concurrent"] for r in per_round]
            ),
            **_median_iqr(
                "build_cpu_over_concurrent_bound", [r["of_bound_concurrent_cpu"] for r in per_round]
            ),
            **_median_iqr("concurrent_bound_over_bound", [r["concurrent"] for r in per_round]),
            **_median_iqr(
                "concurrent_bound_over_bound_cpu", [r["concurrent_cpu"] for r in per_round]
            ),
        },
    ]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
