"""A plug-in model for the out-of-memory tests (``model.impl = "tests.support.oom_model:OutOfMemoryAbove"``).

The reference :class:`~train.model.text_to_mel.TextToMel`, except that in training, on rank ``rank`` (every
rank if -1), a pass whose ``B × T`` padded frames exceed ``limit_frames`` raises
``torch.OutOfMemoryError`` as a GPU would: in the forward, or (``stage = "backward"``) in the
backward. Each training forward of that rank is appended to ``record`` (a JSON line: rows,
padded frames, the longest utterance, whether it raised), so a test can replay the run.
"""

from __future__ import annotations

import json
import os

import torch

from train.model import TextToMel


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, message: str) -> torch.Tensor:
        ctx.message = message
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise torch.OutOfMemoryError(ctx.message)


class OutOfMemoryAbove(TextToMel):
    """TextToMel that runs out of memory above ``limit_frames`` padded frames per pass."""

    def __init__(
        self,
        *,
        n_mels: int,
        limit_frames: int,
        rank: int = -1,
        stage: str = "forward",
        record: str = "",
        **args,
    ) -> None:
        super().__init__(n_mels=n_mels, **args)
        self.limit, self.rank, self.stage, self.record = limit_frames, rank, stage, record

    def forward(self, mel, mel_lengths, text, text_lengths):
        rank = int(os.environ.get("RANK", "0"))
        size = mel.shape[0] * mel.shape[1]
        mine = self.training and self.rank in (-1, rank)
        fails = mine and size > self.limit
        if mine and self.record:
            line = {"rank": rank, "rows": mel.shape[0], "frames": mel.shape[1]}
            line.update(longest=int(mel_lengths.max()), raised=fails)
            with open(self.record, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        message = f"CUDA out of memory (test model): {size} padded frames > {self.limit}"
        if fails and self.stage == "forward":
            raise torch.OutOfMemoryError(message)
        out = super().forward(mel, mel_lengths, text, text_lengths)
        if fails:
            out["loss_sum"] = _RaiseInBackward.apply(out["loss_sum"], message)
        return out
