"""Hostile ``--encoder`` factories for ``preprocess derive`` (tests/preprocess/test_derive.py)."""

from __future__ import annotations

from typing import Any

import torch

from melcache.fields.format import FieldEncoder


class _Constant(torch.nn.Module):
    """A float field of one value per mel frame: ``value`` at frame ``at`` on, 0 before."""

    def __init__(self, value: float, at: int) -> None:
        super().__init__()
        self.value, self.at = value, at

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(mel.shape[0], mel.shape[1], 1)
        out[:, self.at :] = self.value
        return out


def _field(value: float, at: int = 3) -> FieldEncoder:
    return FieldEncoder(module=_Constant(value, at), config={"value": str(value)},
                        dtype="float16", shape=(1,))  # fmt: skip


def nan_encoder(checkpoint: str | None = None, device: str = "cpu", **_: Any) -> FieldEncoder:
    """A float16 field holding NaN from its fourth frame on."""
    return _field(float("nan"))


def huge_encoder(checkpoint: str | None = None, device: str = "cpu", **_: Any) -> FieldEncoder:
    """A float16 field of finite float32 values beyond float16's range (infinity once stored)."""
    return _field(1e6)


class _Failing(torch.nn.Module):
    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom inside encoder")


def failing_encoder(checkpoint: str | None = None, device: str = "cpu", **_: Any) -> FieldEncoder:
    """An encoder whose forward raises."""
    return FieldEncoder(module=_Failing(), config={}, dtype="int16", shape=(1,))


class _Seconds(torch.nn.Module):
    """Each utterance's length in mel frames / 100: one number per utterance."""

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return torch.full((mel.shape[0],), mel.shape[1] / 100)


def seconds_score(checkpoint: str | None = None, device: str = "cpu", **_: Any) -> FieldEncoder:
    """A per-utterance score other than the SNR example's: a field derived again with another
    provenance (tests/melcache/loader/test_where_scores.py)."""
    return FieldEncoder(module=_Seconds(), config={"score": "frames / 100"}, dtype="float32",
                        shape=(), per_utterance=True)  # fmt: skip


def frame_ones(checkpoint: str | None = None, device: str = "cpu", **_: Any) -> FieldEncoder:
    """A field of one value per frame, which data.where cannot select on."""
    return _field(1.0, at=0)
