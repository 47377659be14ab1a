"""Caches that several benchmarks build and read: the committed sample corpus's, and one of
synthetic speech made once and reused; and a timed build."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.speech import make_corpus

REPO = Path(__file__).resolve().parents[2]


def build_sample_cache(folder: Path, config: Path | None = None) -> str:
    """The committed sample corpus built into ``folder`` (with the build ``config`` if given)."""
    cmd = [sys.executable, "-m", "preprocess", "build", "--src", str(REPO / "examples" / "wavs")]
    cmd += ["--out", str(folder), "--workers", "1"]
    cmd += ["--config", str(config)] if config else []
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return str(folder)


def speech_cache(corpus: Path, cache: Path, hours: float) -> Path:
    """``hours`` of speech (``benchmarks.common.speech``, seed 0) in ``corpus``, built into
    ``cache``: both made once and reused; a cache an earlier release built (no ``xxh3_128``
    digests in its index) is built again."""
    make_corpus(corpus, hours, seed=0)
    index = cache / "index.json"
    if index.exists() and "xxh3_128" not in json.loads(index.read_text())["shards"][0]:
        shutil.rmtree(cache)
    if not index.exists():
        command = [sys.executable, "-m", "preprocess", "build", "--src", str(corpus)]
        subprocess.run([*command, "--out", str(cache)], check=True, stdout=subprocess.DEVNULL)
    return cache


def timed_build(src: Path, out: Path, workers: int, *extra: str) -> tuple[float, float, int]:
    """Wall seconds of a fresh ``preprocess build`` (given ``extra`` arguments), the audio
    seconds and shard bytes it wrote (its CPU seconds: :func:`build_cpu_seconds`)."""
    shutil.rmtree(out, ignore_errors=True)
    cpu = _children_cpu()
    started = time.perf_counter()
    command = [sys.executable, "-m", "preprocess", "build", "--src", str(src), "--out", str(out)]
    command += ["--workers", str(workers), *extra]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    _last_cpu[out] = _children_cpu() - cpu
    index = json.loads((out / "index.json").read_text())
    return wall, index["totals"]["seconds"], sum(s["bytes"] for s in index["shards"])


_last_cpu: dict[Path, float] = {}  # by --out: CPU seconds of the last build timed there


def build_cpu_seconds(out: Path) -> float:
    """CPU seconds, user and system, of every process of the last build :func:`timed_build`
    timed into ``out``."""
    return _last_cpu[out]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children, theirs too
    return usage.ru_utime + usage.ru_stime
