"""Handing padded mels from loader workers to the training process through reused shared memory.

DataLoader moves every tensor a worker returns through a fresh shared-memory segment: the
worker creates and fills it, its file descriptor crosses a socket, the receiver maps it and
both sides page-fault it in. That costs milliseconds per batch, more than reading and
padding the batch. Here each worker owns a ring of fixed slots in shared memory, mapped
once; it pads a batch's mel straight into a slot and sends only the small rest (lengths,
token ids, keys) through DataLoader. The consumer copies the slot out (into pinned memory
when asked), so the batch it hands on owns its memory.

Flow control comes from DataLoader itself: a worker gets its task ``m + prefetch_factor``
only once its item ``m`` has been returned to the consumer, so ``prefetch_factor + 1``
slots can never be overwritten before they are copied. Each slot also carries the sequence
number of the item in it, checked before and after the copy, so a broken assumption fails
loudly instead of delivering a mixed batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_EMPTY = -1


class BatchRing:
    """``slots`` shared float16 buffers of ``slot_size`` elements each, plus their sequence
    numbers; one producer (a worker) and one consumer (the training process)."""

    def __init__(self, slots: int, slot_size: int) -> None:
        self.slots, self.slot_size = slots, slot_size
        self.data = torch.empty((slots, slot_size), dtype=torch.float16).share_memory_()
        self.seqs = torch.full((slots,), _EMPTY, dtype=torch.int64).share_memory_()
        self._views: tuple[np.ndarray, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_views"] = None  # numpy views would pickle as copies; rebuild them per process
        return state

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._views is None:
            self._views = (self.data.numpy(), self.seqs.numpy())
        return self._views

    def slot(self, seq: int, shape: tuple[int, ...]) -> np.ndarray:
        """Producer: the buffer to fill with item ``seq``; invalid until :meth:`publish`."""
        size = math.prod(shape)
        if size > self.slot_size:
            raise ValueError(f"a batch of shape {shape} does not fit a slot of {self.slot_size}")
        data, seqs = self._arrays()
        seqs[seq % self.slots] = _EMPTY
        return data[seq % self.slots, :size].reshape(shape)

    def publish(self, seq: int) -> None:
        """Producer: item ``seq`` is completely written."""
        self._arrays()[1][seq % self.slots] = seq

    def take(self, seq: int, shape: tuple[int, ...], pin_memory: bool) -> torch.Tensor:
        """Consumer: a copy of item ``seq`` (page-locked if ``pin_memory``)."""
        index = seq % self.slots
        seqs = self._arrays()[1]
        out = torch.empty(shape, dtype=torch.float16, pin_memory=pin_memory)
        before = int(seqs[index])
        # numpy's copy is single-threaded: torch's would wake its intra-op thread pool,
        # which competes with the loader workers for the same cores.
        np.copyto(out.numpy(), self._arrays()[0][index, : math.prod(shape)].reshape(shape))
        if before != seq or int(seqs[index]) != seq:
            raise RuntimeError(
                f"loader ring slot {index} holds item {int(seqs[index])}, expected {seq}: a "
                "worker ran ahead of the consumer (DataLoader prefetch contract broken)"
            )
        return out
