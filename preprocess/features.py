"""The log-mel extractor, built from torchaudio transforms so it can run on a GPU too."""

from __future__ import annotations

import numpy as np
import torch
import torchaudio

from preprocess.config import FeatureConfig
from preprocess.format import MEL_DTYPE


class MelExtractor(torch.nn.Module):
    """Mono waveform ``[samples]`` at ``cfg.sample_rate`` → log-mel ``[frames, n_mels]``."""

    def __init__(self, cfg: FeatureConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # power=1 is |X|; a magnitude epsilon (HiFi-GAN's sqrt(re²+im²+1e-9)) needs |X|².
        self.spectrogram = torchaudio.transforms.Spectrogram(
            n_fft=cfg.n_fft,
            win_length=cfg.win_length,
            hop_length=cfg.hop_length,
            power=2.0 if cfg.magnitude_eps > 0 else 1.0,
            center=cfg.center,
            pad_mode="reflect",
        )
        self.mel_scale = torchaudio.transforms.MelScale(
            n_mels=cfg.n_mels,
            sample_rate=cfg.sample_rate,
            f_min=cfg.f_min,
            f_max=cfg.f_max,
            n_stft=cfg.n_fft // 2 + 1,
            norm=None if cfg.mel_norm == "none" else cfg.mel_norm,
            mel_scale=cfg.mel_scale,
        )

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """Float32 log-mel ``[frames, n_mels]`` of a 1-D waveform tensor."""
        cfg = self.cfg
        if not cfg.center:
            side = (cfg.n_fft - cfg.hop_length) // 2
            audio = torch.nn.functional.pad(audio[None, None], (side, side), mode="reflect")[0, 0]
        magnitude = self.spectrogram(audio)
        if cfg.magnitude_eps > 0:
            magnitude = torch.sqrt(magnitude + cfg.magnitude_eps)
        mel = self.mel_scale(magnitude)
        return torch.log(torch.clamp(mel, min=cfg.log_floor)).T

    @torch.inference_mode()
    def compute(self, audio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return the float16 mel to store and its float32 original (for statistics)."""
        mel = self(torch.from_numpy(audio)).numpy()
        return mel.astype(MEL_DTYPE), mel
