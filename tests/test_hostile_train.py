"""Hostile inputs to the trainer (issue 37): tokenizers that return the wrong thing, an empty
vocabulary, a diverging run, resume refusals, and a stop during validation. Each ends in one
line naming the tokenizer, key or file and what to do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import tiny_trainer

from melcache.errors import UserError
from melcache.loader import DataConfig, make_loader
from train.model.tokenizers import build_tokenizer

SMALL = [
    "data.batch_frames=800",
    "data.num_workers=0",
    "model.args.dim=32",
    "model.args.layers=1",
    "model.args.dropout=0.0",
    "model.args.prenet_dropout=0.0",
    "train.precision=fp32",
    "train.log_every=2",
    "train.ckpt_every=100",
]


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("os:system", "names builtin_function_or_method"),
        ("tests._plugin_tokenizers:needs_an_argument", "needs arguments ['path']"),
        ("tests._plugin_tokenizers:GivesStr", "returned str '1 2 3'"),
        ("tests._plugin_tokenizers:GivesNone", "returned NoneType None"),
        ("tests._plugin_tokenizers:GivesNested", "returned list [[1, 2], [3]]"),
        ("tests._plugin_tokenizers:GivesHuge", "returned list [1, 1180591620717411303424]"),
        ("tests._plugin_tokenizers:GivesFloats", "returned list [1.9, 2.0]"),
        (
            "tests._plugin_tokenizers:GivesPastVocab",
            "gave ids 1..100 for 'Hello, world. 1, 2, 3.': ids must be in 1..99 (vocab_size 100)",
        ),
        ("builtins:dict", "not a callable with an int vocab_size"),
    ],
)
def test_a_tokenizer_that_returns_the_wrong_thing_is_refused_at_start(spec: str, said: str) -> None:
    with pytest.raises(UserError, match=re.escape(said)) as error:
        build_tokenizer(spec)
    assert spec in one_line(error.value)


def test_an_empty_vocabulary_is_refused(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="is empty: give one character per line") as error:
        build_tokenizer("chars", str(vocab))
    assert str(vocab) in one_line(error.value)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_later_bad_output_is_one_line_from_the_loader(train_cache: Path, workers: int) -> None:
    """Sound on the probe, floats later: each sample's ids are checked where they are made."""
    checked = build_tokenizer("tests._plugin_tokenizers:LaterBad")
    for tokenizer, name in ((checked, "tests._plugin_tokenizers:LaterBad"), (_floats, "_floats")):
        data = DataConfig(batch_frames=800, num_workers=workers)
        loader = make_loader(str(train_cache), data, tokenizer=tokenizer)
        try:
            with pytest.raises(UserError) as error:
                next(iter(loader))
        finally:
            loader.close()
        last = str(error.value).strip().splitlines()[-1]  # a worker's: after its traceback
        assert f"tokenizer {name} returned list [1.5" in last, last
        assert "a tokenizer returns a flat list or 1-D array of int ids" in last


def _floats(text: str) -> list[float]:
    return [1.5] * len(text)


def test_the_model_factory_is_checked_for_what_it_makes(train_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="made a dict, not a torch.nn.Module") as error:
        tiny_trainer(train_cache, tmp_path / "run", [*SMALL, 'model.impl="builtins:dict"'])
    one_line(error.value)
