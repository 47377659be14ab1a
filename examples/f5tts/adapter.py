"""F5-TTS (``f5-tts`` 1.1.22: its own ``CFM`` flow-matching wrapper around its ``DiT``) trained on
a melcache cache: ``[model] impl = "examples.f5tts.adapter:F5TTS"`` (``pip install
'melcache[f5tts]'``).

What the adapter bridges (``train/model/contract.py`` for the keys):

- F5-TTS's mel is the vocos mel ChatTTS uses too: the cache must be built with
  ``configs/chattts.toml`` (the ``"chattts"`` feature preset, every key checked at start).
- ``CFM`` ties each mel frame to a position and crashes on frames past the longest utterance:
  ``"pad": "longest"``. It computes in float32: ``"mel_dtype": "float32"``.
- Ids: melcache pads text with 0 and counts tokens from 1; F5-TTS pads with -1 and counts from
  0 (its ``TextEmbedding`` adds 1 itself), hence ``text - 1`` and ``vocab_size - 1`` embeddings.
- ``CFM`` returns the mean loss over a random 70–100 % span that it does not return; the span
  is where its ``cond`` output is zeroed, so the adapter returns that mean with the span's
  size as its weight, and the trainer logs the true mean over all ranks.
- Validation pictures (``train.validation.every``): :meth:`F5TTS.predict_mel` runs F5-TTS's own
  inference, ``CFM.sample``, with the first 30 % of each utterance as its audio prompt and a few
  ODE steps, so ``OUT/val/step-N.png`` shows what the model makes of the rest.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from f5_tts.model import CFM, DiT
from torch import nn

from melcache.loader import Batch

PROMPT_SHARE = 0.3  # of each utterance given as the audio prompt when predicting
ODE_STEPS = 6  # F5-TTS's predefined Empirically Pruned Step Sampling for few steps
CFG_STRENGTH = 2.0  # F5-TTS's inference defaults: classifier-free guidance and sway sampling
SWAY_SAMPLING = -1.0


class F5TTS(nn.Module):
    """``CFM(DiT)`` with F5-TTS's defaults (``F5TTS_v1_Base``: 1024 × 22) unless args say less."""

    melcache_contract: ClassVar[dict] = {
        "inputs": "batch",
        "mel_dtype": "float32",
        "pad": "longest",
        "features": "chattts",
    }

    def __init__(
        self,
        *,
        n_mels: int,
        vocab_size: int,
        dim: int = 1024,
        depth: int = 22,
        heads: int = 16,
        ff_mult: int = 2,
        text_dim: int = 512,
        conv_layers: int = 4,
    ) -> None:
        super().__init__()
        dit = DiT(
            dim=dim,
            depth=depth,
            heads=heads,
            dim_head=dim // heads,
            ff_mult=ff_mult,
            mel_dim=n_mels,
            text_num_embeds=vocab_size - 1,  # F5-TTS adds its own filler id 0
            text_dim=text_dim,
            conv_layers=conv_layers,
        )
        self.cfm = CFM(transformer=dit, mel_spec_kwargs={"n_mel_channels": n_mels})

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """F5-TTS's flow-matching loss: its mean over the span and the span's size."""
        text = batch.text - 1  # melcache: 0 pads, ids from 1; F5-TTS: -1 pads, ids from 0
        loss, cond, _ = self.cfm(batch.mel, text, lens=batch.mel_lengths)
        valid = torch.arange(batch.mel.shape[1], device=cond.device) < batch.mel_lengths[:, None]
        span = (cond == 0).all(-1) & valid  # CFM zeroes the frames it trains on
        return {"loss": loss.float(), "loss_weight": span.sum().float()}

    @torch.no_grad()
    def predict_mel(self, batch: Batch) -> torch.Tensor:
        """``[B, T, n_mels]``: each utterance's first 30 % as given, the rest sampled by
        ``CFM.sample`` from the text in a few ODE steps, to the utterance's true length."""
        prompt = (batch.mel_lengths * PROMPT_SHARE).long().clamp(min=1)
        mel, _ = self.cfm.sample(
            batch.mel,
            batch.text - 1,
            batch.mel_lengths,
            lens=prompt,
            steps=ODE_STEPS,
            cfg_strength=CFG_STRENGTH,
            sway_sampling_coef=SWAY_SAMPLING,
        )
        return mel[:, : batch.mel.shape[1]]
