"""ChatTTS's DVAE (``chattts`` 0.2.5: its mel encoder, grouped residual FSQ and decoder) trained
as a mel autoencoder on a melcache cache: ``[model] impl = "examples.chattts_dvae.adapter:DVAE"``
(``pip install 'melcache[chattts]'``).

What the adapter bridges (``train/model/contract.py`` for the keys):

- ChatTTS's ``DVAE.forward`` runs under ``torch.inference_mode``; the adapter runs its parts
  (``downsample_conv`` → ``encoder`` → ``vq_layer.quantizer`` → ``decoder`` → ``out_conv``) with
  gradients, the FSQ passing them straight through.
- Its mel is the ``"chattts"`` preset (every feature key checked at start); it computes in
  float32; the encoder halves the frame rate, so the padded length must be even (``[data]
  pad_multiple`` ≥ 2, 8 by default).
- ChatTTS divides the log-mel by a per-channel ``coef`` learnt with the released weights; from
  random init the adapter sets it to the cache's per-channel std (``set_mel_stats``).
- vector_quantize_pytorch's ``GroupedResidualFSQ.forward`` all-reduces a quantize-dropout seed
  in every training forward (and reads it on the host), even with that dropout off: the trainer
  refuses it at start, naming ``dvae.vq_layer.quantizer`` (``train/model/guards.py``). The adapter
  calls its residual FSQ groups itself, with the (unused) seed given, so no collective runs.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from ChatTTS.model.dvae import DVAE as ChatTTSDVAE
from torch import nn


class DVAE(nn.Module):
    """ChatTTS's DVAE at ChatTTS's sizes (``ChatTTS/config/config.py``) unless args say less."""

    melcache_contract: ClassVar[dict] = {"mel_dtype": "float32", "features": "chattts"}

    def __init__(
        self,
        *,
        n_mels: int,
        dim: int = 512,
        hidden: int = 256,
        layers: int = 12,
        bn_dim: int = 128,
        vq_dim: int = 1024,
    ) -> None:
        super().__init__()
        self.dvae = ChatTTSDVAE(
            decoder_config={
                "idim": vq_dim // 2, "odim": dim, "hidden": hidden, "n_layer": layers, "bn_dim": bn_dim,
            },
            encoder_config={
                "idim": dim, "odim": vq_dim, "hidden": hidden, "n_layer": layers, "bn_dim": bn_dim,
            },
            vq_config={"dim": vq_dim, "levels": (5, 5, 5, 5), "G": 2, "R": 2},
            dim=dim,
        )  # fmt: skip
        with torch.no_grad():
            self.dvae.coef.fill_(1.0)

    def set_mel_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """ChatTTS's per-channel divisor, from the cache's statistics instead of its weights."""
        self.dvae.coef.copy_(std.clamp_min(1e-3).view_as(self.dvae.coef))

    def forward(self, mel, mel_lengths, text, text_lengths) -> dict[str, torch.Tensor]:
        """L1 reconstruction of the log-mel, summed over valid frames (mean over channels)."""
        x = mel.transpose(1, 2)  # [B, n_mels, T]
        pred = self._reconstruct(x)
        valid = torch.arange(x.shape[2], device=x.device) < mel_lengths[:, None]
        err = (pred - x).abs().mean(1)  # [B, T]
        return {"loss_sum": torch.where(valid, err, 0.0).sum()}

    def predict_mel(self, batch) -> torch.Tensor:
        """The reconstruction ``[B, T, n_mels]`` (the trainer's validation picture)."""
        return self._reconstruct(batch.mel.transpose(1, 2)).transpose(1, 2)

    def _reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """Encode, quantize and decode ``x`` ``[B, n_mels, T]`` (T even)."""
        coef = self.dvae.coef
        h = self.dvae.encoder(self.dvae.downsample_conv(x / coef))  # [B, vq_dim, T / 2]
        quantized = self._quantize(h.transpose(1, 2))  # [B, T / 2, vq_dim]
        B, half, vq_dim = quantized.shape
        # ChatTTS's layout: each half of a code vector is one of two consecutive frames.
        feats = quantized.transpose(1, 2).reshape(B, 2, vq_dim // 2, half)
        feats = feats.permute(0, 2, 3, 1).flatten(2)  # [B, vq_dim / 2, T]
        return self.dvae.out_conv(self.dvae.decoder(x=feats)) * coef

    def _quantize(self, h: torch.Tensor) -> torch.Tensor:
        """``GroupedResidualFSQ`` without its forward's seed all-reduce (quantize dropout is off
        in ChatTTS's config, so the seed is never used)."""
        grouped = self.dvae.vq_layer.quantizer
        chunks = h.chunk(grouped.groups, dim=grouped.split_dim)
        parts = [
            rvq(c, rand_quantize_dropout_fixed_seed=0)[0]
            for rvq, c in zip(grouped.rvqs, chunks, strict=True)
        ]
        return torch.cat(parts, dim=grouped.split_dim)
