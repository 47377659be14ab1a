"""Hostile inputs to the trainer (issue 37): tokenizers that return the wrong thing, an empty
vocabulary, a diverging run, resume refusals, and a stop during validation. Each ends in one
line naming the tokenizer, key or file and what to do."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from melcache.loader import DataConfig, make_loader
from tests.support.helpers import (
    IN_PROCESS,
    REPO,
    checkpoint,
    metrics,
    run_ok,
    tiny_fit,
    tiny_trainer,
    train_cmd,
)
from train.model.tokenizers import build_tokenizer
from train.run import dcp


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("os:system", "names builtin_function_or_method"),
        ("tests.support.plugin_tokenizers:needs_an_argument", "needs arguments ['path']"),
        ("tests.support.plugin_tokenizers:GivesStr", "returned str '1 2 3'"),
        ("tests.support.plugin_tokenizers:GivesNone", "returned NoneType None"),
        ("tests.support.plugin_tokenizers:GivesNested", "returned list [[1, 2], [3]]"),
        ("tests.support.plugin_tokenizers:GivesHuge", "returned list [1, 1180591620717411303424]"),
        ("tests.support.plugin_tokenizers:GivesFloats", "returned list [1.9, 2.0]"),
        (
            "tests.support.plugin_tokenizers:GivesPastVocab",
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
    checked = build_tokenizer("tests.support.plugin_tokenizers:LaterBad")
    for tokenizer, name in (
        (checked, "tests.support.plugin_tokenizers:LaterBad"),
        (_floats, "_floats"),
    ):
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
    with pytest.raises(UserError, match=r"made a dict, not a torch\.nn\.Module") as error:
        tiny_trainer(train_cache, tmp_path / "run", [*IN_PROCESS, 'model.impl="builtins:dict"'])
    one_line(error.value)


def test_a_diverging_run_ends_in_one_line(train_cache: Path, tmp_path: Path) -> None:
    from train.__main__ import main

    diverges = ['model.impl="tests.support.spike_model:DivergesAt"', "model.args.at=3"]
    with pytest.raises(UserError, match="the loss is nan at step 4: the run diverged") as error:
        tiny_fit(train_cache, tmp_path / "run", 6, [*IN_PROCESS, *diverges])
    assert "lower optim.lr" in one_line(error.value)
    args = ["--shards", str(train_cache), "--config", str(REPO / "configs" / "tiny.toml")]
    assert (
        main([*args, "--out", str(tmp_path / "cli"), "--max-steps", "6", *IN_PROCESS, *diverges])
        == 2
    )


def test_a_resume_with_other_workers_goes_on_and_another_budget_names_the_users_key(
    train_cache: Path, tmp_path: Path
) -> None:
    """Another worker count resumes (#39: every rank's loader state); another batch budget,
    which would cut other batches, is one line naming the user's key."""
    tiny_fit(train_cache, tmp_path, 2, IN_PROCESS)
    resumed = tiny_trainer(train_cache, tmp_path, [*IN_PROCESS, "data.num_workers=2"])
    try:
        assert resumed.parts.loader.resume_changes == (
            "data.num_workers (workers per rank) 1 -> 2",
        )
    finally:
        resumed.close()
    with pytest.raises(UserError) as error:
        tiny_trainer(train_cache, tmp_path, [*IN_PROCESS, "data.max_batch_size=3"])
    line = one_line(error.value)
    assert "data.max_batch_size = 16 but this loader has data.max_batch_size = 3" in line, line
    assert "load_state_dict" not in line and "workers_per_rank" not in line
    assert "train into a new --out" in line


def test_a_stop_signal_does_not_wait_for_validation(train_cache: Path, tmp_path: Path) -> None:
    """SIGTERM during a validation pass: it stops at the next batch, records it, checkpoints
    that step and stops, instead of finishing the pass and training one more step."""
    val = [
        f"data.val_shards={train_cache!s}",
        "train.validation.every=2",
        "train.validation.batches=4",
    ]
    t = tiny_trainer(train_cache, tmp_path, [*IN_PROCESS, *val])
    try:
        t.parts.validator.batches = _SignalAfterOne(t.parts.validator.batches)
        assert t.fit(10) == "signal"
    finally:
        t.close()
    records = metrics(tmp_path)
    stopped = [r for r in records if r.get("event") == "validation_stopped"]
    assert stopped == [{"step": 2, "event": "validation_stopped", "batches": 1, "of": 4}]
    assert not any("val_loss" in r for r in records)
    assert checkpoint(tmp_path, 2).exists() and max(r["step"] for r in records) == 2


class _SignalAfterOne(list):
    """Validation batches that send this process SIGTERM once the first is handed out."""

    def __iter__(self):  # type: ignore[override]
        for i, batch in enumerate(list.__iter__(self)):
            yield batch
            if i == 0:
                os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_weights_of_another_shape_are_refused_by_name(tmp_path: Path) -> None:
    """DCP's own "Size mismatch" is a CheckpointException traceback of every rank; the
    shapes are compared first, from the metadata, in one line."""
    dcp.save({"model": {"w": torch.zeros(4, 3)}, "step": 3}, tmp_path, None)
    with pytest.raises(ValueError, match=re.escape("model.w was saved as [4, 3] but is [5, 3]")):
        dcp.load({"model": {"w": torch.zeros(5, 3)}}, tmp_path, None)
    same = {"model": {"w": torch.ones(4, 3)}}
    dcp.load(same, tmp_path, None)
    assert torch.equal(same["model"]["w"], torch.zeros(4, 3))


@pytest.mark.slow
def test_an_fsdp2_resume_with_another_model_shape_is_one_line(
    train_cache: Path, tmp_path: Path
) -> None:
    fsdp = ("train.parallel.strategy=fsdp2", "train.checkpoint.every=2")
    run_ok(train_cmd(train_cache, tmp_path, *fsdp, max_steps=2))
    done = subprocess.run(
        train_cmd(train_cache, tmp_path, *fsdp, "model.args.dim=32", max_steps=4),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "was saved as" in line]
    assert len(errors) == 2 and all("cannot be loaded as this model's sharded" in e for e in errors)
    ranks = done.stderr.split("ChildFailedError")[0]  # before torchrun's own summary
    assert "CheckpointException" not in ranks and "Size mismatch" not in ranks, ranks[-3000:]


def test_a_model_failing_in_its_forward_is_one_line_naming_it_then_its_frames(
    train_cache: Path, tmp_path: Path
) -> None:
    """A user's model that raises: the model, the step and the batch in one line, then the
    model's own frames, not the trainer's traceback."""
    impl = "tests.support.plugin_models:RaisesInForward"
    with pytest.raises(UserError) as failed:
        tiny_fit(train_cache, tmp_path / "run", 2, [*IN_PROCESS, f"model.impl={impl!r}"])
    first, *frames = str(failed.value).splitlines()
    assert re.fullmatch(
        rf"{impl} failed in its forward at step 1 \(bucket \d+, first key '\S+', mel \[\d+, \d+, "
        r"\d+\]\): ValueError: cannot take a mel of \d+ bands",
        first,
    ), first
    assert any("plugin_models.py" in f for f in frames) and "raise ValueError" in frames[-1]
    assert not any("/train/" in f for f in frames), frames
