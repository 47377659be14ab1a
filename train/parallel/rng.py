"""Seeds and RNG state: every random stream derived from the run's seed, saved and
restored per rank so a resume continues it exactly.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 32-bit seed from the config seed and a purpose (``"init"``, a rank, …): all the
    trainer's randomness flows from ``seed`` through here, never from time or pid."""
    words = [seed] + [
        p if isinstance(p, int) else int.from_bytes(p.encode(), "little") for p in parts
    ]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's ``random`` and NumPy's global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def use_deterministic_algorithms() -> None:
    """Make CUDA kernels deterministic (embedding backward, scatter, cuBLAS workspaces), so a
    resumed run is bitwise the uninterrupted one on GPUs too; slower, hence a config key."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(True)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator's state as tensors and builtins (``weights_only``-loadable)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
