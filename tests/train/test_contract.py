"""The model contract for plug-ins (``train/model/contract.py``, ``train/model/guards.py``,
``train/model/tokenizers.py``), in one process on the real cache: whole batches, mean losses with
their weight, a model's own count, dtype and padding as declared, features, tokenizers, and the
one-line errors of the first step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from melcache.features import FeatureConfig, feature_presets
from tests.support.helpers import IN_PROCESS, metrics, tiny_fit, tiny_trainer
from train.model.tokenizers import build_tokenizer
from train.parallel.env import Env
from train.trainer import Trainer

CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def trainer(cache: Path, out: Path, *extra: str) -> Trainer:
    return tiny_trainer(cache, out, [*IN_PROCESS, *extra])


def fit(cache: Path, out: Path, steps: int, *extra: str) -> Trainer:
    return tiny_fit(cache, out, steps, [*IN_PROCESS, *extra])


def plugin(name: str) -> str:
    return f"model.impl=tests.support.plugin_models:{name}"


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out) if "loss" in r]


def test_a_mean_loss_with_its_weight_trains_like_the_sum(train_cache: Path, tmp_path: Path) -> None:
    """The whole batch in, float32 mels to the longest, a mean and its weight out: the same
    logged loss and weights as the reference's sum over valid frames."""
    ref = fit(train_cache, tmp_path / "ref", 4, "data.pad_multiple=1")
    mean = fit(train_cache, tmp_path / "mean", 4, plugin("WholeBatchMean"))
    assert mean.parts.loader.spec.data.pad_multiple == 1  # the model said "longest"
    torch.testing.assert_close(
        losses(tmp_path / "mean"), losses(tmp_path / "ref"), rtol=1e-4, atol=0
    )
    for p, q in zip(
        mean.parts.raw_model.parameters(), ref.parts.raw_model.parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_a_models_own_count_is_the_denominator(train_cache: Path, tmp_path: Path) -> None:
    """A loss summed over half the frames, with that count, logs the mean over those frames."""
    t = trainer(train_cache, tmp_path, plugin("CountedHalf"))
    try:
        batch = next(iter(t.parts.loader))
        half = (batch.mel_lengths + 1) // 2
        with torch.no_grad():
            expected = t.parts.raw_model(
                batch.mel, batch.mel_lengths, batch.text, batch.text_lengths
            )
        t.meter = type(t.meter)(CPU)
        t.train_step([batch])
        logged = t.meter.summary()["loss"]
    finally:
        t.close()
    assert logged == pytest.approx(float(expected["loss_sum"] / half.sum()), rel=1e-5)
    # ...not over all valid frames, which would be about half as large.
    assert logged > 1.5 * float(expected["loss_sum"] / batch.mel_lengths.sum())


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", 'without "loss_sum"'),
        ("per_utterance", r'"loss_sum" of shape \[\d+\]: it must be a scalar'),
        ("non_finite", 'non-finite "loss_sum"'),
        ("half", '"loss_sum" as torch.float16'),
        ("mean_only", 'with "loss_weight"'),
    ],
)
def test_what_a_model_returns_is_checked_at_the_first_step(
    train_cache: Path, tmp_path: Path, kind: str, message: str
) -> None:
    t = trainer(train_cache, tmp_path, plugin("BadOutputs"), f"model.args.kind={kind!r}")
    try:
        with pytest.raises(UserError, match=message) as info:
            t.fit(1)
    finally:
        t.close()
    assert "\n" not in str(info.value) and "BadOutputs" in str(info.value)


def test_unused_parameters_are_named_or_allowed(train_cache: Path, tmp_path: Path) -> None:
    t = trainer(train_cache, tmp_path / "a", plugin("UnusedHead"))
    try:
        with pytest.raises(UserError, match=r"spare_head\.weight, spare_head\.bias.*find_unused"):
            t.fit(1)
    finally:
        t.close()
    fit(
        train_cache,
        tmp_path / "b",
        2,
        plugin("UnusedHead"),
        "train.parallel.find_unused_parameters=true",
    )


def test_the_trainer_puts_the_model_in_training_mode(train_cache: Path, tmp_path: Path) -> None:
    t = trainer(train_cache, tmp_path)
    t.close()
    assert t.parts.raw_model.training


def test_declared_features_are_compared_key_by_key(train_cache: Path, tmp_path: Path) -> None:
    """The train cache has ChatTTS's features: a model made for Vocos's 1e-7 floor is refused
    (n_mels, rate and hop all match); one declaring the ChatTTS preset is accepted."""
    with pytest.raises(UserError, match=r"features\.log_floor = 1e-05, but 1e-07 is expected"):
        trainer(train_cache, tmp_path / "a", plugin("MadeForVocosFloor"))
    trainer(train_cache, tmp_path / "b", plugin("MadeForChatTTS")).close()


def test_feature_presets_are_read_from_the_build_presets() -> None:
    """A model may declare the build presets' extractors by name; the default extractor is
    ChatTTS's mel, and the HiFi-GAN preset is its 22.05 kHz, 80-band Slaney mel."""
    presets = feature_presets()
    assert sorted(presets) == ["chattts", "hifigan"]  # base and tiny are trainer configs
    assert presets["chattts"] == FeatureConfig()
    hifigan = presets["hifigan"]
    assert (hifigan.sample_rate, hifigan.n_mels, hifigan.mel_scale) == (22_050, 80, "slaney")


def test_tokenizers_by_config(tmp_path: Path) -> None:
    assert list(build_tokenizer("bytes")("é")) == [0xC3 + 1, 0xA9 + 1]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text(" \na\nb\n你\n", encoding="utf-8")
    chars = build_tokenizer("chars", str(vocab))
    assert chars.vocab_size == 6 and list(chars("ab 你?")) == [2, 3, 1, 4, 5]  # ? is <unk>
    dup = tmp_path / "dup.txt"
    dup.write_text("a\na\n", encoding="utf-8")
    with pytest.raises(UserError, match="repeats a line"):
        build_tokenizer("chars", str(dup))
    with pytest.raises(UserError, match=r"needs data\.vocab"):
        build_tokenizer("chars")
    with pytest.raises(UserError, match="cannot be imported"):
        build_tokenizer("tests.nowhere:tok")
    zero = build_tokenizer("tests.support.plugin_tokenizers:ZeroBased")  # a factory
    with pytest.raises(UserError, match=r"ids 0\.\.2 .*0 is padding"):
        zero("abc")


def test_the_tokenizers_vocabulary_reaches_the_model(train_cache: Path, tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"{c}\n" for c in "abcdefghijklmnopqrstuvwxyz ,.'"), encoding="utf-8")
    t = fit(train_cache, tmp_path / "run", 2, "data.tokenizer=chars", f"data.vocab={vocab!s}")
    assert t.parts.raw_model.text_embed.num_embeddings == 32
    assert losses(tmp_path / "run")
