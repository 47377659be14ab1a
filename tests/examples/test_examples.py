"""The plug-in examples (docs/models.md) with the real packages, from random init, on 2 gloo ranks:
``examples/f5tts`` (F5-TTS's CFM + DiT) and ``examples/chattts_dvae`` (ChatTTS's DVAE). Each
trains with its loss falling, and a run stopped halfway resumes bitwise on CPU. Skipped where
the extras are not installed (CI installs them: .ci/run). And the quick start's sample-corpus
config gives batches of several utterances."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest
import torch

from melcache.loader import DataConfig, make_loader
from tests.support.helpers import (
    REPO,
    build_cache,
    checkpoint,
    load,
    metrics,
    needs_extra,
    run_ok,
    torchrun,
)
from train.config.tables import load_config

pytestmark = pytest.mark.slow

EXAMPLES = {"f5tts": ("f5_tts", "f5tts"), "chattts_dvae": ("ChatTTS", "chattts")}
STEPS = 30


def train(name: str, cache: Path, out: Path, steps: int, *extra: str) -> None:
    config = REPO / "examples" / name / "config.toml"
    run_ok(
        torchrun(
            "-m", "train", "--shards", str(cache), "--config", str(config), "--out", str(out),
            "--max-steps", str(steps), "train.checkpoint.every=10", *extra,
        ),
        timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_on_two_ranks_and_resumes_bitwise(
    name: str, train_cache: Path, tmp_path: Path
) -> None:
    needs_extra(*EXAMPLES[name])
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


def batch_sizes(cache: Path, steps: int) -> collections.Counter[int]:
    """Utterances per batch of the tiny preset's ``[data]`` over ``steps`` steps of 2 ranks."""
    data = dataclasses.replace(load_config(Path("tiny")).data, num_workers=0)
    sizes: collections.Counter[int] = collections.Counter()
    for rank in range(2):
        loader = make_loader(cache, data, rank=rank, world_size=2)
        stream = iter(loader)
        sizes.update(len(next(stream)) for _ in range(steps))
        loader.close()
    return sizes


def test_the_quick_start_cache_gives_batches_of_several_utterances(tmp_path: Path) -> None:
    sample = build_cache(tmp_path / "sample", REPO / "examples" / "sample_corpus.toml")
    chattts = build_cache(tmp_path / "chattts", Path("chattts"))
    quick, default = batch_sizes(sample, 30), batch_sizes(chattts, 30)
    print(f"utterances per batch: sample_corpus.toml {dict(quick)}, chattts {dict(default)}")
    assert min(quick) >= 2 and len(quick) > 1
    assert default[1] > 0  # what the quick start gave before: 10 buckets, 3 of one utterance


def test_f5tts_predicts_the_rest_of_each_utterance_and_pictures_it(
    train_cache: Path, tmp_path: Path
) -> None:
    needs_extra("f5_tts", "f5tts")
    from examples.f5tts.adapter import F5TTS

    model = F5TTS(n_mels=100, vocab_size=257, dim=64, depth=2, heads=4, text_dim=32, conv_layers=1)
    loader = make_loader(train_cache, DataConfig(batch_frames=2000, pad_multiple=1, num_workers=0))
    try:
        batch = next(iter(loader))
    finally:
        loader.close()
    mel = batch.mel.float()
    predicted = model.predict_mel(dataclasses.replace(batch, mel=mel))
    assert predicted.shape == mel.shape and torch.isfinite(predicted).all()
    for row, frames in enumerate(batch.mel_lengths.tolist()):
        prompt = max(1, int(frames * 0.3))
        assert torch.equal(predicted[row, :prompt], mel[row, :prompt])  # the prompt, as given
        assert not torch.allclose(predicted[row, prompt:frames], mel[row, prompt:frames])
    # in a run: the picture at every validation, on 2 ranks
    val = [
        "--val-shards",
        str(train_cache),
        "train.validation.every=2",
        "train.validation.batches=1",
    ]
    train("f5tts", train_cache, tmp_path, 4, *val)
    assert [r["step"] for r in metrics(tmp_path) if "val_loss" in r] == [2, 4]
    for step in (2, 4):
        assert (tmp_path / "val" / f"step-{step:08d}.png").stat().st_size > 1000
