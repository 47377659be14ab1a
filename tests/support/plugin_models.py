"""Plug-in models for the contract tests (``model.impl = "tests.support.plugin_models:NAME"``): each is
the reference :class:`~train.model.text_to_mel.TextToMel` with one thing a real model does differently."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from melcache.loader import Batch
from tests.support.oom_model import OutOfMemoryAbove
from train.model import EncoderDecoder, TextToMel


class WholeBatchMean(TextToMel):
    """Takes the whole batch, float32 mels padded to the longest, and returns a mean loss and
    its weight (the valid frames), as F5-TTS's CFM does over its span."""

    melcache_contract: ClassVar[dict] = {
        "inputs": "batch",
        "mel_dtype": "float32",
        "pad": "longest",
    }

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if batch.mel.dtype != torch.float32 or batch.mel.shape[1] != batch.mel_lengths.max():
            raise AssertionError(f"mel {batch.mel.dtype} {list(batch.mel.shape)}")
        if batch.text.shape[1] != batch.text_lengths.max() or len(batch.speaker) != len(batch):
            raise AssertionError("text padded past the longest, or speakers missing")
        out = super().forward(batch.mel, batch.mel_lengths, batch.text, batch.text_lengths)
        frames = batch.mel_lengths.sum().float()
        return {"loss": out["loss_sum"] / frames, "loss_weight": frames}


class CountedHalf(TextToMel):
    """Sums its loss over the first half of each utterance and says how many frames that is."""

    def forward(self, mel, mel_lengths, text, text_lengths):
        half = (mel_lengths + 1) // 2
        out = super().forward(mel, half, text, text_lengths)
        return {"loss_sum": out["loss_sum"], "loss_count": half.sum().float()}


class BadOutputs(TextToMel):
    """Returns what the trainer cannot use: ``kind`` says what."""

    def __init__(self, *, n_mels: int, kind: str, **args) -> None:
        super().__init__(n_mels=n_mels, **args)
        self.kind = kind

    def forward(self, mel, mel_lengths, text, text_lengths):
        out = super().forward(mel, mel_lengths, text, text_lengths)
        loss = out["loss_sum"]
        if self.kind == "missing":
            return {"mel_loss": loss}
        if self.kind == "per_utterance":
            return {"loss_sum": loss.expand(mel.shape[0])}
        if self.kind == "non_finite":
            return {"loss_sum": loss * float("nan")}
        if self.kind == "half":
            return {"loss_sum": loss.half()}
        return {"loss": loss}  # a mean without its weight


class UnusedHead(TextToMel):
    """A parameter its loss never touches."""

    def __init__(self, **args) -> None:
        super().__init__(**args)
        self.spare_head = nn.Linear(4, 4)


class _AllReducesInForward:
    """Mixed into a model: all-reduces a statistic in every training forward (like
    vector_quantize_pytorch's grouped residual FSQ)."""

    def __init__(self, **args) -> None:
        super().__init__(**args)
        self.stats = Statistic()

    def forward(self, mel, mel_lengths, text, text_lengths):
        self.stats(mel)
        return super().forward(mel, mel_lengths, text, text_lengths)


class ForwardAllReduce(_AllReducesInForward, TextToMel):
    """The reference model with a collective in its forward."""


class Statistic(nn.Module):
    """The submodule holding the collective, which the refusal must name."""

    def forward(self, mel: torch.Tensor) -> None:
        if self.training and dist.is_initialized():
            dist.all_reduce(mel.float().mean().detach().clone())


class MadeForChatTTS(TextToMel):
    """Declares the ChatTTS preset: every feature key, not only n_mels, rate and hop."""

    melcache_contract: ClassVar[dict] = {"features": "chattts"}


class MadeForVocosFloor(TextToMel):
    """Declares upstream Vocos's log floor (1e-7), which a ChatTTS cache (1e-5) does not have."""

    melcache_contract: ClassVar[dict] = {"features": {"log_floor": 1e-7}}


class ForwardAllReduceOutOfMemory(_AllReducesInForward, OutOfMemoryAbove):
    """:class:`ForwardAllReduce` that also runs out of memory above ``limit_frames``."""


class UnusedAfterFirstStep(TextToMel):
    """Uses ``late_head`` in its first training forward only: the first step's check passes,
    and DDP finds the parameters unused a step later."""

    def __init__(self, **args) -> None:
        super().__init__(**args)
        self.late_head = nn.Linear(1, 1)
        self.forwards = 0

    def forward(self, mel, mel_lengths, text, text_lengths):
        out = super().forward(mel, mel_lengths, text, text_lengths)
        self.forwards += 1
        if self.forwards == 1:
            out["loss_sum"] = out["loss_sum"] + 0.0 * self.late_head(mel[:1, :1, :1].float()).sum()
        return out


class LanguagePrompted(TextToMel):
    """Asks for the cache's ``language`` field and a same-speaker reference, and checks them
    row by row: a language embedding is added to the text's loss. A training pass of several
    utterances above ``limit_frames`` padded frames runs out of memory, so the trainer cuts
    batches into pieces, whose extras must still fit their rows."""

    melcache_contract: ClassVar[dict] = {"inputs": "batch", "extras": ["language", "reference"]}

    def __init__(self, *, limit_frames: int = 0, **args) -> None:
        super().__init__(**args)
        self.languages = nn.Embedding(2, 1)
        self.limit = limit_frames
        self.references_seen = 0
        self.rows_seen: list[int] = []

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:  # type: ignore[override]
        language, reference = batch.extras["language"], batch.extras["reference"]
        if len(language) != len(batch) or reference.shape != (len(batch),):
            raise AssertionError(f"extras {batch.extras} for a batch of {len(batch)}")
        for row, ref in enumerate(reference.tolist()):
            if ref != -1 and (ref == row or batch.speaker[ref] != batch.speaker[row]):
                raise AssertionError(f"row {row}'s reference {ref}: {batch.speaker}")
        frames = batch.mel.shape[0] * batch.mel.shape[1]
        if self.training and self.limit and len(batch) > 1 and frames > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (test model): > {self.limit}")
        ids = torch.tensor([lang == "zh" for lang in language], dtype=torch.int64)
        shift = self.languages(ids.to(batch.text.device)).squeeze(-1)
        out = super().forward(batch.mel, batch.mel_lengths, batch.text, batch.text_lengths)
        out["loss_sum"] = out["loss_sum"] + 0.0 * shift.sum()
        self.references_seen += int((reference >= 0).sum())
        self.rows_seen.append(len(batch))
        return out


class CodesOnly(nn.Module):
    """Reads the derived field ``codes`` alone (``"mel": False``: no mel shard is opened) and
    predicts each frame's 4 codes from the frame before and the text, as a speech-token
    language model does, with its loss summed over valid frames and codebooks."""

    melcache_contract: ClassVar[dict] = {
        "inputs": "batch",
        "fields": {"codes": {"dtype": "int16", "shape": [4]}},
        "mel": False,
    }

    def __init__(self, *, n_mels: int, vocab_size: int, dim: int = 64, **_: object) -> None:
        super().__init__()
        self.codes = nn.Embedding(626, dim)  # 0: before the first frame, 1 + code otherwise
        self.text = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.head = nn.Linear(dim, 4 * 625)

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        if batch.mel.shape[2] != 0 or not torch.equal(
            batch.field_lengths["codes"], batch.mel_lengths
        ):
            raise AssertionError(f"mel {list(batch.mel.shape)}: a fields-only batch has none")
        codes, lengths = batch.fields["codes"], batch.field_lengths["codes"]
        B, T, _ = codes.shape
        before = torch.cat([codes.new_full((B, 1, 4), -1), codes[:, :-1]], 1)
        x = self.codes(before + 1).sum(2) + self.text(batch.text).mean(1, keepdim=True)
        logits = self.head(x).view(B, T, 4, 625)
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 2), codes.flatten(), reduction="none"
        ).view(B, T, 4)
        valid = torch.arange(T, device=codes.device) < lengths[:, None]
        return {"loss_sum": loss.sum(2)[valid].sum(), "loss_count": valid.sum().float()}


class RaisesInForward(TextToMel):
    """A model whose own code fails in its forward (a user's bug)."""

    def forward(self, mel, mel_lengths, text, text_lengths):
        raise ValueError(f"cannot take a mel of {mel.shape[-1]} bands")


class ShapeRecording(EncoderDecoder):
    """The reference encoder-decoder, writing each training batch's ``[rows, padded text,
    padded frames]`` as a JSON line to ``{record}-rank{RANK}`` (torchrun's rank)."""

    def __init__(self, *, record: str, **args) -> None:
        super().__init__(**args)
        self.record = Path(f"{record}-rank{os.environ.get('RANK', '0')}")

    def forward(self, mel, mel_lengths, text, text_lengths):
        with self.record.open("a") as out:
            out.write(json.dumps([len(mel), text.shape[1], mel.shape[1]]) + "\n")
        return super().forward(mel, mel_lengths, text, text_lengths)
