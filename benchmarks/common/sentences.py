"""What the benchmark corpus says, and who says it: its speakers (espeak-ng voices) and a
seeded pool of English sentences with read-speech durations (``benchmarks.common.speech``
synthesises them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

POOL_SIZE = 240  # distinct synthesised sentences, 40 per speaker.
MIN_SECONDS, MAX_SECONDS = 0.5, 15.0


@dataclass(frozen=True)
class Speaker:
    """One corpus speaker: an espeak-ng voice and its settings (f0 is for the fallback)."""

    name: str
    voice: str
    speed: int  # espeak-ng words per minute
    pitch: int  # espeak-ng pitch, 0..99
    f0: float  # base fundamental frequency in Hz for the synthetic fallback


SPEAKERS: tuple[Speaker, ...] = (
    Speaker("en_us_m1", "en-us", 165, 45, 110.0),
    Speaker("en_us_f1", "en-us+f3", 160, 60, 210.0),
    Speaker("en_gb_m1", "en-gb", 155, 40, 100.0),
    Speaker("en_gb_f1", "en-gb+f4", 170, 55, 190.0),
    Speaker("en_m3", "en+m3", 175, 50, 125.0),
    Speaker("en_f2", "en-us+f2", 150, 65, 230.0),
)


@dataclass(frozen=True)
class Line:
    """A sentence to synthesise for the pool."""

    speaker: Speaker
    text: str
    speed: int


# --- sentences --------------------------------------------------------------------------------

_SHORT = (
    "Yes.", "No.", "Okay.", "Thank you.", "Hello.", "Of course.", "Good morning.", "Not yet.",
    "Really?", "Wait.", "Please.", "Goodbye.", "Well done.", "I see.", "Come in.", "Why not?",
)  # fmt: skip
_NAMES = (
    "Anna", "Oliver", "Maria", "James", "Sofia", "Daniel", "Grace", "Thomas", "Lucy", "Samuel",
    "Emma", "Henry", "Clara", "Peter", "Alice", "Victor",
)  # fmt: skip
_PRONOUNS = ("she", "he", "they", "we", "I", "you")
_ADJECTIVES = (
    "old", "quiet", "bright", "small", "heavy", "cold", "green", "narrow", "gentle", "broken",
    "golden", "empty", "distant", "careful", "wooden", "strange", "silver", "tired", "warm",
    "busy", "ancient", "little", "dark", "famous", "yellow", "patient", "clever", "soft",
)  # fmt: skip
_NOUNS = (
    "river", "garden", "window", "teacher", "letter", "basket", "engine", "island", "market",
    "candle", "bridge", "doctor", "kitchen", "mountain", "painter", "ticket", "forest", "station",
    "village", "farmer", "bottle", "lantern", "harbour", "blanket", "camera", "pencil", "castle",
    "ladder", "jacket", "meadow", "mirror", "orchard", "rabbit", "sailor", "tower", "wagon",
)  # fmt: skip
_VERBS = (
    "carried", "painted", "found", "opened", "watched", "repaired", "followed", "borrowed",
    "cleaned", "visited", "noticed", "described", "remembered", "sold", "moved", "measured",
    "crossed", "photographed", "discovered", "counted", "polished", "packed", "guarded", "built",
)  # fmt: skip
_ADVERBS = (
    "slowly", "quietly", "again", "yesterday", "carefully", "at last", "before dawn", "every day",
    "once more", "this morning", "in silence", "without a word",
)  # fmt: skip
_PREPOSITIONS = ("near", "behind", "under", "beside", "across", "inside", "beyond", "toward")
_NUMBERS = ("two", "three", "seven", "twelve", "forty", "a hundred", "12", "25", "1984")
_JOINERS = (", and", ", but", " while", " because", " so", " after", " before", " until")


_T = TypeVar("_T")


def pick(rng: np.random.Generator, items: Sequence[_T]) -> _T:
    return items[int(rng.integers(len(items)))]


def _noun_phrase(rng: np.random.Generator) -> str:
    roll = rng.random()
    if roll < 0.12:
        return f"{pick(rng, _NUMBERS)} {pick(rng, _NOUNS)}s"
    if roll < 0.55:
        return f"the {pick(rng, _ADJECTIVES)} {pick(rng, _NOUNS)}"
    return f"the {pick(rng, _NOUNS)}"


def _clause(rng: np.random.Generator) -> str:
    roll = rng.random()
    if roll < 0.3:
        subject = pick(rng, _NAMES)
    elif roll < 0.55:
        subject = pick(rng, _PRONOUNS)
    else:
        subject = _noun_phrase(rng)
    words = [subject, pick(rng, _VERBS), _noun_phrase(rng)]
    if rng.random() < 0.45:
        words.append(f"{pick(rng, _PREPOSITIONS)} {_noun_phrase(rng)}")
    if rng.random() < 0.3:
        words.append(pick(rng, _ADVERBS))
    return " ".join(words)


def make_sentence(rng: np.random.Generator, n_words: int) -> str:
    """Return a grammatical-looking English sentence of roughly ``n_words`` words."""
    if n_words <= 2:
        return pick(rng, _SHORT)
    text = _clause(rng)
    count = len(text.split())
    # Clauses are 3-12 words: add them while below the target, but draw again (a few times)
    # when one would overshoot by more than 3 words, so long sentences stay under ~15 s.
    for _ in range(100):
        if count >= n_words - 2:
            break
        clause = f"{pick(rng, _JOINERS)} {_clause(rng)}"
        if count + len(clause.split()) <= n_words + 3:
            text += clause
            count += len(clause.split())
    text = text[0].upper() + text[1:]
    return text + ("?" if rng.random() < 0.1 else ".")


def sample_duration(rng: np.random.Generator) -> float:
    """Draw an utterance duration (s) shaped like a read-speech TTS corpus."""
    if rng.random() < 0.06:  # one- or two-word lines
        return float(rng.uniform(MIN_SECONDS, 1.5))
    # Log-normal around 4.5 s: about 80 % fall between 2 s and 8 s, a few reach 15 s.
    return float(np.clip(rng.lognormal(math.log(4.5), 0.5), MIN_SECONDS, MAX_SECONDS))


def _words_for(seconds: float, speed: int) -> int:
    # Calibrated on espeak-ng 1.51: duration ~ 0.85 * words * 60 / wpm + 0.3 s of silence.
    return max(1, round((seconds - 0.3) * speed / 60.0 / 0.85))


def plan_pool(seed: int, size: int = POOL_SIZE) -> list[Line]:
    """Return the deterministic list of pool sentences for ``seed`` (speakers interleaved)."""
    rng = np.random.default_rng([seed, 1])
    lines = []
    for i in range(size):
        speaker = SPEAKERS[i % len(SPEAKERS)]
        speed = int(np.clip(speaker.speed + rng.integers(-15, 16), 130, 210))
        text = make_sentence(rng, _words_for(sample_duration(rng), speed))
        lines.append(Line(speaker, text, speed))
    return lines
