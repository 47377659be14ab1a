"""The seed's baseline a benchmark measures against: a map-style Dataset that decodes,
resamples (soxr HQ) and computes the log-mel of one audio file per item, and its collate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import torch
from torch.utils.data import Dataset

from melcache.features import FeatureConfig
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
