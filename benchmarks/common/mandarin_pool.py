"""A pool of Mandarin clips synthesised by espeak-ng (voice ``cmn``) with their own texts, for
drawn corpora that mix Mandarin and English (``benchmarks/common/drawn_corpus.py --mandarin``).

Text per second of speech differs by language: a Mandarin character is one token of a
BERT-Chinese-like tokenizer (ChatTTS's) and three UTF-8 bytes, English words come at other
rates. A model whose sequence is text plus speech tokens (docs/loader.md, "One sequence")
pads by that difference, so its benchmarks need both.
"""

from __future__ import annotations

import json
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common.speech import MARKER, SAMPLE_RATE, Line, Speaker, espeak_path, synth_espeak

SPEAKERS = tuple(
    Speaker(f"zh_{n}", voice, speed, pitch, f0)
    for n, (voice, speed, pitch, f0) in enumerate(
        [("cmn", 150, 45, 110.0), ("cmn+f3", 160, 60, 210.0), ("cmn+m3", 140, 40, 100.0),
         ("cmn+f4", 170, 55, 190.0), ("cmn+m1", 175, 50, 125.0), ("cmn+f2", 145, 65, 230.0)]
    )
)  # fmt: skip
CLIPS_PER_SPEAKER = 40
_SUBJECTS = [
    "我",
    "你",
    "他",
    "她",
    "我们",
    "老师",
    "学生",
    "医生",
    "朋友",
    "孩子",
    "农民",
    "司机",
    "画家",
    "邻居",
]
_VERBS = [
    "看见",
    "找到",
    "打开",
    "修理",
    "喜欢",
    "买了",
    "带着",
    "画了",
    "记得",
    "参观",
    "发现",
    "打扫",
    "送给",
    "等待",
]
_OBJECTS = [
    "一本旧书",
    "那座小桥",
    "一扇窗户",
    "这封长信",
    "一个篮子",
    "那台机器",
    "一张车票",
    "一盏灯笼",
    "那片森林",
    "一条河流",
    "一辆自行车",
    "那座高山",
    "一瓶牛奶",
    "一把椅子",
    "几朵红花",
    "那家小商店",
]
_ADVERBS = [
    "今天",
    "昨天",
    "慢慢地",
    "安静地",
    "终于",
    "每天早上",
    "又一次",
    "在路上",
    "在公园里",
    "下午",
]
_JOINERS = ["，然后", "，但是", "，因为", "，所以", "，而且"]


def sentence(rng: np.random.Generator, clauses: int) -> str:
    """``clauses`` clauses of subject, adverb, verb and object, joined, with a full stop."""

    def pick(words: list[str]) -> str:
        return words[int(rng.integers(len(words)))]

    parts = [pick(_SUBJECTS) + pick(_ADVERBS) + pick(_VERBS) + pick(_OBJECTS)]
    for _ in range(clauses - 1):
        parts.append(pick(_JOINERS) + pick(_SUBJECTS) + pick(_VERBS) + pick(_OBJECTS))
    return "".join(parts) + "。"


def make_mandarin_pool(out: Path, seed: int = 0) -> Path:
    """Write (or reuse) ``out/<speaker>/<n>.wav`` + ``.txt``: :data:`CLIPS_PER_SPEAKER`
    sentences of 1–4 clauses per speaker, at 22,050 Hz like ``benchmarks.common.speech``'s pool."""
    marker = {"mandarin_pool": CLIPS_PER_SPEAKER, "seed": seed}
    if (out / MARKER).exists() and json.loads((out / MARKER).read_text()) == marker:
        return out
    exe = espeak_path()
    if exe is None:
        raise FileNotFoundError("espeak-ng not found on PATH (the Mandarin pool needs it)")
    rng = np.random.default_rng([seed, 52])
    jobs = []
    for speaker in SPEAKERS:
        (out / speaker.name).mkdir(parents=True, exist_ok=True)
        for n in range(CLIPS_PER_SPEAKER):
            text = sentence(rng, int(rng.integers(1, 5)))
            jobs.append((out / speaker.name / f"{n:03d}.wav", Line(speaker, text, speaker.speed)))

    def write(job: tuple[Path, Line]) -> None:
        path, line = job
        audio = np.clip(synth_espeak(line, exe) * 32767, -32768, 32767).astype("<i2")
        with wave.open(str(path), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(SAMPLE_RATE)
            f.writeframes(audio.tobytes())
        path.with_suffix(".txt").write_text(line.text + "\n", encoding="utf-8")

    with ThreadPoolExecutor(max_workers=2) as executor:
        list(executor.map(write, jobs))
    (out / MARKER).write_text(json.dumps(marker))
    return out
