"""A corpus of any size for almost no disk: the sample corpus's wav files hard-linked under
unique names (1,000 per folder), and a JSONL manifest whose rows carry a ``duration``, the
layout of NeMo/Emilia-style manifests. Each size's manifest is a prefix of a bigger one's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import soundfile as sf

REPO = Path(__file__).resolve().parents[2]
PER_FOLDER = 1000
LINKS_PER_COPY = 50_000  # ext4 allows 65,000 hard links to one file


def make_manifest(root: Path, size: int) -> Path:
    """``root/manifest-SIZE.jsonl`` over hard links to the sample corpus's wav files."""
    manifest = root / f"manifest-{size}.jsonl"
    if manifest.exists():
        return manifest
    originals = sorted((REPO / "examples" / "wavs").rglob("*.wav"))
    seconds = [sf.info(p).duration for p in originals]
    texts = [p.with_suffix(".txt").read_text().strip() for p in originals]
    audio = root / "audio"
    temp = manifest.with_suffix(".tmp")
    with open(temp, "w") as rows:
        for n in range(size):
            folder = audio / f"{n // PER_FOLDER:05d}"
            if n % PER_FOLDER == 0:
                folder.mkdir(parents=True, exist_ok=True)
            name = folder / f"utt{n:08d}.wav"
            if not name.exists():
                os.link(_seed(root, originals[n % len(originals)], n // len(originals)), name)
            row = {
                "audio_filepath": str(name.relative_to(root)),
                "text": texts[n % len(texts)],
                "speaker": f"spk{n % 997}",
                "duration": round(seconds[n % len(seconds)], 4),
            }
            rows.write(json.dumps(row, ensure_ascii=False) + "\n")
    temp.rename(manifest)
    return manifest


def _seed(root: Path, original: Path, use: int) -> Path:
    """A copy of ``original`` to hard-link to, a new one every ``LINKS_PER_COPY`` links."""
    seed = root / "seeds" / str(use // LINKS_PER_COPY) / original.name
    if not seed.exists():
        seed.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(original, seed)
    return seed
