"""The reference encoder-decoder (``train.model:EncoderDecoder``) honours the contract and
declares its two axes: quick checks in one process; and, in the slow tier, real 2-rank gloo
jobs on a real cache under the two-axis plan (both budgets on every batch a rank trains on,
bitwise resume) and ``train tune`` writing a table per axis."""

from __future__ import annotations

import itertools
import json
import tomllib
from pathlib import Path

import pytest
import torch

from melcache.batch_plans import round_up
from melcache.loader import DataConfig, make_loader
from melcache.loader.stream import planned_stream
from tests.support.helpers import REPO, checkpoint, load, run_ok, tiny_trainer, train_cmd
from tests.train.test_model import N_MELS, make_batch
from train.config.tables import load_config
from train.model import EncoderDecoder
from train.model.contract import declared, loader_data

IMPL = 'model.impl="train.model:EncoderDecoder"'
TEXT_BUDGET = 80  # padded text tokens a micro-batch: binds on the train cache
RECORDING = 'model.impl="tests.support.plugin_models:ShapeRecording"'


def tiny_encoder_decoder(**kw) -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder(n_mels=N_MELS, dim=32, layers=2, heads=2, **kw)


def test_every_parameter_gets_a_gradient_from_both_axes() -> None:
    model = tiny_encoder_decoder(encoder_layers=1)
    assert len(model.encoder) == 1 and len(model.blocks) == 2
    model(**make_batch([7, 12], [3, 5]))["loss_sum"].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_activation_checkpointing_recomputes_both_sides_to_the_same_gradients() -> None:
    batch, grads, calls = make_batch([7, 12], [3, 5]), [], []
    for enabled in (False, True):
        model = tiny_encoder_decoder()
        model.set_activation_checkpointing(enabled)
        calls.clear()
        for block in (model.encoder[0], model.blocks[0]):
            block.register_forward_pre_hook(lambda module, _: calls.append(module))
        torch.manual_seed(1)  # the same dropout masks; checkpoint replays the RNG state
        model(**batch)["loss_sum"].backward()
        assert len(calls) == (4 if enabled else 2)  # each side's block entered again in backward
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1)


def test_the_loss_sums_valid_frames_whatever_the_padding_holds() -> None:
    """Two utterances alone, then together padded further on both axes, the mel's padding
    NaN/inf and the text's padding other token ids: the same loss_sum."""
    model = tiny_encoder_decoder(dropout=0.0, prenet_dropout=0.0).eval()
    a, b = make_batch([9], [4]), make_batch([5], [6])
    alone = model(**a)["loss_sum"] + model(**b)["loss_sum"]
    for pad_text in (0, 77):
        both = make_batch([9, 5], [4, 6], pad_to=16)
        both["text"] = torch.nn.functional.pad(both["text"], (0, 3), value=pad_text)
        both["text"][0, 4:] = pad_text
        both["mel"][0, :9], both["text"][0, :4] = a["mel"][0], a["text"][0]
        both["mel"][1, :5], both["text"][1, :6] = b["mel"][0], b["text"][0]
        together = model(**both)
        assert torch.isfinite(together["loss_sum"])
        torch.testing.assert_close(together["loss_sum"], alone, rtol=1e-5, atol=1e-5)


def test_frames_are_causal_and_read_the_text() -> None:
    model = tiny_encoder_decoder(dropout=0.0, prenet_dropout=0.0).eval()
    batch = make_batch([10], [4])
    text, lengths = batch["text"], batch["text_lengths"]
    mel_in = torch.randn(1, 10, N_MELS)
    h1 = model._decode(mel_in, text, lengths, batch["mel_lengths"])
    mel_in[0, 6] += 1.0
    h2 = model._decode(mel_in, text, lengths, batch["mel_lengths"])
    torch.testing.assert_close(h1[0, :6], h2[0, :6])
    assert not torch.allclose(h1[0, 6:], h2[0, 6:])
    other = text.clone()
    other[0, 2] = other[0, 2] % 256 + 1
    h3 = model._decode(mel_in, other, lengths, batch["mel_lengths"])
    assert not torch.allclose(h2[0, :1], h3[0, :1])  # the first frame already reads the text


def test_it_declares_two_axes_and_generates() -> None:
    spec = declared(EncoderDecoder, "train.model:EncoderDecoder")
    assert spec.sequence == "text,frames"
    assert loader_data(DataConfig(), spec).sequence == "text,frames"
    model = tiny_encoder_decoder()
    model.set_mel_stats(torch.full((N_MELS,), -5.0), torch.full((N_MELS,), 2.0))
    mel = model.generate(torch.tensor([72, 105]), max_frames=5)
    assert mel.shape[1] == N_MELS and 1 <= mel.shape[0] <= 5


def test_a_trainer_step_plans_it_on_both_axes(train_cache: Path, tmp_path: Path) -> None:
    """The declaration reaches the trainer's loader: two real steps, each batch within
    ``batch_frames`` and ``batch_text``, a text budget a frames-only plan would overrun."""
    budgets = ["data.batch_frames=800", f"data.batch_text={TEXT_BUDGET}", "data.num_workers=0"]
    trainer = tiny_trainer(train_cache, tmp_path / "run", [IMPL, *budgets, "model.args.dim=32"])
    try:
        assert trainer.parts.loader.spec.data.sequence == "text,frames"
        stream = iter(trainer.parts.loader)
        for batch in [next(stream) for _ in range(2)]:
            assert len(batch) * batch.mel.shape[1] <= 800
            assert len(batch) * batch.text.shape[1] <= TEXT_BUDGET
            assert not trainer.train_step([batch]).skipped
    finally:
        trainer.close()
    frames_only = make_loader(train_cache, DataConfig(batch_frames=800, num_workers=0)).spec
    texts = [
        len(samples) * round_up(max(len(s.text.encode()) for s in samples), 8)
        for _, _, samples, _, _ in itertools.islice(planned_stream(frames_only, 0), 40)
    ]
    assert max(texts) > TEXT_BUDGET  # the text budget binds here


def rank_shapes(record: Path) -> list[list[list[int]]]:
    """Each rank's ``[rows, padded text, padded frames]`` per micro-batch, in order."""
    files = [record.with_name(f"{record.name}-rank{rank}") for rank in (0, 1)]
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


@pytest.mark.slow
def test_two_ranks_train_within_both_budgets_and_resume_bitwise(
    train_cache: Path, tmp_path: Path
) -> None:
    """Real torchrun, 2 gloo ranks, the two-axis plan: every batch a rank trains on keeps both
    budgets (the text's binds: see the quick test), and a run stopped halfway resumes bitwise."""

    def run(out: str, steps: int, record: str) -> list[list[list[int]]]:
        shapes = tmp_path / record
        args = [RECORDING, f'model.args.record="{shapes}"', f"data.batch_text={TEXT_BUDGET}"]
        run_ok(train_cmd(train_cache, tmp_path / out, *args, max_steps=steps), timeout=600)
        return rank_shapes(shapes)

    whole = run("whole", 10, "whole")  # each rank's micro-batches
    assert [len(shapes) for shapes in whole] == [10, 10]
    every = [shape for shapes in whole for shape in shapes]
    assert all(b * t <= TEXT_BUDGET and b * f <= 800 for b, t, f in every), every
    run("split", 5, "first")
    assert run("split", 10, "second") == [shapes[5:] for shapes in whole]  # batch for batch
    weights = load(checkpoint(tmp_path / "whole", 10))["model"]
    resumed = load(checkpoint(tmp_path / "split", 10))["model"]
    assert weights.keys() == resumed.keys()
    for key, value in weights.items():
        assert torch.equal(value, resumed[key]), key


@pytest.mark.slow
def test_tune_writes_a_table_per_axis_that_the_loader_keeps(
    train_cache: Path, tmp_path: Path
) -> None:
    from train.__main__ import main

    output, tiny = tmp_path / "budgets.toml", REPO / "configs" / "tiny.toml"
    small = [IMPL, "model.args.dim=64", "model.args.layers=2", "train.precision=fp32"]
    small += ["data.max_batch_size=64", "data.num_workers=0"]
    command = ["tune", "--shards", str(train_cache), "--config", str(tiny)]
    assert main([*command, "--memory-limit-mib", "28", "--output", str(output), *small]) == 0
    tables = tomllib.loads(output.read_text())["data"]
    assert set(tables) == {"batch_frames", "batch_text"}
    assert tables["batch_frames"].keys() == tables["batch_text"].keys()
    assert all(
        0 < tables["batch_text"][k] < tables["batch_frames"][k] for k in tables["batch_text"]
    )
    data = load_config([tiny, output], small).data
    spec = make_loader(
        train_cache, loader_data(data, declared(EncoderDecoder, "EncoderDecoder"))
    ).spec
    for _, _, samples, _, entries in itertools.islice(planned_stream(spec, 0), 60):
        bucket = str(entries[0]["bucket"])
        text = max(len(s.text.encode()) for s in samples)
        assert len(samples) * round_up(text, 8) <= tables["batch_text"][bucket]
        frames = max(s.frames for s in samples)
        assert len(samples) * round_up(frames, 8) <= tables["batch_frames"][bucket]
