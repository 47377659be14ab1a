"""Validation (``train/run/validation.py``): a fixed set of batches every ``train.validation.every`` steps,
EMA weights, a deterministic loss that leaves the training RNG alone, ``val_loss`` in
metrics.jsonl and in ``train plot``, a picture of predicted vs target mels; on 2 ranks too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from tests.support.helpers import metrics, run_ok, train_cmd
from tests.train.test_contract import trainer
from train.plot import plot_run


def test_validation_is_fixed_logged_pictured_and_plotted(train_cache: Path, tmp_path: Path) -> None:
    val = [f"data.val_shards={train_cache!s}", "train.validation.every=3", "train.ema_decay=0.9"]
    t = trainer(train_cache, tmp_path, *val)
    try:
        t.fit(6)
        records = [r for r in metrics(tmp_path) if "val_loss" in r]
        assert [r["step"] for r in records] == [3, 6]
        # Same weights, same loss; the training RNG and mode are as they were.
        rng = torch.get_rng_state()
        again = t.parts.validator.run(*t._val_args())["val_loss"]
        assert again == pytest.approx(records[-1]["val_loss"], rel=1e-5)  # logged to 6 digits
        assert torch.equal(rng, torch.get_rng_state()) and t.parts.raw_model.training
        # The EMA's weights are evaluated, and the model's own put back.
        own = [p.detach().clone() for p in t.parts.raw_model.parameters()]
        t.parts.ema.decay = 0.0
        t.parts.ema.update()  # EMA = current weights: the loss changes
        assert t.parts.validator.run(*t._val_args())["val_loss"] != pytest.approx(again, rel=1e-9)
        assert all(
            torch.equal(p, q) for p, q in zip(own, t.parts.raw_model.parameters(), strict=True)
        )
    finally:
        t.close()
    assert (tmp_path / "val" / "step-00000006.png").stat().st_size > 1000
    assert plot_run(tmp_path).stat().st_size > 1000


def test_val_every_needs_val_shards(train_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data\.val_shards \(--val-shards\)"):
        trainer(train_cache, tmp_path, "train.validation.every=2")


@pytest.mark.slow
def test_validation_on_two_ranks(train_cache: Path, tmp_path: Path) -> None:
    run_ok(
        train_cmd(train_cache, tmp_path, "--val-shards", str(train_cache), "train.validation.every=4",
                  max_steps=8)
    )  # fmt: skip
    records = [r for r in metrics(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in records] == [4, 8]
    assert records[1]["val_loss"] < records[0]["val_loss"]
    run_ok(["python3", "-m", "train", "plot", str(tmp_path)])
