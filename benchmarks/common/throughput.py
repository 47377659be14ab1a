"""What a loader yields in a while: batches consumed and counted, samples, frames and padding."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch


def consume(
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]], samples: int = 0, seconds: float = 0.0
) -> dict:
    """Consume batches (mel, mel_lengths) until ``samples`` samples and ``seconds`` seconds
    are both reached; return the counts and the wall time."""
    count = frames = padded = 0
    started = time.perf_counter()
    while count < samples or time.perf_counter() - started < seconds:
        mel, lengths = next(batches)
        count += len(lengths)
        frames += int(lengths.sum())
        padded += mel.shape[0] * mel.shape[1]
    return {
        "samples": count,
        "frames": frames,
        "padded": padded,
        "wall": time.perf_counter() - started,
    }


def mel_batches(stream: Iterable) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(mel, mel_lengths) of each ``Batch`` of ``stream``, what :func:`consume` counts."""
    return ((b.mel, b.mel_lengths) for b in stream)
