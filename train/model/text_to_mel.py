"""The reference text→mel model, and the contract any model plugged into the trainer honours.

Model contract (``[model] impl = "package.module:Class"``); what a model may declare instead
(the whole batch, a mean loss and its weight, float32 mels, no padding past the longest, the
features it needs) is in ``train/model/contract.py``:

- **Construction**: ``Class(n_mels=<int>, **args)`` with ``args`` from ``[model.args]``, and
  ``vocab_size`` when the constructor takes it (``train/model/tokenizers.py``).
- **forward(mel, mel_lengths, text, text_lengths) -> dict[str, Tensor]**, in training mode:
  ``mel`` float16 ``[B, T, n_mels]`` log-mel, padded past ``mel_lengths`` (int64 ``[B]``)
  with unspecified values; ``text`` int64 ``[B, L]`` token ids with 0 as padding (the
  default tokenizer: UTF-8 byte ``b`` is ``b + 1``, vocabulary 257) and ``text_lengths``. It returns
  ``"loss_sum"``: a float32 scalar, the **sum** of the per-frame loss over valid frames
  (``t < mel_lengths[b]``). The trainer divides by the global number of valid frames of the
  optimizer step, so every frame weighs the same whatever the batching. Other ``"<name>_sum"``
  scalars, summed the same way, are logged as ``<name>``.
- Every parameter gets a gradient from ``loss_sum`` on every batch (checked at the first
  step; ``train.parallel.find_unused_parameters = true`` otherwise), valid frames never depend on padding.
- Buffers are broadcast from rank 0 once, when DDP wraps the model, not before every forward
  (no collective inside a forward: refused at the first step, ``train/model/guards.py``): buffers a model changes in training,
  such as BatchNorm's running statistics, stay per rank, and rank 0's are checkpointed.
- Optional ``set_mel_stats(mean, std)`` (float32 ``[n_mels]``), called once on a fresh start
  with the cache's per-channel statistics; optional ``set_activation_checkpointing(bool)``.

The reference :class:`TextToMel` is a prefix-LM transformer: byte embeddings of the text,
then the mel frames shifted right by one (teacher forcing), in one sequence. Text positions
attend to all text; mel positions attend to all text and causally to earlier frames. It
predicts each frame (masked L1 or L2 on normalised log-mel) and a stop logit (weighted BCE).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from melcache.errors import UserError
from melcache.loader.batch import BYTE_VOCAB_SIZE  # UTF-8 bytes + 1; id 0 is padding
from train.config.tables import ModelConfig
from train.model.contract import construct


def build_model(cfg: ModelConfig, vocab_size: int = BYTE_VOCAB_SIZE) -> nn.Module:
    """Import ``cfg.impl`` and construct it (``vocab_size`` too, if it takes one); errors name
    the config key."""
    module_name, _, class_name = cfg.impl.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"config key model.impl = {cfg.impl!r} cannot be imported: {exc}") from None
    args = {"n_mels": cfg.n_mels, **cfg.args}
    _refuse_beyond_memory(cls, cfg.impl, args, vocab_size)
    try:
        return construct(cls, cfg.impl, args, vocab_size)
    except RuntimeError as exc:  # the allocator, for parameters the estimate could not see
        raise UserError(
            f"{cfg.impl} with [model.args] cannot be built: {_first_line(exc)}"
        ) from None


def _refuse_beyond_memory(cls: type, impl: str, args: dict, vocab_size: int) -> None:
    """Refuse a model whose parameters alone exceed this machine's available memory, from
    the shapes of a copy built on the meta device (no memory), before allocating them:
    allocating would end in the out-of-memory killer, not an error."""
    try:
        with torch.device("meta"):
            shapes = construct(cls, impl, args, vocab_size)
    except (RuntimeError, NotImplementedError):
        return  # a model that cannot be built on meta: its own allocation errors tell
    needed = sum(t.numel() * t.element_size() for t in (*shapes.parameters(), *shapes.buffers()))
    available = _available_memory()
    if available is not None and needed > available:
        raise UserError(
            f"{impl} with [model.args] {dict(args)} has {needed / 2**30:.1f} GiB of "
            f"parameters, more than the {available / 2**30:.1f} GiB of memory available here"
        )


def _available_memory() -> int | None:
    """Bytes of memory the kernel says can be allocated without swapping, where it says."""
    with contextlib.suppress(OSError, ValueError, IndexError):  # not Linux: no estimate
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def sinusoid(length: int, dim: int, device: torch.device) -> torch.Tensor:
    """``[length, dim]`` sine/cosine positions (Vaswani et al.), any length without a table."""
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device) * (-math.log(10_000.0) / dim))
    out = torch.zeros(length, dim, device=device)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)
    return out


def prefix_mask(
    text_lengths: torch.Tensor, mel_lengths: torch.Tensor, L: int, T: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive attention mask ``[B, 1, L+T, L+T]``: 0 where allowed, -inf elsewhere.

    Text queries see the valid text; mel query ``t`` sees the valid text and mel ``≤ t``.
    Every row keeps its diagonal so no row is all-masked (that would give NaN softmax). A
    float mask is built once per forward and reused by every layer: on CPU it is about twice
    as fast in SDPA as a boolean one.
    """
    device = text_lengths.device
    idx = torch.arange(L + T, device=device)
    is_text = idx < L
    key_valid = torch.where(
        is_text, idx < text_lengths[:, None], (idx - L) < mel_lengths[:, None]
    )  # [B, S]
    causal = is_text[None, :] | (~is_text[:, None] & (idx[None, :] <= idx[:, None]))  # [S, S]
    allowed = (key_valid[:, None, :] & causal[None]) | torch.eye(
        L + T, dtype=torch.bool, device=device
    )
    return additive(allowed, dtype)[:, None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean ``allowed`` as an additive attention mask: 0 where allowed, -inf elsewhere."""
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=allowed.device), float("-inf"))


def mask_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for ``x``: under autocast the autocast dtype, which the
    mask must match."""
    device_type = x.device.type
    amp = torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if amp else x.dtype


class Block(nn.Module):
    """Pre-norm transformer block: attention with an explicit mask, then a GELU MLP.

    Dropout acts on the residual branches only: dropout on the attention weights costs
    more than the whole attention on CPU and stops fused kernels on GPU.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, D // self.heads).unbind(2)
        p = self.dropout if self.training else 0.0
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + F.dropout(self.proj(attn.transpose(1, 2).reshape(B, S, D)), p, self.training)
        return x + F.dropout(self.mlp(self.norm2(x)), p, self.training)


class TextToMel(nn.Module):
    """Autoregressive text→mel prefix-LM transformer (see the module docstring)."""

    def __init__(
        self,
        *,
        n_mels: int,
        vocab_size: int = BYTE_VOCAB_SIZE,
        dim: int = 256,
        layers: int = 6,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.1,
        prenet_dropout: float = 0.5,
        loss: str = "l1",
        stop_weight: float = 1.0,
        stop_pos_weight: float = 8.0,
    ) -> None:
        super().__init__()
        if heads < 1 or dim < 2 or layers < 0:
            raise UserError(
                f"model.args: dim = {dim}, heads = {heads}, layers = {layers} are invalid: "
                "expected dim ≥ 2, heads ≥ 1 and layers ≥ 0"
            )
        if dim % heads or dim % 2:
            raise UserError(f"model.args.dim = {dim} must be even and divisible by heads ({heads})")
        if loss not in ("l1", "l2"):
            raise UserError(f'model.args.loss = {loss!r} is invalid: expected "l1" or "l2"')
        self.n_mels, self.dim, self.loss = n_mels, dim, loss
        self.prenet_dropout, self.stop_weight = prenet_dropout, stop_weight
        self.checkpointing = False
        self.text_embed = nn.Embedding(vocab_size, dim)
        self.segment = nn.Parameter(torch.randn(2, dim) * 0.02)  # text / mel
        # Tacotron's prenet: a bottleneck with dropout kept on, so the decoder must
        # use the text instead of copying the previous frame.
        self.prenet = nn.Sequential(nn.Linear(n_mels, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.block_shape = (dim, heads, mlp_ratio, dropout)  # of every Block
        self.blocks = nn.ModuleList(Block(*self.block_shape) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.mel_head, self.stop_head = nn.Linear(dim, n_mels), nn.Linear(dim, 1)
        self.register_buffer("mel_mean", torch.zeros(n_mels))
        self.register_buffer("mel_std", torch.ones(n_mels))
        self.register_buffer("stop_pos_weight", torch.tensor(stop_pos_weight))

    def set_mel_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Normalise frames by the cache's per-channel statistics (saved with the weights)."""
        self.mel_mean.copy_(mean)
        self.mel_std.copy_(std.clamp_min(1e-3))

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block in the backward pass instead of storing its activations."""
        self.checkpointing = enabled

    def _decode(
        self,
        mel_in: torch.Tensor,
        text: torch.Tensor,
        text_lengths: torch.Tensor,
        mel_lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states of the mel positions ``[B, T, dim]`` for normalised inputs."""
        L, T = text.shape[1], mel_in.shape[1]
        x = torch.cat([self._text_input(text), self._frames_input(mel_in)], dim=1)
        mask = prefix_mask(text_lengths, mel_lengths, L, T, mask_dtype(x))
        for block in self.blocks:
            x = self._run_block(block, x, mask)
        return self.norm(x[:, L:])

    def _text_input(self, text: torch.Tensor) -> torch.Tensor:
        """Token embeddings with positions ``[B, L, dim]``."""
        positions = sinusoid(text.shape[1], self.dim, text.device)
        return self.text_embed(text) + positions + self.segment[0]

    def _frames_input(self, mel_in: torch.Tensor) -> torch.Tensor:
        """The prenet of the shifted frames with positions ``[B, T, dim]``."""
        prenet = F.dropout(self.prenet(mel_in), self.prenet_dropout, self.training)
        return prenet + sinusoid(mel_in.shape[1], self.dim, mel_in.device) + self.segment[1]

    def _run_block(self, block: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        """``block(*args)``, recomputed in the backward pass under activation checkpointing."""
        if self.checkpointing and self.training:
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def forward(
        self,
        mel: torch.Tensor,
        mel_lengths: torch.Tensor,
        text: torch.Tensor,
        text_lengths: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Teacher-forced losses summed over valid frames (see the module docstring)."""
        T = mel.shape[1]
        valid = torch.arange(T, device=mel.device)[None, :] < mel_lengths[:, None]  # [B, T]
        target, h = self._teacher_forced(mel, mel_lengths, text, text_lengths, valid)
        pred = self.mel_head(h).float()
        err = (pred - target).abs() if self.loss == "l1" else (pred - target).square()
        mel_sum = torch.where(valid, err.mean(-1), 0.0).sum()
        is_last = torch.arange(T, device=mel.device)[None, :] == (mel_lengths - 1)[:, None]
        stop = F.binary_cross_entropy_with_logits(
            self.stop_head(h).squeeze(-1).float(),
            is_last.float(),
            pos_weight=self.stop_pos_weight,
            reduction="none",
        )
        stop_sum = torch.where(valid, stop, 0.0).sum()
        return {
            "loss_sum": mel_sum + self.stop_weight * stop_sum,
            "mel_loss_sum": mel_sum.detach(),
            "stop_loss_sum": stop_sum.detach(),
        }

    def _teacher_forced(
        self,
        mel: torch.Tensor,
        mel_lengths: torch.Tensor,
        text: torch.Tensor,
        text_lengths: torch.Tensor,
        valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised target ``[B, T, n_mels]`` and the hidden states predicting it."""
        # Padding holds unspecified values: zero it so that NaN or inf there cannot leak
        # through a 0-weight attention product.
        target = torch.where(valid[..., None], (mel.float() - self.mel_mean) / self.mel_std, 0.0)
        mel_in = F.pad(target[:, :-1], (0, 0, 1, 0))  # frame t is predicted from frames < t
        return target, self._decode(mel_in, text, text_lengths, mel_lengths)

    def predict_mel(self, batch: Any) -> torch.Tensor:
        """Teacher-forced log-mel predictions ``[B, T, n_mels]`` (the validation picture)."""
        T = batch.mel.shape[1]
        valid = torch.arange(T, device=batch.mel.device)[None, :] < batch.mel_lengths[:, None]
        args = (batch.mel, batch.mel_lengths, batch.text, batch.text_lengths, valid)
        _, h = self._teacher_forced(*args)
        return self.mel_head(h).float() * self.mel_std + self.mel_mean

    @torch.no_grad()
    def generate(
        self, text: torch.Tensor, max_frames: int = 2_000, threshold: float = 0.5
    ) -> torch.Tensor:
        """Greedy synthesis of one utterance: ``text`` int64 ``[L]`` → log-mel ``[frames, n_mels]``.

        Recomputes the whole prefix each frame (no key/value cache): a reference, not a
        fast sampler.
        """
        was_training = self.training
        self.eval()
        text, L = text[None], torch.tensor([text.numel()], device=text.device)
        frames = torch.zeros(1, 1, self.n_mels, device=text.device)
        for _ in range(max_frames):
            lengths = torch.tensor([frames.shape[1]], device=text.device)
            h = self._decode(frames, text, L, lengths)[:, -1]
            frames = torch.cat([frames, self.mel_head(h)[:, None].float()], dim=1)
            if torch.sigmoid(self.stop_head(h)).item() > threshold:
                break
        self.train(was_training)
        return frames[0, 1:] * self.mel_std + self.mel_mean

    def extra_repr(self) -> str:
        params = sum(p.numel() for p in self.parameters())
        return f"params={params:,}, loss={self.loss}"


def describe(model: nn.Module) -> dict[str, Any]:
    """Parameter count and class, for the start-up log."""
    return {
        "class": f"{type(model).__module__}:{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
    }
