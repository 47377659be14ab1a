"""A map-style ``torch.utils.data.Dataset`` over a cache, for other trainers' samplers.

Item ``i`` is row ``i`` of the cache's table (:mod:`melcache.access`), read in one ranged read;
``lengths`` (frames per item) and ``get_frame_len(i)`` come from the table, so a length
sampler (F5-TTS's ``DynamicBatchSampler``, Hugging Face's ``LengthGroupedSampler``) starts
without reading a shard. Each DataLoader worker opens its own files (the dataset pickles as
its location).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from melcache.access import Cache, open_cache, row_or_key


class CacheDataset(Dataset):
    """Items ``{"key", "mel" (float16 [frames, n_mels] tensor), "text", "speaker", "frames",
    "seconds", "fields"}`` (``fields``: every derived field of the cache, name → tensor
    ``[T_field, *shape]`` in its stored dtype), in the table's row order."""

    def __init__(self, cache: str | Path) -> None:
        self.cache: Cache = open_cache(cache)
        features = self.cache.index["features"]
        self._seconds_per_frame = features["hop_length"] / features["sample_rate"]

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int | str) -> dict[str, Any]:
        """Item ``index``: a row (an integer), or a key (a ``str``), as ``cache[...]`` takes;
        a float or anything else is a ``TypeError`` (``int()`` would truncate 2.9 to row 2)."""
        utterance = self.cache[row_or_key(self.cache.location, index)]
        mel = utterance.mel  # a view of the read-only bytes read, for fp16 storage: copy it
        return {
            "key": utterance.key,
            "mel": torch.from_numpy(mel if mel.flags.writeable else mel.copy()),
            "text": utterance.text,
            "speaker": utterance.speaker,
            "frames": utterance.frames,
            "seconds": utterance.meta.get("seconds"),
            "fields": {  # views of the bytes read: copied, as the mel
                name: torch.from_numpy(v if v.flags.writeable else v.copy())
                for name, v in utterance.fields.items()
            },
        }

    @property
    def lengths(self) -> np.ndarray:
        """Frames of every item, from the table (no shard is read)."""
        return self.cache.lengths

    def get_frame_len(self, index: int) -> int:
        """Frames of item ``index``: what F5-TTS's ``DynamicBatchSampler`` asks a dataset."""
        row = row_or_key(self.cache.location, index, keys=False)
        return int(self.cache.lengths[self.cache.row(row)])  # type: ignore[arg-type]

    def durations(self) -> np.ndarray:
        """Seconds of every item (frames × hop ÷ rate), for duration-based samplers."""
        return self.cache.lengths.astype(np.float64) * self._seconds_per_frame
