"""``preprocess inspect CACHE --key KEY``: one utterance, looked up through the cache's table
(:mod:`melcache.access`), printed, and with ``--png`` its mel drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from melcache.access import Utterance, open_cache
from melcache.errors import UserError


def show_utterance(cache: Path, key: str, png: Path | None = None) -> str:
    """What ``inspect --key`` prints; with ``png``, the mel is drawn into ``png/KEY.png`` too."""
    with open_cache(cache) as opened:
        utterance = opened[key]
        offset, length = opened.table.span(utterance.row)
        features = opened.index["features"]
    mel = utterance.mel.astype(np.float32)
    meta = utterance.meta
    lines = [
        f"key {utterance.key}: row {utterance.row}, {utterance.shard} bytes {offset}+{length}",
        f"text: {utterance.text}",
        f"speaker: {utterance.speaker}   source: {meta.get('source')}   bucket: {meta.get('bucket')}",
        f"{utterance.frames} frames × {mel.shape[1]} mels, {meta.get('seconds')} s; "
        f"log-mel min {mel.min():.3f}, mean {mel.mean():.3f}, max {mel.max():.3f}",
    ]
    if utterance.audio is not None:
        lines.append(f"audio: {len(utterance.audio)} bytes of FLAC")
    if png is not None:
        hop_seconds = features["hop_length"] / features["sample_rate"]
        lines.append(f"wrote {plot_utterance(utterance, hop_seconds, png)}")
    return "\n".join(lines)


def plot_utterance(utterance: Utterance, hop_seconds: float, out_dir: Path) -> Path:
    """Draw one utterance's mel into ``out_dir/KEY.png``; return its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("inspect --png needs matplotlib: pip install 'melcache[plot]'") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    mel = utterance.mel.astype(np.float32).T
    figure, axis = plt.subplots(figsize=(10, 3))
    axis.imshow(
        mel, origin="lower", aspect="auto", extent=(0, mel.shape[1] * hop_seconds, 0, mel.shape[0])
    )
    axis.set_title(f"{utterance.key}: {utterance.text[:90]}", fontsize=9)
    axis.set_xlabel("seconds")
    axis.set_ylabel("mel band")
    figure.tight_layout()
    path = out_dir / f"{utterance.key}.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
