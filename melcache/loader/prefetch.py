"""Host-to-device copies of a step's batches that overlap compute.

On CUDA the copies go on a side stream: the host runs ahead of the device, so the next step's
inputs travel (from pinned memory, ``non_blocking``) while the device still computes the
current one, instead of queueing behind it on the compute stream. Before a batch is used the
compute stream waits for the copies (``wait_stream``), and each copied tensor is marked as used
by the compute stream (``record_stream``) so that the caching allocator, which allocated it on
the side stream, does not hand its memory out again while the compute stream may still read
it. On CPU a copy is a no-op and nothing waits.
"""

from __future__ import annotations

import torch

from melcache.loader.batch import Batch


class DeviceCopies:
    """``start(batches)`` copies them to ``device``; ``ready(batch)`` before using one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # None: copy on the compute stream (CPU; or set so by gpu_bench's comparison row).
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, batches: list[Batch]) -> list[Batch]:
        """Start copying ``batches`` to the device; returns the device batches, not yet safe to
        read on the compute stream before :meth:`ready`."""
        if self.stream is None:
            return [batch.to(self.device) for batch in batches]
        with torch.cuda.stream(self.stream):
            return [batch.to(self.device, non_blocking=True) for batch in batches]

    def ready(self, batch: Batch) -> Batch:
        """``batch`` (from :meth:`start`), safe to use on the current stream."""
        if self.stream is None:
            return batch
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for tensor in (batch.mel, batch.mel_lengths, batch.text, batch.text_lengths):
            tensor.record_stream(current)
        return batch
