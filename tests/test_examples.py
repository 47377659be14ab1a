"""The README's plug-in examples with the real packages, from random init, on 2 gloo ranks:
``examples/f5tts`` (F5-TTS's CFM + DiT) and ``examples/chattts_dvae`` (ChatTTS's DVAE). Each
trains with its loss falling, and a run stopped halfway resumes bitwise on CPU. Skipped where
the extras are not installed (CI installs them: .ci/run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import REPO, checkpoint, load, metrics, run_ok, torchrun

pytestmark = pytest.mark.slow

EXAMPLES = {"f5tts": "f5_tts", "chattts_dvae": "ChatTTS"}
STEPS = 30


def train(name: str, cache: Path, out: Path, steps: int, *extra: str) -> None:
    config = REPO / "examples" / name / "config.toml"
    run_ok(
        torchrun(
            "-m", "train", "--shards", str(cache), "--config", str(config), "--out", str(out),
            "--max-steps", str(steps), "train.ckpt_every=10", *extra,
        ),
        timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_on_two_ranks_and_resumes_bitwise(
    name: str, train_cache: Path, tmp_path: Path
) -> None:
    pytest.importorskip(EXAMPLES[name])
    train(name, train_cache, tmp_path / "whole", STEPS)
    losses = [r["loss"] for r in metrics(tmp_path / "whole") if "loss" in r]
    print(f"{name}: loss per window {losses}")
    assert len(losses) == STEPS // 5
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    train(name, train_cache, tmp_path / "split", 10)
    train(name, train_cache, tmp_path / "split", STEPS)
    whole = load(checkpoint(tmp_path / "whole", STEPS))["model"]
    split = load(checkpoint(tmp_path / "split", STEPS))["model"]
    for key, value in whole.items():
        assert torch.equal(value, split[key]), key
