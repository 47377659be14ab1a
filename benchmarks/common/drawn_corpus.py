"""A corpus of real audio at a drawn cache's durations, for what a drawn table cannot measure:
the loader's samples/s and its workers' memory on a real-sized built cache.

``benchmarks/common/synthetic_cache.py`` draws each utterance's length (0.8–32 s, log-normal around
3.75 s). Here each drawn utterance becomes a WAV file joined from one speaker's clips of
``benchmarks.common.speech``'s pool (espeak-ng where it is on ``PATH``), 0.2 s apart and cut to its
length, with the clips' texts (cut in proportion) as its transcript. The pool is synthesised
once (~0.4 h); the rest is numpy, so 50 h take minutes, not the hours espeak-ng would.

Usage::

    python -m benchmarks.common.drawn_corpus --out /tmp/drawn50 --hours 50
"""

from __future__ import annotations

import argparse
import json
import os
import wave
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common.mandarin_pool import make_mandarin_pool
from benchmarks.common.speech import MARKER, SAMPLE_RATE, make_corpus
from benchmarks.common.synthetic_cache import draw_seconds

GAP_SECONDS = 0.2
POOL_HOURS = 0.4  # the whole pool (240 sentences) of benchmarks.common.speech


def read_pool(pool: Path) -> dict[str, list[tuple[np.ndarray, str]]]:
    """Each speaker's clips (int16 samples) and transcripts."""
    clips: dict[str, list[tuple[np.ndarray, str]]] = {}
    for path in sorted(pool.glob("*/*.wav")):
        with wave.open(str(path), "rb") as f:
            audio = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
        text = path.with_suffix(".txt").read_text(encoding="utf-8").strip()
        clips.setdefault(path.parent.name, []).append((audio, text))
    return clips


def joined(
    clips: Sequence[tuple[np.ndarray, str]], seconds: float, rng: np.random.Generator
) -> tuple[np.ndarray, str]:
    """Random clips of one speaker joined until ``seconds``, cut there, and their text."""
    want, gap = round(seconds * SAMPLE_RATE), np.zeros(round(GAP_SECONDS * SAMPLE_RATE), "<i2")
    parts, texts, length = [], [], 0
    while length < want:
        audio, text = clips[int(rng.integers(len(clips)))]
        parts += [audio, gap]
        texts.append(text)
        length += len(audio) + len(gap)
    text = " ".join(texts)
    return np.concatenate(parts)[:want], text[: max(1, round(len(text) * want / length))]


def make_drawn_corpus(out: Path, hours: float, seed: int = 0, mandarin: bool = False) -> Path:
    """Write (or reuse) ``out/<speaker>/<n>.wav`` + ``.txt`` at the drawn durations;
    ``mandarin``: half the speakers speak Mandarin (``benchmarks/common/mandarin_pool.py``)."""
    marker = {"drawn_hours": hours, "seed": seed, **({"mandarin": True} if mandarin else {})}
    if (out / MARKER).exists() and json.loads((out / MARKER).read_text()) == marker:
        return out
    clips = read_pool(make_corpus(out.parent / f"{out.name}-pool", POOL_HOURS, seed))
    if mandarin:
        clips |= read_pool(make_mandarin_pool(out.parent / f"{out.name}-pool-zh", seed))
    speakers = sorted(clips)
    seconds = draw_seconds(hours, seed)

    def write(number: int) -> None:
        rng = np.random.default_rng([seed, 40, number])
        speaker = speakers[number % len(speakers)]
        audio, text = joined(clips[speaker], float(seconds[number]), rng)
        path = out / speaker / f"{speaker}_{number:07d}.wav"
        with wave.open(str(path), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(SAMPLE_RATE)
            f.writeframes(audio.tobytes())
        path.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")

    for speaker in speakers:
        (out / speaker).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as executor:
        list(executor.map(write, range(len(seconds))))
    (out / MARKER).write_text(json.dumps(marker))  # last: a cut-off run is redone
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hours", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mandarin", action="store_true", help="half the speakers speak Mandarin")
    args = p.parse_args(argv)
    print(make_drawn_corpus(args.out, args.hours, args.seed, args.mandarin))


if __name__ == "__main__":
    main()
