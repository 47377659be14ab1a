"""Plug-in models for the spike tests (``model.impl = "tests.support.spike_model:SpikeAt"``).

The reference :class:`~train.model.text_to_mel.TextToMel`, except that the loss of its training forward
number ``at`` (counted in a buffer, so a resumed run counts on) is multiplied by ``factor``
on rank ``rank`` (every rank if -1): a loss spike at a known step (with one micro-batch per
step and no out-of-memory skip, forward n is step n).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar

import torch

from train.model import TextToMel


class SpikeAt(TextToMel):
    """TextToMel whose loss spikes at training forward ``at``."""

    def __init__(self, *, n_mels: int, at: int, factor: float = 100.0, rank: int = -1, **args):
        super().__init__(n_mels=n_mels, **args)
        self.at, self.factor, self.rank = at, factor, rank
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, mel, mel_lengths, text, text_lengths):
        out = super().forward(mel, mel_lengths, text, text_lengths)
        if not self.training:
            return out
        self.forwards += 1
        mine = self.rank in (-1, int(os.environ.get("RANK", "0")))
        if mine and int(self.forwards) == self.at:  # a CPU test model: reading it is free
            out["loss_sum"] = out["loss_sum"] * self.factor
        return out


class SpikeRun(TextToMel):
    """TextToMel whose loss spikes at the ``count`` training forwards from ``at`` on, counted
    in this process in a plain attribute that neither a checkpoint nor a rewind takes back:
    with one micro-batch per step, forward n of a fresh run is the loader's n-th batch, so the
    spikes belong to those batches (a replay would be new forwards, not spikes). Each forward
    appends ``{"forward": n, "keys": [...]}`` to ``keys_log/rank-R.jsonl``."""

    melcache_contract: ClassVar[dict] = {"inputs": "batch"}  # for the keys

    def __init__(self, *, n_mels: int, at: int, count: int, keys_log: str, rank: int = -1, **args):
        super().__init__(n_mels=n_mels, **args)
        self.spiking = range(at, at + count)
        self.rank, self.seen = rank, 0
        self.log = Path(keys_log) / f"rank-{os.environ.get('RANK', '0')}.jsonl"
        self.log.parent.mkdir(parents=True, exist_ok=True)

    def forward(self, batch):
        out = super().forward(batch.mel, batch.mel_lengths, batch.text, batch.text_lengths)
        if not self.training:
            return out
        self.seen += 1
        with self.log.open("a") as f:
            f.write(json.dumps({"forward": self.seen, "keys": list(batch.keys)}) + "\n")
        if self.rank in (-1, int(os.environ.get("RANK", "0"))) and self.seen in self.spiking:
            out["loss_sum"] = out["loss_sum"] * 100.0
        return out


class NoisyGradient(TextToMel):
    """TextToMel whose training loss gets a random linear term, ``noise`` × ξ·w summed over the
    output layer (ξ ~ N(0, 1) drawn per pass from the rank's own torch stream), × the pass's
    valid frames: gradient noise far above the batch, so the noise scale is large and the
    closed loop (``train.adapt.batch_adaptive``) has a reason to raise the batch."""

    def __init__(self, *, n_mels: int, noise: float, **args):
        super().__init__(n_mels=n_mels, **args)
        self.noise = noise

    def forward(self, mel, mel_lengths, text, text_lengths):
        out = super().forward(mel, mel_lengths, text, text_lengths)
        if self.training:
            weights = [p for p in self.parameters() if p.dim() == 2][-1]
            xi = torch.randn_like(weights)
            out["loss_sum"] = (
                out["loss_sum"] + self.noise * (xi * weights).sum() * mel_lengths.sum()
            )
        return out


class DivergesAt(TextToMel):
    """TextToMel whose weights turn NaN at training forward ``at``, as an optimizer step with
    a far too large learning rate leaves them: a run that diverges."""

    def __init__(self, *, n_mels: int, at: int, **args):
        super().__init__(n_mels=n_mels, **args)
        self.at, self.seen = at, 0

    def forward(self, mel, mel_lengths, text, text_lengths):
        if self.training:
            self.seen += 1
            if self.seen == self.at:
                with torch.no_grad():
                    for parameter in self.parameters():
                        parameter.fill_(float("nan"))
        return super().forward(mel, mel_lengths, text, text_lengths)
