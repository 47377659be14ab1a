"""Each utterance's estimated signal-to-noise ratio in dB, derived from its cached log-mel.

    python -m preprocess derive CACHE --field snr --encoder examples.quality_score.encoder:encoder

then, at load time and without a rebuild, ``[data] where = "snr >= 15"`` or ``[data.balance]
weight = "2 if snr >= 25 else 1"``. It is one number per utterance (``per_utterance=True``,
``shape=()``), so derive also writes the field's ``values.npy``, which the loader reads before
any shard is.

The estimate is the percentile method of simple SNR estimators (no model, no weights): a
frame's power is the sum over mel bins of the magnitude squared (the cache stores ``ln`` of
the magnitude), the quietest frames (10th percentile) stand for the noise floor and the
loudest (95th) for speech over it. It needs no GPU and is about a thousand times faster than
the mel it reads; a learned score (DNSMOS, UTMOS) plugs in the same way, as its own encoder.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from melcache.fields.format import FieldEncoder

NOISE_QUANTILE, SPEECH_QUANTILE = 0.10, 0.95
DB_PER_NEPER = 10 / math.log(10)  # 10·log10(e^x) = x · 10 / ln 10


class SnrEstimate(torch.nn.Module):
    """``[B, T, n_mels]`` log-mel magnitudes (every row a whole utterance: derive batches
    equal lengths, unpadded) to ``[B]`` estimated SNRs in dB."""

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        power = torch.logsumexp(2 * mel.float(), dim=-1)  # ln Σ_bins magnitude², [B, T]
        levels = torch.quantile(power, torch.tensor([NOISE_QUANTILE, SPEECH_QUANTILE]), dim=1)
        return (levels[1] - levels[0]) * DB_PER_NEPER


def encoder(checkpoint: str | None = None, device: str = "cpu", **_: Any) -> FieldEncoder:
    """The SNR estimate as ``preprocess derive --encoder`` loads it (it has no checkpoint)."""
    return FieldEncoder(
        module=SnrEstimate().to(device),
        config={"impl": "percentile SNR", "quantiles": [NOISE_QUANTILE, SPEECH_QUANTILE]},
        dtype="float32",
        shape=(),
        per_utterance=True,
    )
