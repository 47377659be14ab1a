"""ChatTTS's GPT (``chattts`` 0.2.5: its ``GPT`` and ``Embed`` classes, a Llama decoder from
``transformers``) trained on text and the DVAE's codes cached beside the mels (``preprocess
derive --field codes``): ``[model] impl = "examples.chattts_gpt.adapter:GPT"``
(``pip install 'melcache[chattts]'``).

The sequence is ChatTTS's: the text's tokens, then one position per code frame whose input is
the sum of the ``num_vq`` codebooks' embeddings (``Embed.emb_code``); the hidden state before
each frame predicts its ``num_vq`` codes through ``Embed.head_code``, and the one after the
last frame predicts ChatTTS's end of audio (every codebook's ``num_audio_tokens - 1``, the
``eos_token`` its ``generate`` stops at). Teacher forcing: the loss is the cross entropy summed
over codebooks and valid frames (the end included), averaged per frame.

What the adapter bridges (``train/model/contract.py`` for the keys):

- ChatTTS builds the Llama only in ``load_pretrained`` (from released weights) and runs
  ``Embed.forward`` under ``torch.inference_mode``: the adapter makes the ``LlamaModel`` from
  ChatTTS's own config at random init and calls the embeddings and heads itself, with
  gradients.
- The model reads fields only (``"mel": False``): the loader reads no mel bytes, and buckets
  count code frames; its sequence is text then frames (``"sequence": "text+frames"``), so the
  budget, the cut and the cost count ``text + frames`` positions.
- ``vocab_size`` (ChatTTS's ``num_text_tokens``, 21178 with its tokenizer) comes from
  ``[data] tokenizer``: ``examples.chattts_gpt.tokenizer:ChatTTSTokenizer`` where ChatTTS's
  ``asset/tokenizer`` files are, bytes (257) otherwise.
- A row without text has nothing before its first frame to predict it from: its loss starts
  at the second frame.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from ChatTTS.model.embed import Embed
from ChatTTS.model.gpt import GPT as ChatTTSGPT
from torch import nn
from transformers import LlamaConfig, LlamaModel

from examples.chattts import asset
from melcache.errors import UserError

TOKENIZER_SPEC = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer"  # [data] tokenizer
FIELD = "codes"  # the field ``preprocess derive --field codes`` stores (the DVAE's encoder)


class GPT(nn.Module):
    """ChatTTS's GPT at ChatTTS's sizes (``ChatTTS/config/config.py``: hidden 768, 20 layers,
    12 heads, intermediate 3072, 626 audio tokens, 4 codebooks) unless args say less;
    ``release``: a ChatTTS release folder (or its ``asset/``) to start from, every tensor of its
    ``gpt/`` and ``Embed.safetensors`` mapped strictly (``examples/chattts/asset.py``)."""

    melcache_contract: ClassVar[dict] = {
        "inputs": "batch",
        "fields": (FIELD,),
        "mel": False,
        "sequence": "text+frames",  # text tokens then code frames: one sequence to plan on
        "home": "examples.chattts.home:write",  # python -m train export: ChatTTS's asset/
    }

    def __init__(
        self,
        *,
        vocab_size: int,
        n_mels: int | None = None,  # every model is given it; this one reads codes, not mels
        hidden: int = 768,
        layers: int = 20,
        heads: int = 12,
        intermediate: int = 3072,
        num_audio_tokens: int = 626,
        num_vq: int = 4,
        max_positions: int = 4096,
        release: str | None = None,
    ) -> None:
        super().__init__()
        self.embed = Embed(hidden, num_audio_tokens, vocab_size, num_vq)
        # head_text serves ChatTTS's refine-text mode (text → text), which the code loss does
        # not train: frozen, so DDP and the trainer's check find no parameter without a gradient.
        self.embed.head_text.requires_grad_(False)
        config = chattts_config(
            vocab_size, hidden, layers, heads, intermediate, num_audio_tokens, num_vq, max_positions
        )
        self.chattts = ChatTTSGPT(config, self.embed)
        # What ChatTTS's load_pretrained does with its released folder, at random init.
        self.chattts.gpt = LlamaModel(llama_config(config, release))
        del self.chattts.gpt.embed_tokens  # ChatTTS embeds with Embed, not Llama's table
        if release is not None:
            self._load_release(asset.asset_folder(release))
        self.num_vq, self.end_of_audio = num_vq, num_audio_tokens - 1

    def _load_release(self, folder: Path) -> None:
        """Every tensor of the release's ``Embed.safetensors`` and ``gpt/model.safetensors``
        (but the Llama's ``embed_tokens``, which ChatTTS deletes too), strictly."""
        embed = asset.read_tensors(folder / asset.EMBED)
        rows = embed.get("emb_text.weight", torch.empty(0)).shape[:1]
        if rows and rows[0] != self.embed.emb_text.num_embeddings:
            raise UserError(
                f"{folder / asset.EMBED}: its text embedding holds {rows[0]} tokens, [data] tokenizer "
                f"gives {self.embed.emb_text.num_embeddings}: train with the release's tokenizer "
                f'([data] tokenizer = "{TOKENIZER_SPEC}", vocab = "{folder / asset.TOKENIZER}")'
            )
        asset.load_strict(self.embed, embed, folder / asset.EMBED)
        llama_file = folder / asset.GPT / "model.safetensors"
        asset.load_strict(
            self.chattts.gpt, asset.read_tensors(llama_file), llama_file, ["embed_tokens.weight"]
        )

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        """Cross entropy of every code of every valid frame (and the end), summed; counted
        per frame."""
        codes, n_codes = batch.fields[FIELD], batch.field_lengths[FIELD]
        if codes.shape[-1] != self.num_vq:
            raise ValueError(f"field {FIELD!r} has {codes.shape[-1]} codebooks, GPT {self.num_vq}")
        hidden = self._decode(batch.text, batch.text_lengths, codes, n_codes)
        targets, valid, before = self._targets(codes, n_codes, batch.text_lengths, hidden.shape[1])
        predicting = hidden.gather(1, before[..., None].expand(-1, -1, hidden.shape[-1]))
        loss = torch.zeros((), device=hidden.device)
        for book, head in enumerate(self.embed.head_code):
            logits = head(predicting).float()  # [B, frames + 1, num_audio_tokens]
            per_code = F.cross_entropy(logits.transpose(1, 2), targets[..., book], reduction="none")
            loss = loss + torch.where(valid, per_code, 0.0).sum()
        return {"loss_sum": loss, "loss_count": valid.sum()}

    def _decode(
        self, text: torch.Tensor, n_text: torch.Tensor, codes: torch.Tensor, n_codes: torch.Tensor
    ) -> torch.Tensor:
        """The Llama's last hidden states ``[B, S, hidden]`` over text then code frames, right
        padded (``S`` the longest row's text + frames)."""
        S = max(int((n_text + n_codes).max()), 1)
        position = torch.arange(S, device=text.device)[None]
        is_text = position < n_text[:, None]
        token = text.gather(1, position.clamp(max=max(text.shape[1] - 1, 0)).expand(len(text), -1))
        frame = (position - n_text[:, None]).clamp(0, max(codes.shape[1] - 1, 0))
        frame_codes = codes.gather(1, frame[..., None].expand(-1, -1, codes.shape[2]))
        text_in = self.embed.emb_text(token)
        codes_in = sum(emb(frame_codes[..., i]) for i, emb in enumerate(self.embed.emb_code))
        inputs = torch.where(is_text[..., None], text_in, codes_in)
        mask = (position < (n_text + n_codes)[:, None]).long()
        return self.chattts.gpt(inputs_embeds=inputs, attention_mask=mask).last_hidden_state

    def _targets(
        self, codes: torch.Tensor, n_codes: torch.Tensor, n_text: torch.Tensor, S: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For frames ``0 .. T`` (``T`` = the longest row's, the last one the end of audio):
        the codes to predict ``[B, T + 1, num_vq]``, which are valid ``[B, T + 1]``, and the
        position (of ``S``) whose hidden state predicts each ``[B, T + 1]``."""
        T = codes.shape[1]
        frame = torch.arange(T + 1, device=codes.device)[None]
        padded = F.pad(codes, (0, 0, 0, 1), value=self.end_of_audio)
        targets = torch.where((frame < n_codes[:, None])[..., None], padded, self.end_of_audio)
        valid = (frame <= n_codes[:, None]) & ((frame > 0) | (n_text[:, None] > 0))
        before = (n_text[:, None] - 1 + frame).clamp(0, S - 1)  # past a row's end: not valid
        return targets, valid, before


def chattts_config(
    vocab_size: int,
    hidden: int = 768,
    layers: int = 20,
    heads: int = 12,
    intermediate: int = 3072,
    num_audio_tokens: int = 626,
    num_vq: int = 4,
    max_positions: int = 4096,
) -> dict[str, Any]:
    """ChatTTS's ``Config.gpt`` at these sizes (what its ``GPT`` builds its Llama config from,
    and what ``Chat`` must be given to load an export of them)."""
    return {
        "hidden_size": hidden, "intermediate_size": intermediate,
        "num_attention_heads": heads, "num_hidden_layers": layers, "use_cache": False,
        "max_position_embeddings": max_positions, "num_audio_tokens": num_audio_tokens,
        "num_text_tokens": vocab_size, "num_vq": num_vq,
    }  # fmt: skip


def llama_config(config: dict[str, Any], release: str | None = None) -> LlamaConfig:
    """The Llama's config for ChatTTS GPT ``config``: the one ChatTTS's ``GPT`` builds, or a
    release's own ``gpt/config.json`` (its rope and norm settings too), refused in one line
    where it sizes the Llama otherwise than ``config``."""
    if release is None:
        return LlamaConfig(**config)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
    sizes = {k: config[k] for k in keys}
    return LlamaConfig.from_dict(asset.check_llama_sizes(asset.asset_folder(release), sizes))
