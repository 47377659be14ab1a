"""Generate a speech corpus of a requested size for melcache benchmarks.

The corpus looks like a small multi-speaker TTS data set::

    DIR/<speaker>/<stem>.wav   22,050 Hz mono 16-bit PCM
    DIR/<speaker>/<stem>.txt   the transcript, one UTF-8 line
    DIR/.corpus.json           marker written last: parameters, count, total duration

Audio comes from espeak-ng when it is on ``PATH``. One espeak-ng process per utterance costs
about 25 ms of CPU (half of it start-up), i.e. about a minute of CPU for the ~2,300 utterances
of a 3-hour corpus. So only a pool of 240 distinct sentences (~0.37 h) is synthesised, in
parallel. If the pool alone reaches the requested size it *is* the corpus; otherwise the
remaining utterances are assembled with numpy/soxr from the same speaker's pool clips: one to
four clips joined with short pauses, re-timed by a random factor of 0.9-1.1, with a random gain
and a low noise floor. That is still real (synthetic) speech with exact transcripts, about five
times cheaper; every file differs at the byte level, and durations follow a TTS-like
distribution (0.5 s to 15 s, most between 2 s and 8 s).

Without espeak-ng the pool is made of speech-like audio instead (a harmonic source with a
moving pitch contour, vowel-like formant weighting, syllable envelopes, pauses and noise), so
the benchmarks still run; a note says so.

Everything is derived from ``seed``: the same hours and seed give the same files (with the
same espeak-ng, numpy and soxr versions); a smaller corpus is a prefix of a larger one. Generation
is idempotent: a directory whose marker shows at least the requested hours made with the same
seed is returned untouched.

Usage::

    python -m benchmarks.common.speech --out /tmp/corpus --hours 3 [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import wave
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import soxr

from benchmarks.common.sentences import (
    MAX_SECONDS,
    SPEAKERS,
    Line,
    Speaker,
    pick,
    plan_pool,
    sample_duration,
)

__all__ = ["MARKER", "SAMPLE_RATE", "Backend", "main", "make_corpus"]

Backend = Literal["auto", "espeak-ng", "synthetic"]

SAMPLE_RATE = 22_050  # espeak-ng's native output rate; keeping it avoids a resampling pass.
MARKER = ".corpus.json"
# Bump when the generated content changes, so that stale corpora are regenerated.
FORMAT_VERSION = 1
# --- synthesis ----------------------------------------------------------------------------------


def espeak_path() -> str | None:
    """Return the espeak-ng executable on ``PATH``, or ``None``."""
    return shutil.which("espeak-ng")


def synth_espeak(line: Line, exe: str = "espeak-ng") -> np.ndarray:
    """Synthesise ``line`` with espeak-ng; return float32 samples at :data:`SAMPLE_RATE`."""
    cmd = [exe, "-v", line.speaker.voice, "-s", str(line.speed), "-p", str(line.speaker.pitch)]
    # --stdout skips a temporary file; the header's sizes are placeholders, so find "data".
    wav = subprocess.run([*cmd, "--stdout", line.text], capture_output=True, check=True).stdout
    rate = int.from_bytes(wav[24:28], "little")
    if wav[:4] != b"RIFF" or rate != SAMPLE_RATE:
        raise RuntimeError(f"unexpected espeak-ng output (rate {rate}) for {line.text!r}")
    start = wav.index(b"data", 12) + 8
    end = start + (len(wav) - start) // 2 * 2
    return np.frombuffer(wav[start:end], dtype="<i2").astype(np.float32) / 32768.0


# (F1, F2, F3) in Hz of a few vowels, for the fallback's formant weighting.
_VOWELS = np.array(
    [[730, 1090, 2440], [270, 2290, 3010], [530, 1840, 2480], [570, 840, 2410], [300, 870, 2240]],
    dtype=np.float32,
)


def synth_fallback(line: Line, seed: int) -> np.ndarray:
    """Synthesise speech-like audio for ``line`` without espeak-ng.

    The result is not intelligible, but it has what a mel front end cares about: a voiced
    harmonic spectrum with a moving pitch, formant structure changing per syllable, syllable
    envelopes, pauses between words and phrases, fricative noise bursts and a noise floor.
    """
    rng = np.random.default_rng(seed)
    sr = SAMPLE_RATE
    # Lay out syllables word by word; punctuation gets a longer pause.
    segments: list[tuple[int, int]] = []  # (start, length) of each syllable, in samples
    t = int(0.15 * sr)
    for word in line.text.split():
        for _ in range(1 + len(word) // 4):
            n = int(rng.uniform(0.09, 0.22) * sr * 160 / line.speed)
            segments.append((t, n))
            t += n
        t += int((0.3 if word[-1] in ",.?" else rng.uniform(0.02, 0.08)) * sr)
    n_total = t + int(0.15 * sr)

    # Pitch: speaker f0 with slow random movement and declination over the sentence.
    time_s = np.arange(n_total) / sr
    wobble = np.sin(2 * np.pi * rng.uniform(0.5, 1.5) * time_s + rng.uniform(0, 2 * np.pi))
    f0 = line.speaker.f0 * (1 + 0.12 * wobble) * np.linspace(1.1, 0.85, n_total)
    phase = (2 * np.pi / sr * np.cumsum(f0)) % (2 * np.pi)  # float64 cumsum, then wrap

    # Harmonic amplitudes change slowly, so compute them on a 5 ms frame grid: formant
    # tracks (one vowel per syllable, interpolated between syllable centres) weight each
    # harmonic by its distance to F1-F3, with a -3 dB/octave source tilt.
    hop = 110
    frames = np.arange(0, n_total + hop, hop)
    centres = np.array([s + n // 2 for s, n in segments])
    vowels = _VOWELS[rng.integers(len(_VOWELS), size=len(segments))]
    harmonics = np.arange(1, int(3800 / f0.max()) + 1)[:, None]
    freqs = harmonics * f0[np.minimum(frames, n_total - 1)]  # (harmonic, frame)
    weights = np.full(freqs.shape, 0.05)
    for j, bandwidth in enumerate((80.0, 120.0, 160.0)):
        track = np.interp(frames, centres, vowels[:, j])
        weights += np.exp(-(((freqs - track) / bandwidth) ** 2))
    weights = (weights / np.sqrt(harmonics)).astype(np.float32)

    # sin(k*phase) by the Chebyshev recurrence: two multiply-adds per harmonic and sample
    # instead of a sin() call, which made this fallback several times slower.
    sin_prev = np.zeros(n_total, dtype=np.float32)
    sin_k = np.sin(phase).astype(np.float32)
    two_cos = (2 * np.cos(phase)).astype(np.float32)
    voiced = np.zeros(n_total, dtype=np.float32)
    for row in weights:
        voiced += np.repeat(row, hop)[:n_total] * sin_k
        sin_prev, sin_k = sin_k, two_cos * sin_k - sin_prev

    envelope = np.zeros(n_total, dtype=np.float32)
    noise = rng.standard_normal(n_total).astype(np.float32)
    fricative = np.zeros(n_total, dtype=np.float32)
    for start, n in segments:
        envelope[start : start + n] = np.hanning(n)
        if rng.random() < 0.3:  # a consonant-like burst of high-passed noise before the vowel
            m = min(n // 3, start)
            fricative[start - m : start] = np.hanning(m) * 0.3
    hiss = np.diff(noise, prepend=0.0) * fricative
    audio = voiced * envelope + hiss + 0.003 * noise
    return (0.5 * audio / np.abs(audio).max()).astype(np.float32)


# --- corpus assembly ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Derived:
    """A corpus utterance assembled from pool clips of one speaker."""

    path: Path
    clips: tuple[int, ...]  # pool indices
    pauses: tuple[int, ...]  # samples of silence after each clip but the last
    tempo: float  # > 1 speeds up (and raises pitch), < 1 slows down
    gain: float  # linear
    noise_offset: int  # where this utterance's noise floor starts in the shared noise table
    noise_level: float  # linear, relative to full scale

    def length(self, lengths: Sequence[int]) -> int:
        """Output length in samples (soxr rounds the resampled length to nearest)."""
        n = sum(lengths[i] for i in self.clips) + sum(self.pauses)
        return round(n / self.tempo)


def _plan_derived(
    rng: np.random.Generator,
    own: Sequence[int],
    lengths: Sequence[int],
    path: Path,
) -> _Derived:
    """Choose clips from ``own`` (one speaker's pool indices), pauses and re-timing.

    The output duration follows :func:`sample_duration`; clips are added while they fit.
    """
    tempo = float(rng.uniform(0.9, 1.1))
    target = sample_duration(rng) * tempo * SAMPLE_RATE  # in input (pre-re-timing) samples
    limit = MAX_SECONDS * tempo * SAMPLE_RATE
    clips: list[int] = []
    pauses: list[int] = []
    used = 0
    while len(clips) < 4:
        pause = round(rng.uniform(0.1, 0.5) * SAMPLE_RATE) if clips else 0
        room = min(target - used + 0.3 * SAMPLE_RATE, limit - used) - pause
        fits = [i for i in own if lengths[i] <= room]
        if not fits:
            break
        # Prefer clips that fill at least half the gap, so utterances don't become long
        # chains of one-word clips.
        big = [i for i in fits if lengths[i] >= (target - used - pause) / 2]
        choice = pick(rng, big or fits)
        if clips:
            pauses.append(pause)
        clips.append(choice)
        used += pause + lengths[choice]
        if used > target - 0.5 * SAMPLE_RATE:
            break
    if not clips:  # target shorter than every clip of this speaker: take the shortest
        clips.append(min(own, key=lambda i: lengths[i]))
    return _Derived(
        path=path,
        clips=tuple(clips),
        pauses=tuple(pauses),
        tempo=tempo,
        gain=float(10 ** (rng.uniform(-6.0, 0.0) / 20)),
        noise_offset=int(rng.integers(_NOISE_SAMPLES)),
        noise_level=float(10 ** (rng.uniform(-75.0, -55.0) / 20)),
    )


# A shared table of white noise; each utterance reads it from its own offset. Drawing fresh
# Gaussian noise per file cost more than the rest of the assembly put together.
_NOISE_SAMPLES = 1 << 20


def _render(d: _Derived, audio: Sequence[np.ndarray], noise: np.ndarray) -> np.ndarray:
    parts: list[np.ndarray] = []
    for k, i in enumerate(d.clips):
        if k:
            parts.append(np.zeros(d.pauses[k - 1], dtype=np.float32))
        parts.append(audio[i])
    x = np.concatenate(parts)
    # Re-time by resampling (speed and pitch change together, like tape speed); a +-10 %
    # change still sounds natural. This is the costliest step, and soxr's "quick" cubic
    # quality is over twice as fast as "HQ" with no difference that matters for a mel front
    # end (the little aliasing it allows sits above 9 kHz).
    y = soxr.resample(x, SAMPLE_RATE * d.tempo, SAMPLE_RATE, quality="QQ")
    y *= np.float32(d.gain)
    if len(y) <= len(noise):
        start = d.noise_offset % (len(noise) - len(y) + 1)
        floor = noise[start : start + len(y)]
    else:  # longer than the table (not expected below 47 s): repeat it
        floor = np.resize(noise, len(y))
    y += np.float32(d.noise_level) * floor
    return y


def _write(path: Path, audio: np.ndarray, text: str) -> int:
    """Write 16-bit PCM ``path`` and its transcript; return the number of samples."""
    scaled = audio * np.float32(32768)  # a new array: pool clips are reused, keep them intact
    np.clip(scaled, -32768, 32767, out=scaled)
    pcm = np.rint(scaled, out=scaled).astype("<i2")
    # The stdlib writer is about twice as fast as libsndfile for plain PCM16 WAV, which
    # matters with thousands of small files.
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.setnframes(len(pcm))  # header right the first time: no seek back to patch it
        f.writeframes(pcm.tobytes())
    path.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
    return len(pcm)


def _read_marker(out: Path) -> dict | None:
    try:
        return json.loads((out / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _reusable(out: Path, hours: float, seed: int, backend: str, allow_espeak: bool) -> bool:
    marker = _read_marker(out)
    if not marker or marker.get("version") != FORMAT_VERSION or marker.get("seed") != seed:
        return False
    # An espeak-ng corpus is always acceptable in auto mode; a synthetic one only when
    # espeak-ng is still unavailable (otherwise upgrade it to real speech).
    made_with = marker.get("backend")
    if made_with != backend and not (allow_espeak and made_with == "espeak-ng"):
        return False
    if float(marker.get("hours", -1)) < hours:
        return False
    # Guard against a partly deleted corpus: the marker is only as good as the files.
    return sum(1 for _ in out.glob("*/*.wav")) == marker.get("count")


def _wav_path(out: Path, speaker: Speaker, index: int) -> Path:
    return out / speaker.name / f"{speaker.name}_{index:06d}.wav"


def _write_pool(
    executor: ThreadPoolExecutor,
    pool: Sequence[Line],
    synth: Callable[[int], np.ndarray],
    out: Path,
    target: int,
) -> tuple[list[np.ndarray], int]:
    """Synthesise the pool in parallel and write it as-is, in order, until ``target`` samples.

    A small corpus is thus just a prefix of the pool. Returns the clips written and their
    total length in samples.
    """
    futures = [executor.submit(synth, i) for i in range(len(pool))]
    audio: list[np.ndarray] = []
    total = 0
    for line, future in zip(pool, futures, strict=True):
        clip = future.result()
        total += _write(_wav_path(out, line.speaker, len(audio)), clip, line.text)
        audio.append(clip)
        if total >= target:
            for pending in futures:
                pending.cancel()  # a no-op for those already running or done
            break
    return audio, total


def _plan_rest(
    rng: np.random.Generator,
    pool: Sequence[Line],
    lengths: Sequence[int],
    out: Path,
    missing: int,
) -> list[_Derived]:
    """Plan derived utterances until they add up to ``missing`` samples.

    Planning is sequential and cheap, so the corpus is deterministic whatever the thread
    scheduling; only rendering and writing run in parallel.
    """
    own = {
        speaker: [i for i, line in enumerate(pool) if line.speaker == speaker]
        for speaker in SPEAKERS
    }
    plans: list[_Derived] = []
    planned = 0
    while planned < missing:
        speaker = pick(rng, SPEAKERS)
        path = _wav_path(out, speaker, len(lengths) + len(plans))
        plans.append(_plan_derived(rng, own[speaker], lengths, path))
        planned += plans[-1].length(lengths)
    return plans


def make_corpus(out: Path, hours: float, seed: int = 0, *, backend: Backend = "auto") -> Path:
    """Create (or reuse) a speech corpus of at least ``hours`` hours in ``out``.

    Writes ``out/<speaker>/<stem>.wav`` (22,050 Hz mono PCM16) with ``<stem>.txt`` transcripts
    beside them, then ``out/.corpus.json``. If the marker shows a corpus of at least ``hours``
    made with the same ``seed`` (and generator version), returns at once without touching it;
    otherwise the speaker folders are regenerated (other files in ``out`` are left alone).

    Args:
        out: Target directory; created if missing.
        hours: Minimum total audio duration, in hours.
        seed: Seed for every random choice; the same seed and hours give identical files.
        backend: ``"espeak-ng"`` or ``"synthetic"`` to force one; ``"auto"`` uses espeak-ng
            when it is on ``PATH`` and otherwise falls back to synthetic speech-like audio,
            printing a note to stderr.

    Returns:
        ``out``, as a :class:`~pathlib.Path`.
    """
    out = Path(out)
    if hours <= 0:
        raise ValueError(f"hours must be positive, got {hours}")
    exe = espeak_path()
    if backend == "espeak-ng" and exe is None:
        raise FileNotFoundError("espeak-ng not found on PATH")
    resolved = "espeak-ng" if backend != "synthetic" and exe else "synthetic"
    if _reusable(out, hours, seed, resolved, allow_espeak=backend == "auto"):
        return out
    if backend == "auto" and exe is None:
        print(
            "note: espeak-ng not found on PATH; generating synthetic speech-like audio instead",
            file=sys.stderr,
        )

    (out / MARKER).unlink(missing_ok=True)  # an interrupted run must not look complete
    for speaker in SPEAKERS:
        shutil.rmtree(out / speaker.name, ignore_errors=True)
        (out / speaker.name).mkdir(parents=True)

    target = round(hours * 3600 * SAMPLE_RATE)  # in samples, to keep the sums exact
    pool = plan_pool(seed)
    fallback_seeds = np.random.default_rng([seed, 2]).integers(2**63, size=len(pool))

    def synth(i: int) -> np.ndarray:
        if resolved == "espeak-ng":
            return synth_espeak(pool[i], exe or "espeak-ng")
        return synth_fallback(pool[i], int(fallback_seeds[i]))

    # espeak-ng runs in child processes and numpy/soxr release the GIL, so threads scale
    # across cores without pickling audio between processes.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as executor:
        audio, total = _write_pool(executor, pool, synth, out, target)
        count = len(audio)
        if total < target:
            rng = np.random.default_rng([seed, 3])
            plans = _plan_rest(rng, pool, [len(a) for a in audio], out, target - total)
            noise = rng.standard_normal(_NOISE_SAMPLES, dtype=np.float32)

            def render(plan: _Derived) -> int:
                text = " ".join(pool[i].text for i in plan.clips)
                return _write(plan.path, _render(plan, audio, noise), text)

            total += sum(executor.map(render, plans))
            count += len(plans)

    marker = {
        "version": FORMAT_VERSION,
        "hours": hours,
        "seed": seed,
        "count": count,
        "seconds": round(total / SAMPLE_RATE, 3),
        "backend": resolved,
        "sample_rate": SAMPLE_RATE,
    }
    tmp = out / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / MARKER)  # atomic: the marker appears only once every file is written
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m benchmarks.common.speech --out DIR --hours H``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.common.speech", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="corpus directory")
    parser.add_argument("--hours", type=float, required=True, help="minimum total duration")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--backend",
        choices=["auto", "espeak-ng", "synthetic"],
        default="auto",
        help="audio source (default: espeak-ng if on PATH, else synthetic)",
    )
    args = parser.parse_args(argv)

    start = time.perf_counter()
    make_corpus(args.out, args.hours, args.seed, backend=args.backend)
    elapsed = time.perf_counter() - start
    marker = _read_marker(args.out) or {}
    print(
        f"{args.out}: {marker.get('count')} utterances, "
        f"{marker.get('seconds', 0) / 3600:.2f} h ({marker.get('backend')}), "
        f"ready in {elapsed:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
