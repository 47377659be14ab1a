"""The reference encoder-decoder text→mel model, whose text and frames are two axes.

:class:`EncoderDecoder` is the reference :class:`~train.model.text_to_mel.TextToMel` with
its one sequence split in two, as Transformer-TTS (Li et al., 2019) and the encoder-decoder
TTS models are: a transformer **encoder** over the text's tokens (padding masked as keys),
and a causal **decoder** over the mel frames shifted right by one (teacher forcing) that
cross-attends to the encoder's output. Everything else is the reference's, reused: the text
embedding, the prenet, the blocks, the heads, the loss (masked L1 or L2 on normalised
log-mel, summed over valid frames, and a stop logit), ``set_mel_stats``, activation
checkpointing, the validation picture and greedy ``generate``; its ``[model.args]`` are the
reference's, plus ``encoder_layers`` (default: ``layers``, the depths
``melcache/loader/sequence.py``'s cost cut assumes).

It declares ``"sequence": "text,frames"`` (``train/model/contract.py``): the loader pads
and budgets text and frames each on its own axis (``data.batch_text`` beside
``data.batch_frames``; docs/loader.md "One sequence") and ``python -m train tune`` writes a
table for each. Train it with any preset by naming it:
``--config tiny model.impl="train.model:EncoderDecoder"``.

Valid frames never depend on padding: the encoder's valid tokens attend to valid tokens
only, the decoder's cross-attention reads valid tokens only, its self-attention is causal,
and padded frames are zeroed before they are read.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from melcache.errors import UserError
from train.model.text_to_mel import Block, TextToMel, additive, mask_dtype


class CrossAttention(nn.Module):
    """Pre-norm attention of the frames (queries) to the encoded text (keys and values),
    added to the residual; dropout on the residual branch, as in :class:`Block`."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm = nn.LayerNorm(dim)
        self.q, self.kv, self.proj = (
            nn.Linear(dim, dim),
            nn.Linear(dim, 2 * dim),
            nn.Linear(dim, dim),
        )

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q = self.q(self.norm(x)).view(B, T, self.heads, D // self.heads).transpose(1, 2)
        k, v = self.kv(memory).view(B, -1, 2, self.heads, D // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        out = self.proj(attn.transpose(1, 2).reshape(B, T, D))
        return x + F.dropout(out, self.dropout if self.training else 0.0, self.training)


class DecoderBlock(nn.Module):
    """Cross-attention to the text, then the reference's :class:`Block` (causal
    self-attention over the frames and the MLP)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.cross = CrossAttention(dim, heads, dropout)
        self.block = Block(dim, heads, mlp_ratio, dropout)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, cross_mask: torch.Tensor, causal: torch.Tensor
    ) -> torch.Tensor:
        return self.block(self.cross(x, memory, cross_mask), causal)


class EncoderDecoder(TextToMel):
    """Text encoder and causal mel decoder with cross-attention (see the module docstring)."""

    melcache_contract: ClassVar[dict[str, Any]] = {"sequence": "text,frames"}

    def __init__(self, *, layers: int = 6, encoder_layers: int | None = None, **reference: Any):
        """``layers`` decoder blocks and ``encoder_layers`` (default ``layers``) encoder
        blocks; ``reference``: :class:`TextToMel`'s other arguments (``n_mels``, the width,
        heads, dropout, loss, stop weights)."""
        super().__init__(layers=0, **reference)
        depth = layers if encoder_layers is None else encoder_layers
        if min(layers, depth) < 0:
            raise UserError(
                f"model.args: layers = {layers}, encoder_layers = {depth}: expected ≥ 0"
            )
        self.encoder = nn.ModuleList(Block(*self.block_shape) for _ in range(depth))
        self.text_norm = nn.LayerNorm(self.dim)
        self.blocks = nn.ModuleList(DecoderBlock(*self.block_shape) for _ in range(layers))

    def encode(self, text: torch.Tensor, text_lengths: torch.Tensor) -> torch.Tensor:
        """The encoded text ``[B, L, dim]`` (rows past ``text_lengths`` hold padding's)."""
        x = self._text_input(text)
        L = text.shape[1]
        keys = torch.arange(L, device=text.device)
        valid = keys[None, :] < text_lengths[:, None]  # [B, L]
        # Each query keeps its own position, so a padded row is never all masked (NaN).
        allowed = valid[:, None, :] | torch.eye(L, dtype=torch.bool, device=text.device)
        mask = additive(allowed, mask_dtype(x))[:, None]
        for block in self.encoder:
            x = self._run_block(block, x, mask)
        return self.text_norm(x)

    def _decode(
        self,
        mel_in: torch.Tensor,
        text: torch.Tensor,
        text_lengths: torch.Tensor,
        mel_lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states of the frames ``[B, T, dim]``: frame ``t`` reads the valid text and
        frames ``≤ t`` (which are valid whenever ``t`` is, so ``mel_lengths`` needs no mask)."""
        memory = self.encode(text, text_lengths)
        x = self._frames_input(mel_in)
        T, L, dtype = x.shape[1], text.shape[1], mask_dtype(x)
        frames = torch.arange(T, device=x.device)
        causal = additive(frames[None, :] <= frames[:, None], dtype)
        # A text of no tokens still gives the cross-attention one key (its first position)
        # rather than none, which would make a NaN softmax.
        reads = torch.arange(L, device=x.device)[None, :] < text_lengths.clamp_min(1)[:, None]
        cross = additive(reads, dtype)[:, None, None]  # [B, 1, 1, L]
        for block in self.blocks:
            x = self._run_block(block, x, memory, cross, causal)
        return self.norm(x)
